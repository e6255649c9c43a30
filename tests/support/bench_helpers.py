"""Helpers of the bench tests: a real llama-server for the load tests, the real CLI."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The real command line, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          cwd=REPO, env=env or dict(os.environ), timeout=timeout)


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def wait_healthy(server: Server, timeout: float = 180.0) -> None:
    """Poll /health until llama-server has loaded the model (or fail with its log tail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    tail = server.log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"llama-server did not become healthy:\n{tail}")
