"""Fixtures for Linux remoting: a real ggml-rpc-server started by apirctl on a free port.

Every backend a test starts is stopped afterwards by its recorded pid, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def with_build(llama_build, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Point apirctl at the session's llama.cpp build, whatever home the test runs in."""
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(llama_build.root))
    return llama_build


@pytest.fixture
def backend(with_build) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """A running host RPC backend (no weight cache, free port); yields its port."""
    from apirctl.machine import MachineState, RestartOptions, linux

    port = free_port()
    result = linux.restart(RestartOptions(remoting=True, port=port, cache=False))
    assert result.state == MachineState.READY, result
    try:
        yield port
    finally:
        record = linux.read_record()
        if record is not None and linux.is_backend_process(record.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def podman_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Podman API for these tests, found or started by apirctl's engine in its own home."""
    from apirctl import engine

    saved = os.environ.get("APIRCTL_HOME")
    os.environ["APIRCTL_HOME"] = str(tmp_path_factory.mktemp("podman-home"))
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
