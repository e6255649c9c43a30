"""Fixtures for Linux remoting: a real ggml-rpc-server started by apirctl on a free port.

Every backend a test starts is stopped afterwards by its recorded pid, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from tests.support.ports import free_port


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
