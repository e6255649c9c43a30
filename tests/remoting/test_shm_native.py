"""The patched ggml-rpc itself: the Unix-socket + shared-memory transport, with real processes.

These drive the build's `ggml-rpc-server`, `llama-server` and `llama-bench` directly (apirctl's
own wiring is tested elsewhere): the channel under AddressSanitizer and UndefinedBehaviorSanitizer,
the same greedy tokens through every transport, a server or client killed mid-run, hostile bytes
on the socket and in the shared memory, a second client, and another user.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.conftest import SHARED_CACHE, shared_env
from tests.support import native_builds
from tests.support.build_servers import greedy_tokens, llama_server
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

HELLO = 14
SHM_CAPS_MAGIC = 0x4D485352  # "RSHM", the HELLO capability of the shared-memory transport
SHM_FILE_MAGIC = 0x4D485347  # "GSHM", the memfd's header
RING = 64 * 1024
RING0_HEAD = 256  # offset of ring 0's write position in the control page
RING1_HEAD = 768  # and ring 1's (server to client)
RING0_DATA_SEQ = RING0_HEAD + 128  # ring 0's futex word, bumped for a reader that sleeps
RING0_READER_SLEEPING = RING0_DATA_SEQ + 4  # set by the server while it sleeps on that word
HOST_BUFFERS = 1  # the shm capability's feature bit: host buffers shared with the server (llama_patches/ 0007)
# commands of the protocol (their numbers in ggml-rpc.cpp)
ALLOC_BUFFER, BUFFER_GET_BASE, SET_TENSOR, GET_TENSOR = 0, 3, 6, 8
SHARE_HOST_BUFFER, UNSHARE_HOST_BUFFER, SET_TENSOR_SHARED, GET_TENSOR_SHARED = 18, 19, 20, 21
PROFILE_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rpc_profile.py"


def connects(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def tcp_connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def rpc_server(build, workdir: Path, endpoint: str = "unix", env: dict[str, str] | None = None,  # type: ignore[no-untyped-def]
               binary: Path | None = None,
               pass_fds: tuple[int, ...] = ()) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """A ggml-rpc-server on the CPU (the build's, or `binary`, inheriting `pass_fds`); yields (process, the
    client's endpoint, its log)."""
    log = workdir / f"rpc-{endpoint}.log"
    port = 0
    if endpoint == "unix":
        path = workdir / "rpc.sock"
        host, client = ["-H", f"unix:{path}"], f"unix:{path}"
    else:
        port = free_port()
        host, client = ["-H", "127.0.0.1", "-p", str(port)], f"127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(binary or build.binary("ggml-rpc-server")), *host, "-d", "CPU", "-t", "1"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                pass_fds=pass_fds)
    try:
        if endpoint == "unix":
            wait_for("the rpc server's socket", lambda: path.exists() and connects(path), 60)
        else:
            wait_for("the rpc server", lambda: tcp_connects(port), 60)
        yield proc, client, log
    finally:
        proc.kill()
        proc.wait()


def rpc_offload(endpoint: str) -> list[str]:
    return ["--rpc", endpoint, "-ngl", "99", "-dev", "RPC0"]


def hello(sock: socket.socket, caps: bytes = bytes(24)) -> bytes:
    sock.sendall(bytes([HELLO]) + struct.pack("<Q", len(caps)) + caps)
    (size,) = struct.unpack("<Q", recv_exact(sock, 8))
    return recv_exact(sock, size)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def shm_caps(ring: int = RING, features: int = 0) -> bytes:
    return struct.pack("<IIQQ", SHM_CAPS_MAGIC, 1, ring, features)


def sealed_memfd(ring: int = RING, size: int | None = None, seal: bool = True) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size if size is not None else 4096 + 2 * ring)
    with mmap.mmap(fd, 4096) as page:
        page[0:16] = struct.pack("<IIQ", SHM_FILE_MAGIC, 1, ring)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def shm_session(path: Path, fd: int, features: int = 0) -> tuple[socket.socket, int]:
    """HELLO with the shared-memory capability, then pass fd; returns the socket and the server's ack."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(path))
    answer = hello(s, shm_caps(features=features))
    assert struct.unpack_from("<I", answer, len(answer) - 24)[0] == SHM_CAPS_MAGIC  # the server offers it
    socket.send_fds(s, [b"F"], [fd])
    return s, recv_exact(s, 1)[0]


def rpc_tensor(buffer: int, data: int, n_floats: int) -> bytes:
    """ggml-rpc's packed rpc_tensor (296 bytes) for a 1-D F32 tensor at `data` in the server's `buffer`."""
    row = 4 * n_floats
    return struct.pack("<QIQ4I4II16ii10QQQQ64si", 1, 0, buffer, n_floats, 1, 1, 1, 4, row, row, row, 0, *[0] * 16,
                       0, *[0] * 10, 0, 0, data, b"t", 0)


SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine, 202)
FUTEX_WAKE = 1


def futex_wake(mem: mmap.mmap, offset: int) -> None:
    """FUTEX_WAKE on the 32-bit word at `offset` of a shared mapping."""
    word = ctypes.c_uint32.from_buffer(mem, offset)
    try:
        ctypes.CDLL(None, use_errno=True).syscall(SYS_FUTEX, ctypes.byref(word), FUTEX_WAKE, 1, None, None, 0)
    finally:
        del word  # releases the mapping's buffer, so that it can be closed


class RingClient:
    """The client's end of the shared-memory channel, spoken by hand: it writes requests into ring 0 and
    reads replies from ring 1 (a session moves less than a ring, so neither wraps around)."""

    def __init__(self, path: Path, features: int = HOST_BUFFERS) -> None:
        self.fd = sealed_memfd()
        self.sock, ack = shm_session(path, self.fd, features)
        assert ack == 1
        self.mem = mmap.mmap(self.fd, 4096 + 2 * RING)
        self.sent = self.read = 0

    def close(self) -> None:
        self.mem.close()
        os.close(self.fd)
        self.sock.close()

    def send(self, cmd: int, payload: bytes) -> None:
        self.write(struct.pack("<BQ", cmd, len(payload)) + payload)

    def write(self, data: bytes) -> None:
        """Any bytes into ring 0, then its write position, then a wake-up if the server sleeps (as the
        real client does: a server asleep on the futex would otherwise only notice at its next timeout)."""
        self.mem[4096 + self.sent:4096 + self.sent + len(data)] = data
        self.sent += len(data)
        struct.pack_into("<Q", self.mem, RING0_HEAD, self.sent)  # published after the bytes (x86 keeps the order)
        if struct.unpack_from("<I", self.mem, RING0_READER_SLEEPING)[0]:
            (seq,) = struct.unpack_from("<I", self.mem, RING0_DATA_SEQ)
            struct.pack_into("<I", self.mem, RING0_DATA_SEQ, (seq + 1) & 0xFFFFFFFF)
            futex_wake(self.mem, RING0_DATA_SEQ)

    def recv(self, n: int) -> bytes:
        wait_for("the server's reply", lambda: struct.unpack_from("<Q", self.mem, RING1_HEAD)[0] >= self.read + n, 30,
                 interval=0.001)
        start = 4096 + RING + self.read
        self.read += n
        return bytes(self.mem[start:start + n])

    def call(self, cmd: int, payload: bytes) -> bytes:
        self.send(cmd, payload)
        (size,) = struct.unpack("<Q", self.recv(8))
        return self.recv(size)

    def tensor(self, n_floats: int = 256) -> bytes:
        """A tensor of n_floats in a new buffer of the server's CPU device."""
        remote, _ = struct.unpack("<QQ", self.call(ALLOC_BUFFER, struct.pack("<IQ", 0, 4 * n_floats)))
        (base,) = struct.unpack("<Q", self.call(BUFFER_GET_BASE, struct.pack("<Q", remote)))
        return rpc_tensor(remote, base, n_floats)

    def share(self, fd: int, size: int) -> int:
        """SHARE_HOST_BUFFER with fd passed on the socket; the server's id for it (0: declined)."""
        self.send(SHARE_HOST_BUFFER, struct.pack("<Q", size))
        socket.send_fds(self.sock, [b"B"], [fd])
        (size_,) = struct.unpack("<Q", self.recv(8))
        return struct.unpack("<Q", self.recv(size_))[0]


def shared_request(tensor: bytes, offset: int, size: int, buffer_id: int, buffer_offset: int) -> bytes:
    return tensor + struct.pack("<QQQQ", offset, size, buffer_id, buffer_offset)


def bench_ok(build, model: Path, endpoint: str, env: dict[str, str] | None = None) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run([str(build.binary("llama-bench")), "-m", str(model), "--rpc", endpoint, "-ngl", "99",
                           "-dev", "RPC0", "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-o", "json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)[0]["n_gen"] == 4


def build_rpc_server(name: str, options: list[str]) -> Path:
    """ggml-rpc-server of the patched source in a debug build of ggml and the server alone (CPU backend,
    ggml's warnings as errors; well under a minute on 2 cores), cached by the series' digest."""
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    with shared_env():
        src = llamacpp.source_dir()
        build_dir = SHARED_CACHE / name / llamacpp.patches_digest()[:16]
    exe = build_dir / "cmake" / "bin" / "ggml-rpc-server"
    with native_builds.locked(name):  # test_shm_memfd.py builds the sanitized one too, maybe at once
        if not exe.exists():
            args = ["-DCMAKE_BUILD_TYPE=Debug", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF",
                    "-DGGML_RPC=ON", "-DLLAMA_FATAL_WARNINGS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", *options]
            build_dir.mkdir(parents=True, exist_ok=True)
            native_builds.cmake_build(src, build_dir, args, ("ggml-rpc-server",), f"{name} (Debug, static)",
                                      timeout=1200)
    return exe


def test_a_server_without_the_shared_memory_transport(llama_build, demo_model: Path, workdir: Path) -> None:
    """Where the shared-memory transport is off (macOS, Windows: GGML_RPC_SHM=OFF) the patched ggml-rpc
    still compiles without a warning (a Linux-only call outside its guard once broke that), and a client
    that offers shared memory and host buffers stays on its Unix socket with it and runs."""
    exe = build_rpc_server("rpc-server-no-shm", ["-DGGML_RPC_SHM=OFF"])
    with rpc_server(llama_build, workdir, binary=exe) as (server, endpoint, log):
        bench_ok(llama_build, demo_model, endpoint)
        assert server.poll() is None
        text = log.read_text(errors="replace")
        assert "Accepted client connection" in text
        assert "shared-memory transport" not in text and "shared host buffer" not in text


# where a sanitizer finding stops the server at once: the test then sees it gone, and the report in its log
SANITIZED_ENV = {"ASAN_OPTIONS": "abort_on_error=1:detect_leaks=0",
                 "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def no_sanitizer_report(log: Path) -> None:
    text = log.read_text(errors="replace")
    assert "runtime error:" not in text and "Sanitizer" not in text, text[-3000:]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "rpc"
    d.mkdir(mode=0o700)
    return d


def test_channel_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    """Streams larger than a ring, wrap-around, a dying peer, bad memfds, a hostile control page."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = llamacpp.source_dir()
    test_cpp = Path(llamacpp.patch_series()[0]).parent / "tests" / "shm_channel_test.cpp"
    exe = native_builds.compile_program(
        compiler, ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-function", "-Werror",
                   "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                   f"-I{src / 'ggml/include'}", f"-I{src / 'ggml/src'}", f"-I{src / 'ggml/src/ggml-rpc'}"],
        [test_cpp, src / "ggml/src/ggml-rpc/transport-shm.cpp"], tmp_path / "shm_channel_test", ["-lpthread"],
        "the shm channel test (sanitized)", timeout=300)
    run = subprocess.run([str(exe), "400"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1"})
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "all shm channel checks passed" in run.stdout
    assert "hostile peer: 400 rounds" in run.stdout
    fuzz = subprocess.run([str(exe), "fuzz", "3000", "7"], capture_output=True, text=True, timeout=300)
    assert fuzz.returncode == 0, fuzz.stdout + fuzz.stderr[-3000:]
    assert "fuzz: 3000 generated cases" in fuzz.stdout and ", 0 unexpected results" in fuzz.stdout


def test_same_greedy_tokens_native_tcp_and_shared_memory(llama_build, demo_model: Path, workdir: Path) -> None:
    with llama_server(llama_build, demo_model, workdir) as (_, url, _log):
        native = greedy_tokens(url)
    with rpc_server(llama_build, workdir, "tcp") as (_, endpoint, _log), \
            llama_server(llama_build, demo_model, workdir, rpc_offload(endpoint)) as (_, url, _log2):
        tcp = greedy_tokens(url)
    with rpc_server(llama_build, workdir, "unix") as (_, endpoint, log), \
            llama_server(llama_build, demo_model, workdir, rpc_offload(endpoint)) as (_, url, _log2):
        shm = greedy_tokens(url)
        assert b"RPC: shared-memory transport" in log.read_bytes()
        # the logits and the inputs in host buffers that the server maps (llama_patches/ 0007)
        assert b"shared host buffer 1: " in log.read_bytes()
    # weights read from the file, not mapped (--load-mode none): llama.cpp uploads them through staging
    # buffers of the host buffer type, so they go from shared memory to the device (SET_TENSOR_SHARED)
    with rpc_server(llama_build, workdir, "unix") as (_, endpoint, log), \
            llama_server(llama_build, demo_model, workdir,
                         [*rpc_offload(endpoint), "--load-mode", "none"]) as (_, url, _log2):
        uploaded = greedy_tokens(url)
        assert log.read_bytes().count(b"shared host buffer") >= 4  # the loader's staging buffers, then more
    # the rings alone, as before 0007
    with rpc_server(llama_build, workdir, "unix", {"GGML_RPC_NO_HOST_SHARE": "1"}) as (_, endpoint, log), \
            llama_server(llama_build, demo_model, workdir, rpc_offload(endpoint)) as (_, url, _log2):
        rings = greedy_tokens(url)
        assert b"shared host buffer" not in log.read_bytes()
    # the copies from and to pageable memory, as before the staging memory (llama_patches/ 0004)
    with rpc_server(llama_build, workdir, "unix", {"GGML_RPC_NO_STAGING": "1"}) as (_, endpoint, _log), \
            llama_server(llama_build, demo_model, workdir, rpc_offload(endpoint)) as (_, url, _log2):
        pageable = greedy_tokens(url)
    assert tcp == native
    assert shm == native
    assert uploaded == native
    assert rings == native
    assert pageable == native


def test_profile_gives_both_ends_per_token_with_one_backend_wait(llama_build, demo_model: Path,
                                                                  workdir: Path) -> None:
    """GGML_RPC_PROFILE=1 on both ends (llama_patches/ 0004): every generated token is the same cycle of
    inputs, one graph launch and one GET_TENSOR_SHARED (the logits straight into the client's host buffer,
    0007), with exactly one wait for the backend on the server, and benchmarks/rpc_profile.py reads both
    ends' per-token timeline from one run."""
    profile = {"GGML_RPC_PROFILE": "1"}
    with rpc_server(llama_build, workdir, "unix", profile) as (_, endpoint, server_log):
        done = subprocess.run([str(llama_build.binary("llama-bench")), "-m", str(demo_model), *rpc_offload(endpoint),
                               "-p", "0", "-n", "8", "-r", "1", "-t", "1", "-o", "json"],
                              capture_output=True, text=True, timeout=300, env={**os.environ, **profile})
        assert done.returncode == 0, done.stderr[-2000:]
        # the server prints once it sees the client gone
        printed = re.compile(r"RPC profile \(server\): \d+ tokens")
        wait_for("the server's profile", lambda: printed.search(server_log.read_text(errors="replace")) is not None, 30)
    client_log = workdir / "client.log"
    client_log.write_text(done.stderr)
    read = subprocess.run([sys.executable, str(PROFILE_SCRIPT), str(server_log), str(client_log), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    timeline = json.loads(read.stdout)
    server, client = timeline["server"], timeline["client"]
    assert server["tokens"] >= 8 and client["tokens"] == server["tokens"]
    s, c = server["entries"], client["entries"]
    for name in ("GET_TENSOR_SHARED", "GRAPH_RECOMPUTE", "backend wait", "reply send"):
        assert s[name]["per_token"] == 1.0, (name, s[name])
    assert "GET_TENSOR" not in s and "GET_TENSOR" not in c  # the logits no longer cross the rings
    assert c["reply wait"]["per_token"] == c["reply data"]["per_token"] == 1.0
    assert s["SET_TENSOR"]["per_token"] == c["SET_TENSOR"]["per_token"] > 0
    assert c["send"]["per_token"] == c["SET_TENSOR"]["per_token"] + 2  # and GRAPH_RECOMPUTE, GET_TENSOR_SHARED
    assert c["reply wait"]["us_per_token"] > 0 and s["waiting"]["us_per_token"] > 0
    # a log without a profile is said in one line and a hint, not a traceback
    unprofiled = workdir / "unprofiled.log"
    unprofiled.write_text("RPC: shared-memory transport, rings of 1 MiB\nClient connection closed\n")
    empty = subprocess.run([sys.executable, str(PROFILE_SCRIPT), str(unprofiled)],
                           capture_output=True, text=True, timeout=60)
    missing = subprocess.run([sys.executable, str(PROFILE_SCRIPT), str(workdir / "absent.log")],
                             capture_output=True, text=True, timeout=60)
    for bad in (empty, missing):
        assert bad.returncode == 2
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")


def test_server_killed_mid_decode_fails_the_client_fast(llama_build, demo_model: Path, workdir: Path) -> None:
    with rpc_server(llama_build, workdir) as (server, endpoint, _log), \
            llama_server(llama_build, demo_model, workdir, rpc_offload(endpoint)) as (client, url, log):
        body = json.dumps({"prompt": "Count:", "n_predict": 4000, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=60) as stream:
            stream.readline()  # the first token is out: decoding is under way
            server.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            client.wait(timeout=30)
        assert client.poll() is not None, "llama-server hung after its backend died"
        assert time.monotonic() - killed < 30
        assert "Remote RPC server crashed" in log.read_text(errors="replace")


def test_killed_client_leaves_the_server_serving(llama_build, demo_model: Path, workdir: Path) -> None:
    with rpc_server(llama_build, workdir) as (server, endpoint, log):
        client = subprocess.Popen([str(llama_build.binary("llama-bench")), "-m", str(demo_model), "--rpc", endpoint,
                                   "-ngl", "99", "-dev", "RPC0", "-p", "0", "-n", "2000", "-r", "1", "-t", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for("the bench to be running", lambda: log.read_bytes().count(b"shared-memory transport") >= 3, 120)
        client.kill()
        client.wait()
        wait_for("the server to drop it", lambda: log.read_bytes().endswith(b"Client connection closed\n"), 30)
        assert server.poll() is None
        bench_ok(llama_build, demo_model, endpoint)


def test_hostile_bytes_on_the_socket_and_in_shared_memory(llama_build, demo_model: Path, workdir: Path,
                                                          server_binary: tuple[Path, dict[str, str]]) -> None:
    binary, env = server_binary
    with rpc_server(llama_build, workdir, env=env, binary=binary) as (server, endpoint, log):
        path = Path(endpoint.removeprefix("unix:"))
        # garbage instead of HELLO, and a truncated HELLO
        for junk in (os.urandom(4096), bytes([HELLO]) + struct.pack("<Q", 24) + b"\0" * 5):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                s.sendall(junk)
        # memfds the server must refuse: not sealed, of the wrong size, a ring size it does not accept
        for fd in (sealed_memfd(seal=False), sealed_memfd(size=4096 + RING)):
            s, ack = shm_session(path, fd)
            os.close(fd)
            assert ack == 0
            s.close()
        # accepted memfds, then: a write position far beyond the ring, an unknown command, a
        # command whose payload size is absurd, and a truncated frame followed by a hang-up
        # (the server drops each of these by itself, except the truncated frame, which waits for us)
        absurd = bytes([6]) + struct.pack("<Q", 1 << 62)
        if env:  # AddressSanitizer aborts on an allocation that size where the server catches std::bad_alloc
            absurd = bytes([201])
        frames = [None, bytes([200]), absurd, bytes([6]) + struct.pack("<Q", 1000)]
        for i, frame in enumerate(frames):
            c = RingClient(path, features=0)
            if frame is None:
                struct.pack_into("<Q", c.mem, RING0_HEAD, 1 << 40)
            else:
                c.write(frame)
            if i < 3:
                closed = 4 + i + 1
                wait_for("the server to drop the hostile client",
                         lambda n=closed: log.read_bytes().count(b"Client connection closed") >= n, 30)
            c.close()
            assert server.poll() is None, log.read_text(errors="replace")[-2000:]
        wait_for("every hostile client dropped", lambda: log.read_bytes().count(b"Client connection closed") >= 8, 30)
        assert server.poll() is None
        text = log.read_text(errors="replace")
        assert "not sealed against resizing" in text
        assert "not a file of the agreed size" in text
        assert "corrupted the ring's write position" in text
        bench_ok(llama_build, demo_model, endpoint)
        assert server.poll() is None
        no_sanitizer_report(log)


def test_host_buffers_shared_with_the_server_and_hostile_requests(llama_build, demo_model: Path, workdir: Path,
                                                                  server_binary: tuple[Path, dict[str, str]]) -> None:
    """llama_patches/ 0007 by hand: a tensor read from the device straight into a host buffer the server
    maps, and written from one; buffers it must decline; and requests that reach outside a buffer or a
    tensor, name no buffer, or announce a descriptor that never comes, each of which drops that client
    and leaves the server serving."""
    binary, env = server_binary
    with rpc_server(llama_build, workdir, env=env, binary=binary) as (server, endpoint, log):
        path = Path(endpoint.removeprefix("unix:"))
        size = 64 * 1024
        shared_fd = sealed_memfd(size=size)  # any sealed memfd will do; the server does not read a header
        shared = mmap.mmap(shared_fd, size)
        c = RingClient(path)
        earlier = log.read_bytes().count(b"Client connection closed")  # the readiness probe's
        tensor = c.tensor(256)
        first, second = os.urandom(1024), os.urandom(1024)
        c.send(SET_TENSOR, tensor + b"\0" + struct.pack("<Q", 0) + first)
        buffer_id = c.share(shared_fd, size)
        assert buffer_id > 0
        assert c.call(GET_TENSOR_SHARED, shared_request(tensor, 0, 1024, buffer_id, 4096)) == b""
        assert shared[4096:5120] == first  # the tensor's bytes landed in our memory, not in a reply
        shared[8192:9216] = second
        assert c.call(SET_TENSOR_SHARED, shared_request(tensor, 0, 1024, buffer_id, 8192)) == b""
        assert c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 1024)) == second
        # declined, and the connection goes on: not sealed, not the announced size
        unsealed = sealed_memfd(size=size, seal=False)
        small = sealed_memfd(size=4096)
        assert c.share(unsealed, size) == 0
        assert c.share(small, size) == 0
        assert c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 4)) == second[:4]
        c.send(UNSHARE_HOST_BUFFER, struct.pack("<Q", buffer_id))
        assert c.call(GET_TENSOR, tensor + struct.pack("<QQ", 0, 4)) == second[:4]
        c.close()
        for fd in (unsealed, small):
            os.close(fd)
        wait_for("the server to see the client gone",
                 lambda: log.read_bytes().count(b"Client connection closed") > earlier, 30)
        text = log.read_text(errors="replace")
        assert "not sealed against resizing" in text and "not a file of the announced size" in text

        def hostile(request: Callable[[RingClient, bytes, int], None], features: int = HOST_BUFFERS) -> None:
            closed = log.read_bytes().count(b"Client connection closed")
            c = RingClient(path, features)
            try:
                tensor = c.tensor(256)
                buffer_id = c.share(shared_fd, size) if features else 0
            except AssertionError as exc:  # say what the server was doing
                tail = log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"{exc}; the server's log ends:\n{tail}") from None
            request(c, tensor, buffer_id)
            wait_for("the server to drop the hostile client",
                     lambda: log.read_bytes().count(b"Client connection closed") > closed, 30)
            c.close()
            assert server.poll() is None, log.read_text(errors="replace")[-2000:]

        for buffer_offset in (size - 512, (1 << 64) - 8):  # past the end; wrapping around
            hostile(lambda c, t, i, o=buffer_offset: c.send(GET_TENSOR_SHARED, shared_request(t, 0, 1024, i, o)))
        hostile(lambda c, t, i: c.send(SET_TENSOR_SHARED, shared_request(t, 0, 1024, i + 98, 0)))
        hostile(lambda c, t, i: c.send(GET_TENSOR_SHARED, shared_request(t, 512, 1024, i, 0)))  # past the tensor
        hostile(lambda c, t, i: c.send(UNSHARE_HOST_BUFFER, struct.pack("<Q", i + 98)))
        hostile(lambda c, t, i: c.send(SHARE_HOST_BUFFER, struct.pack("<Q", size)))  # and no descriptor
        hostile(lambda c, t, i: c.send(SHARE_HOST_BUFFER, struct.pack("<Q", size)), features=0)  # not agreed
        text = log.read_text(errors="replace")
        assert text.count("out of shared host buffer") == 2
        assert "no shared host buffer 99" in text
        assert "out of the tensor's 1024 bytes" in text
        assert text.count("no host buffer descriptor after SHARE_HOST_BUFFER") == 2
        shared.close()
        os.close(shared_fd)
        bench_ok(llama_build, demo_model, endpoint)
        assert server.poll() is None
        no_sanitizer_report(log)


def test_a_second_client_is_queued_until_the_first_leaves(llama_build, workdir: Path) -> None:
    with rpc_server(llama_build, workdir) as (_, endpoint, _log):
        path = endpoint.removeprefix("unix:")
        first = socket.socket(socket.AF_UNIX)
        first.connect(path)
        hello(first)
        second = socket.socket(socket.AF_UNIX)
        second.connect(path)
        second.settimeout(1.0)
        with pytest.raises(TimeoutError):
            hello(second)  # queued behind the first: no answer yet
        first.close()
        second.settimeout(30)
        (size,) = struct.unpack("<Q", recv_exact(second, 8))  # its HELLO, answered now
        assert recv_exact(second, size)[0] == 7  # protocol major version
        second.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as another user")
def test_another_user_cannot_connect(llama_build) -> None:  # type: ignore[no-untyped-def]
    system_python = shutil.which("python3", path="/usr/bin:/bin")  # one that `nobody` may run
    if system_python is None:
        pytest.skip("no system python3 for the other user")
    # a directory everyone may enter: only the socket's own mode keeps the other user out
    open_dir = Path(tempfile.mkdtemp(prefix="apirctl-rpc-open-", dir="/tmp"))
    open_dir.chmod(0o755)
    try:
        with rpc_server(llama_build, open_dir) as (server, endpoint, _log):
            path = endpoint.removeprefix("unix:")
            assert os.stat(path).st_mode & 0o777 == 0o600
            code = (f"import os, socket; print(sorted(os.listdir({str(open_dir)!r}))); "
                    f"socket.socket(socket.AF_UNIX).connect({path!r})")
            probe = subprocess.run([system_python, "-c", code], user="nobody", capture_output=True, text=True,
                                   timeout=30, cwd="/")
            assert "rpc.sock" in probe.stdout  # it can see the socket...
            assert probe.returncode != 0  # ...and cannot connect to it
            assert "PermissionError" in probe.stderr
            assert server.poll() is None
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)
