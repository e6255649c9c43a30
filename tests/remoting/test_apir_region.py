"""APIR's socket transport for a frontend in a VM (llama_patches/ 0025), with real processes: the frontend
reaches apir-host through a TCP stream (as a VM forwards one) and names its shared-memory resources by
their range in a region that both map (a VM's ivshmem memory; here the region's memfd itself on both
sides, the frontend opening it by path as it opens the device's BAR).

The tokens are native's; a range outside the region, one whose end wraps, one not on a page, a region
message to a host without a region, and a memfd sent with one end that client alone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import (
    FORWARD,
    FORWARD_BASE,
    HANDSHAKE,
    HANDSHAKE_MAGIC,
    LOADLIBRARY,
    REPLY_SIZE,
    Client,
    apir_host,
    asan_host,  # noqa: F401 (a fixture: apir-host under AddressSanitizer and UndefinedBehaviorSanitizer)
    good_session,
    header,
    llama_server,
    sealed_memfd,
)
from tests.support.build_servers import greedy_tokens
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

SHMEM_REGION = 4  # apir-socket.h: res_id, size, then the offset in the region (0025)
DEVICE_GET_COUNT = 1
REGION = 64 << 20


@pytest.fixture
def region() -> Iterator[int]:
    fd = sealed_memfd(REGION)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def forwarded(path: Path) -> Iterator[str]:
    """A TCP address on loopback whose connections are carried to the Unix socket `path`, as a VM's
    forwarded address is: yields the frontend's endpoint, tcp:127.0.0.1:PORT."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                guest, _ = listener.accept()
            except TimeoutError:
                continue
            host = socket.socket(socket.AF_UNIX)
            host.connect(str(path))
            for a, b in ((guest, host), (host, guest)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"tcp:127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def ended(s: socket.socket) -> bool:
    """The host closed this connection (a reset counts: it closed with bytes of ours unread)."""
    s.settimeout(30)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def frontend_env(endpoint: str, region_fd: int) -> dict[str, str]:
    return {"GGML_VIRTGPU_SOCKET": endpoint, "GGML_VIRTGPU_REGION": f"/proc/{os.getpid()}/fd/{region_fd}",
            "GGML_VIRTGPU_SHARED_BUFFERS": "0"}  # the weights in the host's memory, not in the region


def test_a_frontend_over_a_stream_with_a_region_gives_native_tokens(llama_build: llamacpp.Build, demo_model: Path,
                                                                    workdir: Path, region: int) -> None:
    with llama_server(llama_build, demo_model, workdir, None) as (_, url, _log):
        native = greedy_tokens(url)
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, region_fd=region) as (host, path, log), \
            forwarded(path) as endpoint, \
            llama_server(llama_build, demo_model, workdir, path, frontend_env(endpoint, region)) as (_, url, _log2):
        tokens = greedy_tokens(url)
        assert "a region of 64 MiB shared with the client" in log.read_text(errors="replace")
        assert host.poll() is None
    assert tokens == native
    with mmap.mmap(region, REGION) as memory:  # the resources were ranges of the region: the reply page is
        assert any(memory[0:REPLY_SIZE])     # at its start


class RegionClient(Client):
    """A hand-written frontend whose resources are ranges of a region it maps."""

    def __init__(self, path: Path, region_fd: int) -> None:
        super().__init__(path)
        self.memory = mmap.mmap(region_fd, REGION)

    def close(self) -> None:
        super().close()
        for view in self.maps.values():
            view.release()  # type: ignore[attr-defined]
        self.maps.clear()
        self.memory.close()

    def range(self, res_id: int, size: int, offset: int) -> None:
        self.sock.sendall(header(SHMEM_REGION, res_id, size) + struct.pack("<Q", offset))
        if offset % 4096 == 0 and size and offset + size <= REGION:
            self.maps[res_id] = memoryview(self.memory)[offset:offset + size]  # type: ignore[assignment]


def test_ranges_outside_the_region_end_that_client_and_the_host_serves_on(
        llama_build: llamacpp.Build, workdir: Path, region: int, request: pytest.FixtureRequest) -> None:
    exe = request.getfixturevalue("asan_host")
    with apir_host(exe, llama_build, workdir, region_fd=region) as (host, path, log):
        # a good session in the region first: its reply page and data are ranges, its calls answered there
        c = RegionClient(path, region)
        c.range(1, REPLY_SIZE, 0)
        c.range(2, 1 << 20, 1 << 20)
        ret, reply = c.call(HANDSHAKE, args=struct.pack("<II", 0, 2))
        assert ret == HANDSHAKE_MAGIC
        assert c.call(LOADLIBRARY)[0] == 0
        ret, reply = c.call(FORWARD, DEVICE_GET_COUNT)
        assert ret == FORWARD_BASE and struct.unpack_from("<i", reply)[0] == 1
        c.close()
        hostile = {
            "past its end": [header(SHMEM_REGION, 1, 4096) + struct.pack("<Q", REGION)],
            "whose end wraps": [header(SHMEM_REGION, 1, 8192) + struct.pack("<Q", (1 << 64) - 4096)],
            "not on a page": [header(SHMEM_REGION, 1, 4096) + struct.pack("<Q", 100)],
            "larger than the region": [header(SHMEM_REGION, 1, 2 * REGION) + struct.pack("<Q", 0)],
            "of no size": [header(SHMEM_REGION, 1, 0) + struct.pack("<Q", 0)],
            "without its offset": [header(SHMEM_REGION, 1, 4096) + b"\0\0\0"],
            "reusing an id": [header(SHMEM_REGION, 1, 4096) + struct.pack("<Q", 0),
                              header(SHMEM_REGION, 1, 4096) + struct.pack("<Q", 4096)],
        }
        for what, messages in hostile.items():
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                for message in messages:
                    s.sendall(message)
                if what == "without its offset":
                    s.shutdown(socket.SHUT_WR)
                assert ended(s), what  # the host ended that client
            assert host.poll() is None, what
        # a memfd sent with a region message
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            fd = sealed_memfd(4096)
            socket.send_fds(s, [header(SHMEM_REGION, 1, 4096) + struct.pack("<Q", 0)], [fd])
            os.close(fd)
            assert ended(s)
        text = log.read_text(errors="replace")
        assert text.count("is outside the region") == 4, text[-3000:]
        assert "has an invalid size 0" in text and "without its offset" in text and "already in use" in text
        assert "bad header" in text
        good_session(path)  # memfd resources as before
        assert host.poll() is None
        text = log.read_text(errors="replace")
        assert "runtime error" not in text and "Sanitizer" not in text, text[-3000:]


def test_a_host_without_a_region_refuses_a_range(llama_build: llamacpp.Build, workdir: Path) -> None:
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir) as (host, path, log):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            s.sendall(header(SHMEM_REGION, 1, 4096) + struct.pack("<Q", 0))
            assert ended(s)
        wait_for("the refusal", lambda: "this host shares none" in log.read_text(errors="replace"), 30)
        good_session(path)
        assert host.poll() is None


def test_an_unsealed_region_keeps_apir_host_from_starting(llama_build: llamacpp.Build, workdir: Path) -> None:
    fd = sealed_memfd(REGION, seal=False)
    try:
        with pytest.raises(AssertionError, match="is not a sealed memfd"), \
                apir_host(llama_build.binary("apir-host"), llama_build, workdir, region_fd=fd):
            pass
    finally:
        os.close(fd)
