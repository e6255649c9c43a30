"""The memfds a peer sends the patched ggml-rpc server, with real processes: the seals are checked
before the size (a peer that resizes the file between two checks is refused, found by a shim that
widens the window), only memfds of tmpfs are mapped (not hugetlbfs), a client that keeps sending bad
descriptors is dropped, and a client's shared host memory stops at its cap (`GGML_RPC_SHM_CAP`)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.remoting.test_shm_native import (
    GET_TENSOR,
    GET_TENSOR_SHARED,
    RING,
    RING1_HEAD,
    SANITIZED_ENV,
    SHARE_HOST_BUFFER,
    UNSHARE_HOST_BUFFER,
    RingClient,
    build_rpc_server,
    hello,
    no_sanitizer_report,
    recv_exact,
    rpc_server,
    sealed_memfd,
    shared_request,
    shm_caps,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

SHIM = Path(__file__).resolve().parent / "shim" / "memfd_race.c"
RACE_NAME = "apirctl-race"  # the memfds whose checks the shim slows down
BAD_DESCRIPTORS_MAX = 8  # bad descriptors a client may send before the server drops it (RPC_HOST_BUFFERS_BAD_MAX)
HUGE_PAGE = 2 * 1024 * 1024
MFD_HUGETLB = 4


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "rpc"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture(params=["release", "sanitized"])
def server_binary(request: pytest.FixtureRequest, llama_build) -> tuple[Path, dict[str, str]]:  # type: ignore[no-untyped-def]
    """The build's ggml-rpc-server, and the one built with AddressSanitizer and UndefinedBehaviorSanitizer."""
    if request.param == "release":
        return llama_build.binary("ggml-rpc-server"), {}
    exe = build_rpc_server("sanitized-rpc-server", ["-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON"])
    # the shim is preloaded ahead of the sanitizer's runtime
    return exe, {**SANITIZED_ENV, "ASAN_OPTIONS": SANITIZED_ENV["ASAN_OPTIONS"] + ":verify_asan_link_order=0"}


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("shim") / "memfd_race.so"
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", str(SHIM), "-o",
                           str(out), "-ldl"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@contextlib.contextmanager
def racy_server(server_binary: tuple[Path, dict[str, str]], llama_build, workdir: Path,  # type: ignore[no-untyped-def]
                shim: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path, Path]]:
    """The server with the shim preloaded; yields (process, socket path, log, the shim's directory)."""
    binary, env = server_binary
    race_dir = workdir / "race"
    race_dir.mkdir()
    # the shim talks to the test through files in race_dir, which the server's sandbox (patch 0016) rightly
    # forbids; what is tested here is the order of the memfd checks, so this server runs without it
    env = {**env, "LD_PRELOAD": str(shim), "MEMFD_RACE_NAME": RACE_NAME, "MEMFD_RACE_DIR": str(race_dir),
           "GGML_SANDBOX": "0"}
    with rpc_server(llama_build, workdir, env=env, binary=binary) as (server, endpoint, log):
        yield server, Path(endpoint.removeprefix("unix:")), log, race_dir


def racing_memfd(size: int) -> int:
    """An unsealed memfd of `size` bytes that the shim watches, with a valid channel header."""
    fd = os.memfd_create(RACE_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    with mmap.mmap(fd, 4096) as page:
        page[0:16] = struct.pack("<IIQ", 0x4D485347, 1, RING)
    return fd


def shrink_in_the_window(fd: int, race_dir: Path, answered: Callable[[], bool]) -> bool:
    """Wait until the server is between two checks of fd (the shim says so) or has answered; in the
    window, truncate the file to nothing and seal it, then let the server go on. True if it did."""
    window = race_dir / "window"
    wait_for("the server's first check of the memfd, or its answer",
             lambda: window.exists() or answered(), 30, interval=0.001)
    if not window.exists():
        return False
    os.ftruncate(fd, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    window.unlink()
    (race_dir / "go").touch()
    return True


def alive(server: subprocess.Popen[bytes], log: Path) -> None:
    assert server.poll() is None, f"the server died ({server.returncode}): {log.read_text(errors='replace')[-2000:]}"


def ring_reply_ready(c: RingClient) -> bool:
    return bool(struct.unpack_from("<Q", c.mem, RING1_HEAD)[0] >= c.read + 8)


def serves_a_good_client(path: Path) -> None:
    """A well-behaved client still gets its tensor through a shared host buffer."""
    size = 64 * 1024
    fd = sealed_memfd(size=size)
    shared = mmap.mmap(fd, size)
    c = RingClient(path)
    try:
        tensor = c.tensor(256)
        buffer_id = c.share(fd, size)
        assert buffer_id > 0
        shared[0:1024] = os.urandom(1024)
        assert c.call(GET_TENSOR_SHARED, shared_request(tensor, 0, 1024, buffer_id, 4096)) == b""
        assert c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 1024)) == shared[4096:5120]
    finally:
        c.close()
        shared.close()
        os.close(fd)


def test_a_channel_memfd_shrunk_between_the_checks_is_refused(llama_build, workdir: Path, shim: Path,
                                                              server_binary: tuple[Path, dict[str, str]]) -> None:
    """The peer sends an unsealed memfd of the right size at HELLO, and truncates it to 0 and seals it
    while the server is between its checks: a server that read the size before the seals would map an
    empty file and die of SIGBUS reading its header."""
    with racy_server(server_binary, llama_build, workdir, shim) as (server, path, log, race_dir):
        # the channel: HELLO with the shared-memory capability, then the racing memfd
        fd = racing_memfd(4096 + 2 * RING)
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        hello(s, shm_caps())
        socket.send_fds(s, [b"F"], [fd])
        s.setblocking(False)

        def acked() -> bool:
            try:
                return bool(s.recv(1, socket.MSG_PEEK))
            except BlockingIOError:
                return False
            except OSError:
                return True

        raced = shrink_in_the_window(fd, race_dir, acked)
        s.setblocking(True)
        s.settimeout(30)
        try:
            ack: int | None = recv_exact(s, 1)[0]
        except (ConnectionError, TimeoutError):
            ack = None
        s.close()
        os.close(fd)
        assert raced, "the shim never saw the server check the memfd"
        wait_for("the server to answer or die", lambda: server.poll() is not None or b"memfd" in log.read_bytes(), 30)
        alive(server, log)
        assert ack == 0
        assert "the peer's memfd is not a file of the agreed size" in log.read_text(errors="replace")
        serves_a_good_client(path)
        assert server.poll() is None
        no_sanitizer_report(log)


def test_a_host_buffer_shrunk_between_the_checks_is_declined(llama_build, workdir: Path, shim: Path,
                                                             server_binary: tuple[Path, dict[str, str]]) -> None:
    """The same race with SHARE_HOST_BUFFER: announced at 64 KiB, truncated and sealed in the window. A
    server that mapped it would die of SIGBUS at its first write into it (GET_TENSOR_SHARED)."""
    with racy_server(server_binary, llama_build, workdir, shim) as (server, path, log, race_dir):
        size = 64 * 1024
        c = RingClient(path)
        tensor = c.tensor(256)
        fd = racing_memfd(size)
        c.send(SHARE_HOST_BUFFER, struct.pack("<Q", size))
        socket.send_fds(c.sock, [b"B"], [fd])
        raced = shrink_in_the_window(fd, race_dir, lambda: ring_reply_ready(c))
        (n,) = struct.unpack("<Q", c.recv(8))
        (buffer_id,) = struct.unpack("<Q", c.recv(n))
        if buffer_id:  # mapped: the server's write into it lands past the file's end
            c.send(GET_TENSOR_SHARED, shared_request(tensor, 0, 1024, buffer_id, 0))
            wait_for("the server to answer or die", lambda: server.poll() is not None or ring_reply_ready(c), 30)
        c.close()
        os.close(fd)
        assert raced, "the shim never saw the server check the host buffer's memfd"
        alive(server, log)
        assert buffer_id == 0
        text = log.read_text(errors="replace")
        assert "declined a host buffer of 65536 bytes: not a file of the announced size" in text
        serves_a_good_client(path)
        assert server.poll() is None
        no_sanitizer_report(log)


@contextlib.contextmanager
def huge_pages() -> Iterator[None]:
    """At least one free huge page for the test, reserved (and given back) if none is, else a skip."""
    def free() -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
        return 0

    knob = Path("/proc/sys/vm/nr_hugepages")
    before = None
    if free() < 1:
        try:
            before = int(knob.read_text())
            knob.write_text(str(before + 1))
        except OSError as exc:
            pytest.skip(f"no free huge page, and none can be reserved ({exc}): hugetlbfs memfds cannot be made here")
        if free() < 1:
            knob.write_text(str(before))
            pytest.skip("no free huge page even after asking for one: hugetlbfs memfds cannot be mapped here")
    try:
        yield
    finally:
        if before is not None:
            knob.write_text(str(before))


def test_a_hugetlbfs_memfd_is_refused(llama_build, workdir: Path, server_binary: tuple[Path, dict[str, str]]) -> None:
    """A sealed memfd of the announced size on hugetlbfs passes the size and seal checks, but a hole
    punched in it later faults (SIGBUS): the server maps only memfds of tmpfs."""
    binary, env = server_binary
    with huge_pages(), rpc_server(llama_build, workdir, env=env, binary=binary) as (server, endpoint, log):
        try:
            fd = os.memfd_create("hostile-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | MFD_HUGETLB)
        except OSError as exc:
            pytest.skip(f"this kernel makes no hugetlbfs memfd ({exc})")
        os.ftruncate(fd, HUGE_PAGE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        with mmap.mmap(fd, HUGE_PAGE) as mine:  # it can be mapped: only the server's check refuses it
            mine[0] = 1
        path = Path(endpoint.removeprefix("unix:"))
        c = RingClient(path)
        assert c.share(fd, HUGE_PAGE) == 0
        tensor = c.tensor(16)  # and the connection goes on
        assert len(c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 64))) == 64
        c.close()
        os.close(fd)
        assert server.poll() is None
        assert "declined a host buffer of 2097152 bytes: not a memfd of tmpfs" in log.read_text(errors="replace")
        serves_a_good_client(path)
        no_sanitizer_report(log)


def test_a_client_that_keeps_sending_bad_descriptors_is_dropped(llama_build, workdir: Path,
                                                                 server_binary: tuple[Path, dict[str, str]]) -> None:
    """Each bad descriptor (unsealed, of the wrong size) is declined and the connection goes on, up to
    a small limit; one more and the server drops the client, which cannot retry a race forever."""
    binary, env = server_binary
    with rpc_server(llama_build, workdir, env=env, binary=binary) as (server, endpoint, log):
        path = Path(endpoint.removeprefix("unix:"))
        size = 64 * 1024
        c = RingClient(path)
        tensor = c.tensor(16)
        closed = log.read_bytes().count(b"Client connection closed")
        for i in range(BAD_DESCRIPTORS_MAX):
            fd = sealed_memfd(size=size, seal=False) if i % 2 else sealed_memfd(size=4096)
            assert c.share(fd, size) == 0
            os.close(fd)
        assert len(c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 64))) == 64  # still served
        fd = sealed_memfd(size=size, seal=False)
        c.send(SHARE_HOST_BUFFER, struct.pack("<Q", size))
        socket.send_fds(c.sock, [b"B"], [fd])
        os.close(fd)
        wait_for("the server to drop the client",
                 lambda: log.read_bytes().count(b"Client connection closed") > closed, 30)
        assert not ring_reply_ready(c)  # no answer to the last one: dropped
        c.close()
        assert server.poll() is None
        assert f"{BAD_DESCRIPTORS_MAX + 1} bad host buffer descriptors: dropping the client" in log.read_text(
            errors="replace")
        serves_a_good_client(path)
        no_sanitizer_report(log)


def test_a_client_past_its_cap_is_declined(llama_build, workdir: Path,
                                          server_binary: tuple[Path, dict[str, str]]) -> None:
    """GGML_RPC_SHM_CAP bounds the bytes one client shares with (and may have pinned by) the server:
    past it a buffer is declined, as often as the client asks (a client of the library meets it
    legitimately), and the connection goes on; what is unshared can be shared again."""
    binary, env = server_binary
    cap = 128 * 1024
    with rpc_server(llama_build, workdir, env={**env, "GGML_RPC_SHM_CAP": str(cap)},
                    binary=binary) as (server, endpoint, log):
        path = Path(endpoint.removeprefix("unix:"))
        c = RingClient(path)
        tensor = c.tensor(16)
        big = sealed_memfd(size=cap)
        first = c.share(big, cap)
        assert first > 0
        small = sealed_memfd(size=4096)
        for _ in range(2 * BAD_DESCRIPTORS_MAX):  # not counted as bad descriptors
            assert c.share(small, 4096) == 0
        assert len(c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 64))) == 64
        c.send(UNSHARE_HOST_BUFFER, struct.pack("<Q", first))
        assert c.share(small, 4096) > 0
        too_big = sealed_memfd(size=cap)
        assert c.share(too_big, cap) == 0  # 4 KiB are in use: a whole cap no longer fits
        c.close()
        for fd in (big, small, too_big):
            os.close(fd)
        assert server.poll() is None
        text = log.read_text(errors="replace")
        assert text.count("declined a host buffer of 4096 bytes: over the limit of shared host memory") == \
            2 * BAD_DESCRIPTORS_MAX
        assert "dropping the client" not in text
        no_sanitizer_report(log)
