"""Inference servers: llama-server in a Podman container, reached over OpenAI's HTTP API.

`inputs` (the options: flags over settings; the port; the model file), `starting` (plan → model → image → container
spec → create → start → wait for /health, top to bottom), `servers` (the running servers from their
labels, with health; logs; stop).
"""

from __future__ import annotations

from apirctl.podman.servers import Server
from apirctl.serve.inputs import ModelFile, ServeOptions, check_port, options, resolve_model
from apirctl.serve.servers import find_server, health, list_servers, logs, stop
from apirctl.serve.starting import Phase, ServeFailed, Started, generate, restart, start

__all__ = ["ModelFile", "Phase", "ServeFailed", "ServeOptions", "Server", "Started", "check_port", "find_server",
           "generate", "health", "list_servers", "logs", "options", "resolve_model", "restart", "start",
           "stop"]
