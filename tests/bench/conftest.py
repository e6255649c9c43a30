"""Fixtures for the bench tests: a real llama-server on the loopback, a Podman API, free ports.

Nothing is faked: the load generator drives llama-server started from the llama.cpp build with
the demo model, and the container modes run the real image through real podman.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


@pytest.fixture(scope="session")
def llama_server(llama_build: Any, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """llama-server from the build, bound to 127.0.0.1, with 4 slots for the concurrency tests."""
    port = free_port()
    log = tmp_path_factory.mktemp("bench-server") / "llama-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(llama_build.binary("llama-server")), "-m", str(demo_model), "--host", "127.0.0.1",
             "--port", str(port), "-np", "4", "-c", "2048", "-t", "2"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=proc, log=log)
    try:
        wait_healthy(server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def podman_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Podman API for the session, found or started by apirctl's engine in its own home."""
    from apirctl import engine

    saved = os.environ.get("APIRCTL_HOME")
    os.environ["APIRCTL_HOME"] = str(tmp_path_factory.mktemp("bench-podman-home"))
    try:
        yield engine.discover().url
        engine.stop_service()
    finally:
        if saved is None:
            os.environ.pop("APIRCTL_HOME", None)
        else:
            os.environ["APIRCTL_HOME"] = saved


@pytest.fixture
def podman(podman_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CONTAINER_HOST", podman_url)
    return podman_url
