"""Helpers of the chat tests: a real llama-server process on the loopback, and the real CLI.

Imported by name (this folder is on sys.path under pytest's default import mode); the name is
unique so that it cannot clash with other test folders' helpers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

CTX_SIZE = 2048
READY_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LlamaServer:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.origin}/v1"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_llama_server(build: Any, model: Path, log: Path, port: int | None = None) -> LlamaServer:
    """Start llama-server bound to 127.0.0.1; the caller waits for it (see `wait_ready`)."""
    port = port or free_port()
    cmd = [
        str(build.binary("llama-server")),
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(CTX_SIZE),
        "--parallel", "1",
        "--threads", "2",
        "--no-webui",
    ]  # fmt: skip
    handle = log.open("wb")
    process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    handle.close()
    return LlamaServer(process=process, port=port, log=log)


def wait_ready(server: LlamaServer, timeout: float = READY_TIMEOUT) -> None:
    """Poll /health until it says ok (llama-server answers 503 while the model loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"llama-server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.origin}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"llama-server not ready after {timeout} s:\n{server.log_tail()}")


def stop(server: LlamaServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def apirctl_command() -> list[str]:
    """The installed CLI of this checkout, run as users run it."""
    script = Path(sys.executable).parent / "apirctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "apirctl"]


def run_chat(*args: str, stdin: str | None = None, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """`apirctl chat ARGS` in a subprocess (stdin is a pipe, so never interactive)."""
    return subprocess.run(
        [*apirctl_command(), "chat", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )
