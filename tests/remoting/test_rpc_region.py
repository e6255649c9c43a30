"""The RPC transport's rings in a region both ends map (llama_patches/ 0024), with real processes: what a
VM's guest and its backend do over QEMU's ivshmem device, here with the region's memfd itself on both
sides (the guest's end opens it by path, as it opens the device's BAR).

The backend maps the memfd it inherits (`GGML_RPC_SHM_REGION_FD`) and makes fresh rings in it at each
HELLO; a client that names a region (`GGML_RPC_SHM_REGION`) asks for them instead of passing a memfd.
The tokens are native's, hostile bytes in the region or on the socket end only that session, and a
region the backend cannot trust is not used.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.vm.region import GUEST_ENV, HOST_ENV, REGION_BYTES, Region
from tests.remoting.test_shm_native import (
    HELLO,
    RING0_HEAD,
    SHM_CAPS_MAGIC,
    bench_ok,
    hello,
    no_sanitizer_report,
    rpc_offload,
    rpc_server,
    sealed_memfd,
)
from tests.support.build_servers import greedy_tokens, llama_server
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

REGION_FEATURE = 2  # the shm capability's bit: rings in the region, no memfd passed (0024)
REGION_LOG = b"shared-memory transport in a region"
CTL = 4096  # the control page before the rings


@pytest.fixture
def region() -> Iterator[Region]:
    with Region.create() as made:
        yield made


def guest_env(region: Region) -> dict[str, str]:
    """The client's view: the region by path, as the guest names its device's BAR."""
    return {**os.environ, GUEST_ENV: f"/proc/{os.getpid()}/fd/{region.fd}"}


def peer_closed(s: socket.socket) -> bool:
    """The server closed the session's socket (recv returns nothing; never blocks)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False


def region_hello(path: Path) -> tuple[socket.socket, int, int]:
    """HELLO asking for the region's rings; returns the socket, the server's features and ring size."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(path))
    answer = hello(s, struct.pack("<IIQQ", SHM_CAPS_MAGIC, 1, 0, REGION_FEATURE))
    magic, _version, ring, features = struct.unpack_from("<IIQQ", answer, len(answer) - 24)
    assert magic == SHM_CAPS_MAGIC
    return s, features, ring


def test_a_client_with_a_region_gives_native_tokens_through_it(llama_build, demo_model: Path, workdir: Path,
                                                               region: Region) -> None:
    with llama_server(llama_build, demo_model, workdir) as (_, url, _log):
        native = greedy_tokens(url)
    with rpc_server(llama_build, workdir, env=region.backend_env(), pass_fds=(region.fd,)) as (server, endpoint, log), \
            llama_server(llama_build, demo_model, workdir, rpc_offload(endpoint), env=guest_env(region)) as (_, url, _):
        tokens = greedy_tokens(url)
        assert REGION_LOG in log.read_bytes()  # said only to a client that asked for the region
        # no memfd crossed: the server mapped none of the client's
        assert b"shared host buffer" not in log.read_bytes()
        assert server.poll() is None
    assert tokens == native
    # the rings are in the region: the client's requests moved its write position
    with mmap.mmap(region.fd, CTL) as page:
        assert struct.unpack_from("<Q", page, RING0_HEAD)[0] > 0


def test_hostile_bytes_in_the_region_end_that_session_only(llama_build, demo_model: Path, workdir: Path,
                                                          region: Region,
                                                          server_binary: tuple[Path, dict[str, str]]) -> None:
    binary, env = server_binary
    with rpc_server(llama_build, workdir, env={**env, **region.backend_env()}, binary=binary,
                    pass_fds=(region.fd,)) as (server, endpoint, log), \
            mmap.mmap(region.fd, REGION_BYTES) as mem:
        path = Path(endpoint.removeprefix("unix:"))
        # a write position far beyond the ring, then an unknown command, each in a session of its own
        refusals = (("position", "corrupted the ring's write position"), ("command", "Unknown command: 200"))
        for hostile, refusal in refusals:
            s, features, ring = region_hello(path)
            assert features & REGION_FEATURE and ring >= 64 * 1024
            if hostile == "position":
                struct.pack_into("<Q", mem, RING0_HEAD, 1 << 40)
            else:
                mem[CTL] = 200
                struct.pack_into("<Q", mem, RING0_HEAD, 1)
            wait_for(f"the server to refuse the {hostile}", lambda r=refusal: r in log.read_text(errors="replace"), 30)
            wait_for("the server to drop the hostile session", lambda s=s: peer_closed(s), 30)
            s.close()
            assert server.poll() is None, log.read_text(errors="replace")[-2000:]
        # garbage on the socket instead of HELLO
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            s.sendall(bytes([HELLO]) + os.urandom(64))
        # the next client gets fresh rings and is served through them
        before = log.read_bytes().count(REGION_LOG)
        bench_ok(llama_build, demo_model, endpoint, guest_env(region))
        assert log.read_bytes().count(REGION_LOG) > before
        assert server.poll() is None
        no_sanitizer_report(log)


def test_a_region_the_server_cannot_trust_is_not_used(llama_build, demo_model: Path, workdir: Path) -> None:
    """An unsealed memfd (it could shrink under the mapping) is refused at the first HELLO: the server
    says so and serves the client on its socket."""
    fd = sealed_memfd(size=REGION_BYTES, seal=False)
    try:
        with rpc_server(llama_build, workdir, env={HOST_ENV: str(fd)}, pass_fds=(fd,)) as (server, endpoint, log):
            s, features, _ = region_hello(Path(endpoint.removeprefix("unix:")))
            s.close()
            assert not features & REGION_FEATURE
            wait_for("the server's refusal", lambda: b"is not a sealed memfd: no region" in log.read_bytes(), 30)
            bench_ok(llama_build, demo_model, endpoint)
            assert REGION_LOG not in log.read_bytes()
            assert server.poll() is None
    finally:
        os.close(fd)


def test_a_client_with_a_region_stays_on_the_socket_of_a_server_without_one(llama_build, demo_model: Path,
                                                                           workdir: Path, region: Region) -> None:
    """A container's backend has no region: a client that asks for one passes no memfd either, and both
    go on over the socket (a client that passed nothing must not leave the server waiting for a memfd)."""
    with rpc_server(llama_build, workdir) as (server, endpoint, log):
        bench_ok(llama_build, demo_model, endpoint, guest_env(region))
        text = log.read_bytes()
        assert REGION_LOG not in text and b"shared-memory transport" not in text
        assert server.poll() is None
