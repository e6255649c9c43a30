"""Fixtures for Linux remoting: a real ggml-rpc-server started by apirctl on a free port.

Every backend a test starts is stopped afterwards by its recorded pid, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder only its owner may enter, for a test's sockets and logs (a module may name its own)."""
    d = tmp_path / "work"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture(scope="module")
def sanitized_rpc_server() -> Path:
    """ggml-rpc-server built with AddressSanitizer and UndefinedBehaviorSanitizer: the server parses every
    byte a container sends."""
    from tests.remoting.test_shm_native import build_rpc_server

    return build_rpc_server("sanitized-rpc-server", ["-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON"])


@pytest.fixture(params=["release", "sanitized"])
def server_binary(request: pytest.FixtureRequest, llama_build) -> tuple[Path, dict[str, str]]:  # type: ignore[no-untyped-def]
    """The server the hostile tests attack: the build's, and the one built with the sanitizers."""
    if request.param == "release":
        return llama_build.binary("ggml-rpc-server"), {}
    from tests.remoting.test_shm_native import SANITIZED_ENV

    return request.getfixturevalue("sanitized_rpc_server"), SANITIZED_ENV


@pytest.fixture
def with_build(llama_build, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Point apirctl at the session's llama.cpp build, whatever home the test runs in."""
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(llama_build.root))
    return llama_build


@pytest.fixture
def backend(with_build) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """A running host RPC backend (no weight cache, free port); yields its port."""
    from apirctl.machine import MachineState, RestartOptions
    from apirctl.remoting import rpc_server

    port = free_port()
    try:
        result = rpc_server.restart(RestartOptions(remoting=True, port=port, cache=False))
        assert result.state == MachineState.READY, result
        yield port
    finally:
        record = rpc_server.read_record()
        if record is not None and rpc_server.is_backend_process(record.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
