"""Our RPC client against the real ggml-rpc-server, and against peers that are not one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from apirctl.remoting import rpc_client
from tests.support.ports import free_port


@pytest.fixture
def garbage_server() -> Iterator[int]:
    """A TCP server that answers anything with an HTTP error, as a wrong service on the port would."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = int(lsock.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join()
    lsock.close()


def test_nothing_listening_is_a_refused_connection() -> None:
    with pytest.raises(ConnectionRefusedError):
        rpc_client.probe("127.0.0.1", free_port(), timeout=1)


def test_a_service_that_is_not_rpc_is_rejected(garbage_server: int) -> None:
    with pytest.raises(rpc_client.RpcError, match="HELLO: answer of"):
        rpc_client.probe("127.0.0.1", garbage_server, timeout=2)


@pytest.mark.integration
def test_probe_reads_version_devices_and_memory(backend: int) -> None:
    info = rpc_client.probe("127.0.0.1", backend)
    assert info.major == rpc_client.PROTOCOL_MAJOR
    assert info.devices, "the server reports at least one device"
    for device in info.devices:
        assert 0 < device.free <= device.total


@pytest.mark.integration
def test_a_second_client_waits_while_one_is_connected(backend: int) -> None:
    """The server serves one connection at a time: a probe meanwhile is 'busy', then works again."""
    first = socket.create_connection(("127.0.0.1", backend), timeout=5)
    try:
        assert rpc_client.hello(first).startswith(f"{rpc_client.PROTOCOL_MAJOR}.")
        assert rpc_client.device_count(first) >= 1
        with pytest.raises(rpc_client.RpcBusy):
            rpc_client.probe("127.0.0.1", backend, timeout=0.5)
    finally:
        first.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            assert rpc_client.probe("127.0.0.1", backend, timeout=1).devices
            break
        except rpc_client.RpcBusy:
            assert time.monotonic() < deadline, "the server never came back to a new client"
