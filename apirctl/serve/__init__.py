"""Inference servers: llama-server in a Podman container, reached over OpenAI's HTTP API.

`inputs` (the options: flags over settings; the port; the model file, or a router's set of models), `spec`
(the container spec, built one way: serve, --generate and restart's rewiring), `provision` (one step that
claims the port, plans, resolves the model, starts the host processes a transport needs and builds the
spec, releasing what it made when the start fails), `starting` (provision → create → start → wait for
/health, top to bottom; generate; restart), `servers` (the running servers from their labels, with health
and a router's models; logs; stop).
"""

from __future__ import annotations

from apirctl.podman.servers import Server
from apirctl.serve.inputs import (
    ModelFile,
    ModelSet,
    ServeOptions,
    check_port,
    options,
    resolve_model,
    resolve_models,
)
from apirctl.serve.servers import find_server, health, list_servers, logs, router_models, stop
from apirctl.serve.starting import Phase, ServeFailed, Started, generate, restart, start

__all__ = ["ModelFile", "ModelSet", "Phase", "ServeFailed", "ServeOptions", "Server", "Started", "check_port",
           "find_server", "generate", "health", "list_servers", "logs", "options", "resolve_model", "resolve_models",
           "restart", "router_models", "start", "stop"]
