"""Fixtures for the bench tests: a real llama-server on the loopback, a Podman API, free ports.

Nothing is faked: the load generator drives llama-server started from the llama.cpp build with
the demo model, and the container modes run the real image through real podman.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.bench_helpers import Server, wait_healthy
from tests.support.ports import free_port


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
