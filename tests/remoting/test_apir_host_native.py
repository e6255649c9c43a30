"""API remoting on Linux without a VM: the patched ggml-virtgpu frontend against `apir-host`, with real processes.

`apir-host` (llama_patches 0008) does what virglrenderer's APIR component does for krunkit: it maps
the frontend's shared memory, answers HANDSHAKE and LOADLIBRARY, and hands FORWARD commands to the
real host backend library. Here it runs on the CPU backend: built with AddressSanitizer and
UndefinedBehaviorSanitizer and fed hostile clients, and as built by `apirctl setup` behind the
build's llama-server, which must generate the same greedy tokens as native CPU llama.cpp.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from apirctl.apir import extensions, messages, table
from apirctl.apir import trace as apir_trace
from apirctl.apir.tensor import FLAG_OUTPUT, OP_ADD, OP_MUL_MAT, Graph, RpcTensor, Tensor
from apirctl.build import llamacpp
from tests.support import build_servers, native_builds, upstream_apir
from tests.support.build_servers import greedy_tokens
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

# apir-socket.h: the framing on the socket
MAGIC = 0x31535041  # "APS1"
SHMEM_CREATE, SHMEM_DESTROY, COMMAND = 1, 2, 3
HEADER = struct.Struct("<IIIIQ")
# api_remoting.h and the dispatch table (docs/apir.md)
HANDSHAKE, LOADLIBRARY, FORWARD = 0, 1, 2
HANDSHAKE_MAGIC = 0xAB1E
DEVICE_GET_COUNT, DEVICE_GET_NAME, BUFFER_TYPE_GET_NAME = 1, 2, 10
DEVICE_BUFFER_FROM_PTR, BUFFER_SET_TENSOR, GRAPH_COMPUTE = 9, 17, 22
DEVICE_GET_BUFFER_TYPE, BUFFER_TYPE_ALLOC_BUFFER = 7, 14
FORWARD_NO_DISPATCH_FCT, FORWARD_BASE = 1, 4
RPC_TENSOR_SIZE = 304
REPLY_SIZE = 16384
TRACE_RECORD = struct.Struct("<IIIIIIQQ")


def header(kind: int, res_id: int = 0, size: int = 0, magic: int = MAGIC, reserved: int = 0) -> bytes:
    return HEADER.pack(magic, kind, res_id, reserved, size)


def sealed_memfd(size: int, seal: bool = True, file_size: int | None = None) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size if file_size is None else file_size)
    if seal:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


class Client:
    """A frontend written by hand: every message is ours to get right, or wrong."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(str(path))
        self.maps: dict[int, mmap.mmap] = {}

    def close(self) -> None:
        self.sock.close()

    def shmem(self, res_id: int, size: int, announced: int | None = None, seal: bool = True,
              file_size: int | None = None) -> None:
        fd = sealed_memfd(size, seal, file_size)
        socket.send_fds(self.sock, [header(SHMEM_CREATE, res_id, size if announced is None else announced)], [fd])
        self.maps[res_id] = mmap.mmap(fd, size if file_size is None else file_size)
        os.close(fd)

    def command(self, cmd_type: int, flags: int, reply_id: int, args: bytes = b"") -> None:
        body = struct.pack("<iiI", cmd_type, flags, reply_id) + args
        self.sock.sendall(header(COMMAND, size=len(body)) + body)

    def call(self, cmd_type: int, flags: int = 0, args: bytes = b"", reply_id: int = 1,
             timeout: float = 60) -> tuple[int, bytes]:
        """Send a command and wait for the host's answer in the reply resource: (return value, reply bytes)."""
        page = self.maps[reply_id]
        page[0:4] = bytes(4)
        self.command(cmd_type, flags, reply_id, args)
        deadline = time.monotonic() + timeout
        while (word := struct.unpack_from("<I", page, 0)[0]) == 0:
            assert time.monotonic() < deadline, "no answer from apir-host"
            time.sleep(0.0005)
        return word - 1, bytes(page[4:REPLY_SIZE])

    def closed_by_host(self, timeout: float = 30) -> bool:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def good_session(path: Path) -> None:
    """What the frontend does first: reply and data resources, handshake, library, a few calls."""
    c = Client(path)
    try:
        c.shmem(1, REPLY_SIZE)
        c.shmem(2, 1 << 20)
        ret, reply = c.call(HANDSHAKE, args=struct.pack("<II", 0, 2))
        assert ret == HANDSHAKE_MAGIC and struct.unpack_from("<II", reply) == (0, 2)
        assert c.call(LOADLIBRARY)[0] == 0
        ret, reply = c.call(FORWARD, DEVICE_GET_COUNT)
        assert ret == FORWARD_BASE and struct.unpack_from("<i", reply)[0] == 1
        ret, reply = c.call(FORWARD, DEVICE_GET_NAME)
        (length,) = struct.unpack_from("<Q", reply)
        assert ret == FORWARD_BASE and reply[8:8 + length - 1] == b"CPU"
    finally:
        c.close()


def decode_trace(trace: Path) -> list[tuple[int, int, int, bytes]]:
    """The trace: a magic, then per command answered a record, the command as received and the reply."""
    data = trace.read_bytes()
    assert data[:8] == b"APIRTRC1"
    records, at = [], 8
    while at < len(data):
        cmd_type, flags, ret, req_len, reply_len, reserved, start, _duration = TRACE_RECORD.unpack_from(data, at)
        at += TRACE_RECORD.size
        request = data[at:at + req_len]
        reply = data[at + req_len:at + req_len + reply_len]
        at += req_len + reply_len
        assert reserved == 0 and start > 0 and struct.unpack_from("<i", request)[0] == cmd_type
        records.append((cmd_type, flags, ret, reply))
    assert at == len(data)
    return records


@pytest.fixture(scope="module")
def asan_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """apir-host compiled from the patched source with AddressSanitizer and UndefinedBehaviorSanitizer."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = llamacpp.source_dir()
    virtgpu = src / "ggml/src/ggml-virtgpu"
    return native_builds.compile_program(
        compiler, ["-std=c++20", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function",
                   "-Wno-unused-parameter", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                   "-fno-omit-frame-pointer", f"-I{virtgpu}", f"-I{src / 'ggml/src'}", f"-I{src / 'ggml/include'}",
                   f"-I{virtgpu / 'backend'}"],
        [virtgpu / "host/apir-host.cpp"], tmp_path_factory.mktemp("asan") / "apir-host", ["-ldl"],
        "apir-host (sanitized)", timeout=300)


@contextlib.contextmanager
def apir_host(exe: Path, build: llamacpp.Build, workdir: Path, trace: Path | None = None,
              env: dict[str, str] | None = None, backend_library: Path | None = None,
              region_fd: int | None = None, extra_args: Sequence[str] = (), ggml_library: Path | None = None
              ) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """apir-host on the CPU backend, or the ggml library `ggml_library` (with `env` added to its
    environment), over the build's backend library or `backend_library`, sharing the memfd `region_fd`
    with its clients if given; yields (process, socket, log)."""
    path, log = workdir / "apir.sock", workdir / "apir-host.log"
    library = backend_library or build.library("ggml-virtgpu-backend")
    args = [str(exe), "--socket", str(path), "--backend-library", str(library),
            "--ggml-library", str(ggml_library or build.library("ggml-cpu"))]
    if trace is not None:
        args += ["--trace", str(trace)]
    if region_fd is not None:
        args += ["--region-fd", str(region_fd)]
    args += list(extra_args)
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                pass_fds=(region_fd,) if region_fd is not None else (),
                                # a crash of the backend library (by design, in a child) is a signal, not a report
                                env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:handle_segv=0",
                                     **(env or {})})
    try:
        wait_for("apir-host to listen",
                 lambda: b"apir-host: listening on" in log.read_bytes() or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text(errors="replace")
        yield proc, path, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "apir"
    d.mkdir(mode=0o700)
    return d


def test_host_survives_hostile_clients_under_sanitizers(asan_host: Path, llama_build: llamacpp.Build,
                                                        workdir: Path) -> None:
    trace = workdir / "trace.bin"
    with apir_host(asan_host, llama_build, workdir, trace) as (host, path, log):
        assert os.stat(path).st_mode & 0o777 == 0o600
        good_session(path)

        def dropped(send, expect: str) -> None:  # type: ignore[no-untyped-def]
            c = Client(path)
            try:
                send(c)
                assert c.closed_by_host(), f"the host kept a client that {expect}"
            finally:
                c.close()
            assert host.poll() is None, log.read_text(errors="replace")[-3000:]
            wait_for(expect, lambda: expect in log.read_text(errors="replace"), 30)

        # framing: garbage, a bad magic, an unknown message type, a truncated header, a huge or tiny command
        dropped(lambda c: c.sock.sendall(os.urandom(4096)), "bad header")
        dropped(lambda c: c.sock.sendall(header(7)), "unknown message type 7")
        dropped(lambda c: c.sock.sendall(header(COMMAND, reserved=1)), "bad header")
        dropped(lambda c: c.sock.sendall(header(COMMAND, size=1 << 40)), "a command of 1099511627776 bytes")
        dropped(lambda c: c.sock.sendall(header(COMMAND, size=8)), "a command of 8 bytes")

        def truncated_header(c: Client) -> None:
            c.sock.sendall(header(COMMAND, size=64)[:10])
            c.sock.shutdown(socket.SHUT_WR)

        dropped(truncated_header, "inside a message header")

        def truncated_command(c: Client) -> None:
            c.sock.sendall(header(COMMAND, size=1000) + bytes(100))
            c.sock.shutdown(socket.SHUT_WR)

        dropped(truncated_command, "inside a command")
        # memfds: none, unsealed, smaller than announced, a bad size, id 0, an id twice, too many descriptors
        dropped(lambda c: c.sock.sendall(header(SHMEM_CREATE, 1, 16384)), "without its memfd")
        dropped(lambda c: c.shmem(1, REPLY_SIZE, seal=False), "not sealed against resizing")
        dropped(lambda c: c.shmem(1, REPLY_SIZE, announced=1 << 30), "not a file of the announced size")
        dropped(lambda c: c.shmem(1, 1000), "invalid size 1000")
        dropped(lambda c: c.shmem(0, REPLY_SIZE), "resource id 0 is reserved")

        def twice(c: Client) -> None:
            c.shmem(5, REPLY_SIZE)
            c.shmem(5, REPLY_SIZE)

        dropped(twice, "resource id 5 is already in use")

        def fd_with_command(c: Client) -> None:
            fd = sealed_memfd(REPLY_SIZE)
            socket.send_fds(c.sock, [header(COMMAND, size=12) + bytes(12)], [fd])
            os.close(fd)

        dropped(fd_with_command, "bad header")
        dropped(lambda c: c.sock.sendall(header(SHMEM_DESTROY, 42)), "destroying resource 42")
        # commands: unknown or too small reply resources, a short handshake, garbage command types
        dropped(lambda c: c.command(HANDSHAKE, 0, 99, struct.pack("<II", 0, 2)), "resource 99 does not exist")

        def small_reply(c: Client) -> None:
            c.shmem(1, 4096)
            c.command(HANDSHAKE, 0, 1, struct.pack("<II", 0, 2))

        dropped(small_reply, "resource 1 is too small")

        def with_reply(send):  # type: ignore[no-untyped-def]
            def run(c: Client) -> None:
                c.shmem(1, REPLY_SIZE)
                send(c)
            return run

        dropped(with_reply(lambda c: c.command(HANDSHAKE, 0, 1)), "a handshake without the guest's version")
        for cmd_type in (3, -1, 331, 0x7FFFFFFF):
            dropped(with_reply(lambda c, t=cmd_type: c.command(t, 0, 1)), f"unknown command type {cmd_type}")

        # extra descriptors with a memfd are closed and the memfd is used
        c = Client(path)
        a, b = sealed_memfd(REPLY_SIZE), sealed_memfd(REPLY_SIZE)
        socket.send_fds(c.sock, [header(SHMEM_CREATE, 1, REPLY_SIZE)], [a, b])
        c.maps[1] = mmap.mmap(a, REPLY_SIZE)
        os.close(a)
        os.close(b)
        assert c.call(HANDSHAKE, args=struct.pack("<II", 0, 2))[0] == HANDSHAKE_MAGIC
        c.close()

        # answered, not dropped: FORWARD before LOADLIBRARY (which the library never sees)
        c = Client(path)
        c.shmem(1, REPLY_SIZE)
        assert c.call(FORWARD, DEVICE_GET_COUNT)[0] == FORWARD_NO_DISPATCH_FCT
        assert c.call(LOADLIBRARY)[0] == 0
        assert c.call(LOADLIBRARY)[0] == 2  # APIR_LOAD_LIBRARY_ALREADY_LOADED
        assert c.call(FORWARD, DEVICE_GET_COUNT)[0] == FORWARD_BASE  # still serving this client
        c.close()

        # answered with an error, then dropped: every call the library or the host refuses
        def refused(name: str, build, expect: int = FORWARD_BASE + 1) -> None:  # type: ignore[no-untyped-def]
            c = Client(path)
            try:
                c.shmem(1, REPLY_SIZE)
                c.shmem(2, 65536)
                assert c.call(LOADLIBRARY)[0] == 0
                buft = struct.unpack_from("<Q", c.call(FORWARD, DEVICE_GET_BUFFER_TYPE)[1])[0]
                ret, reply = c.call(FORWARD, BUFFER_TYPE_ALLOC_BUFFER, struct.pack("<QQ", buft, 4096))
                buffer = struct.unpack_from("<Q", reply)[0]
                assert ret == FORWARD_BASE and buffer != 0
                fn, args = build(buffer)
                assert c.call(FORWARD, fn, args)[0] == expect, name
                assert c.closed_by_host(), f"the host kept a client after {name}"
            finally:
                c.close()
            assert host.poll() is None, log.read_text(errors="replace")[-3000:]

        def tensor(buffer: int, data: int, n: int = 16) -> RpcTensor:
            return RpcTensor(id=1, buffer=buffer, ne=[n, 1, 1, 1], nb=[4, 4 * n, 4 * n, 4 * n], data=data, name=b"t")

        def transfer(fn: str, t: RpcTensor, buffer: int, size: int) -> tuple[int, bytes]:
            return table.by_name(fn).index, messages.encode_request(fn, buffer=buffer, tensor=t, res_id=2, offset=0,
                                                                   size=size)

        # a function the library does not have is answered, and the client goes on: that answer is how a
        # frontend learns what an upstream library lacks (EXT_GET_FEATURES)
        c = Client(path)
        c.shmem(1, REPLY_SIZE)
        assert c.call(LOADLIBRARY)[0] == 0
        for function in (23, -1, 300):
            assert c.call(FORWARD, function)[0] == FORWARD_BASE + 6, function
        assert c.call(FORWARD, DEVICE_GET_COUNT)[0] == FORWARD_BASE
        c.close()
        refused("a graph larger than its resource", lambda b: (GRAPH_COMPUTE, struct.pack("<IQ", 2, 1 << 20)))
        refused("a buffer from a pointer larger than its resource",
                lambda b: (DEVICE_BUFFER_FROM_PTR, struct.pack("<IQQ", 2, 1 << 30, 1 << 30)))
        refused("64 MiB written into a 64-byte tensor",
                lambda b: transfer("buffer_set_tensor", tensor(b, 0), b, 1 << 26))
        refused("a read past the shared resource",
                lambda b: transfer("buffer_get_tensor", tensor(b, 0, 1 << 20 // 4), b, 1 << 20))
        # an arbitrary read of a host address into shared memory: a tensor without a buffer whose data
        # is an address (upstream copied from it)
        refused("a tensor without a buffer read at an address",
                lambda b: transfer("buffer_get_tensor", tensor(0, 0x7F0000001000), b, 8))
        # the first step of a program-counter hijack: 8 bytes over the buffer object's interface, at the
        # address upstream's handle was (then buffer_free_buffer would call through it)
        refused("a write at the buffer handle as an address",
                lambda b: transfer("buffer_set_tensor", tensor(0, b), b, 8))
        refused("a tensor past its buffer", lambda b: transfer("buffer_set_tensor", tensor(b, 4090), b, 8))
        # a fake buffer-type interface table in the guest's own memory, named by a handle: upstream cast
        # the handle to a pointer and called through it
        refused("an unknown buffer-type handle",
                lambda b: (BUFFER_TYPE_GET_NAME, struct.pack("<Q", 0x7F0000002000)))
        refused("an unknown buffer id", lambda b: (table.by_name("buffer_free_buffer").index, struct.pack("<Q", b + 1)))
        text = log.read_text(errors="replace")
        assert "moves 1048576 bytes through resource 2 of 65536 bytes" in text
        assert "refused buffer_get_tensor: ending the client" in text

        # a client that dies inside a command
        dying = subprocess.Popen([sys.executable, "-c", (
            "import socket, struct, time, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            f"s.sendall(struct.pack('<IIIIQ', {MAGIC}, {COMMAND}, 0, 0, 4000) + bytes(50)); time.sleep(60)"),
            str(path)])
        time.sleep(0.5)
        dying.kill()
        dying.wait()
        wait_for("the dead client dropped", lambda: log.read_text(errors="replace").count("inside a command") >= 2, 30)

        assert host.poll() is None
        good_session(path)
        text = log.read_text(errors="replace")
        assert "runtime error" not in text and "AddressSanitizer" not in text, text[-3000:]
    assert host.returncode == 0, log.read_text(errors="replace")[-3000:]  # SIGTERM: a clean exit
    assert not path.exists()  # the socket is removed

    records = decode_trace(trace)
    assert records[0] == (HANDSHAKE, 0, HANDSHAKE_MAGIC, struct.pack("<II", 0, 2))
    assert (FORWARD, DEVICE_GET_COUNT, FORWARD_BASE, struct.pack("<i", 1)) in records


def test_host_refuses_to_start_insecurely(llama_build: llamacpp.Build, tmp_path: Path) -> None:
    exe = llama_build.binary("apir-host")
    libs = ["--backend-library", str(llama_build.library("ggml-virtgpu-backend")),
            "--ggml-library", str(llama_build.library("ggml-cpu"))]
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    done = subprocess.run([str(exe), "--socket", str(open_dir / "s.sock"), *libs], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0 and "writable by others" in done.stderr
    done = subprocess.run([str(exe), "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "are required" in done.stderr
    not_a_trace = tmp_path / "notes.txt"
    not_a_trace.write_text("my notes\n")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    done = subprocess.run([str(exe), "--socket", str(private / "s.sock"), *libs, "--trace", str(not_a_trace)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "not an apir-host trace" in done.stderr
    assert not_a_trace.read_text() == "my notes\n"
    for bad in ("0", "two", "5000"):
        done = subprocess.run([str(exe), "--socket", str(private / "s.sock"), *libs, "--threads", bad],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and "--threads takes a whole number from 1 to 4096" in done.stderr, bad


@pytest.mark.parametrize("threads", [1, 2])
def test_the_host_names_a_cpu_backends_thread_count(llama_build: llamacpp.Build, workdir: Path, threads: int) -> None:
    """llama_patches/ 0026: the backend library sets the thread count apir-host was given (ggml's default of 4
    whatever the host has made generation on 2 cores a third as fast), and apirctl gives half the CPUs by
    default, as ggml-rpc-server's own default."""
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, extra_args=["--threads", str(threads)]) \
            as (host, path, log):
        good_session(path)
        wait_for("the backend's thread count",
                 lambda: f"n_threads = {threads}" in log.read_text(errors="replace"), 30)
        assert host.poll() is None


def test_a_fifth_client_waits_until_one_of_four_leaves(llama_build: llamacpp.Build, workdir: Path) -> None:
    """apir-host serves four clients at once (llama-server's router keeps one connection of its own);
    a fifth stays in the listen queue, unanswered, until one of them leaves, and is then served."""
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir) as (proc, path, _log):
        held = []
        for _ in range(4):
            c = Client(path)
            c.shmem(1, REPLY_SIZE)
            ret, _reply = c.call(HANDSHAKE, args=struct.pack("<II", 0, 2))
            assert ret == HANDSHAKE_MAGIC
            held.append(c)
        fifth = Client(path)  # the kernel accepts the connection for the listen queue
        fifth.shmem(1, REPLY_SIZE)
        page = fifth.maps[1]
        page[0:4] = bytes(4)
        fifth.command(HANDSHAKE, 0, 1, struct.pack("<II", 0, 2))
        time.sleep(2)
        assert struct.unpack_from("<I", page, 0)[0] == 0, "a fifth client was served beside four"
        held.pop().close()
        wait_for("the fifth client's handshake answer", lambda: struct.unpack_from("<I", page, 0)[0] != 0, 30)
        assert struct.unpack_from("<I", page, 0)[0] - 1 == HANDSHAKE_MAGIC
        for c in (*held, fifth):
            c.close()
        assert proc.poll() is None


@contextlib.contextmanager
def llama_server(build: llamacpp.Build, model: Path, workdir: Path, socket_path: Path | None,
                 extra_env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """The build's llama-server: on the APIR device when socket_path is given, else native CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
    if socket_path is not None:
        env["GGML_VIRTGPU_SOCKET"] = str(socket_path)
    env.update(extra_env or {})
    with build_servers.llama_server(build, model, workdir, ["-ngl", "99"] if socket_path else None, env) as found:
        yield found


def test_same_greedy_tokens_native_and_through_apir_host(llama_build: llamacpp.Build, demo_model: Path,
                                                         workdir: Path) -> None:
    with llama_server(llama_build, demo_model, workdir, None) as (_, url, log):
        native = greedy_tokens(url)
        assert "ggml-virtgpu" not in log.read_text(errors="replace")  # no socket: no device, not a word
    trace = workdir / "trace.bin"
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, host_log):
        with llama_server(llama_build, demo_model, workdir, path) as (_, url, _log):
            remote = greedy_tokens(url)
        # the client is gone: the host ends its session by itself (before it is stopped, which would end it too)
        wait_for("the host to see its client go",
                 lambda: "client disconnected" in host_log.read_text(errors="replace"), 30)
    assert remote == native
    # the generation ran on the host: a graph compute per token at least, through the trace (one
    # ext_graph_run each, or an ext_graph_delta where only the shapes changed: patches 0013 and 0021)
    calls = decode_trace(trace)
    computes = [r for r in calls if r[0] == FORWARD and r[1] in (extensions.GRAPH_RUN, extensions.GRAPH_DELTA)
                and r[2] == FORWARD_BASE and extensions.decode_graph_run_reply(r[3])[0] == extensions.RESULT_DONE]
    assert len(computes) >= 24
    assert not any(r[1] == GRAPH_COMPUTE for r in calls if r[0] == FORWARD)


@pytest.mark.parametrize("upstream_side", ["frontend", "host"])
def test_both_pairings_with_upstream_give_natives_tokens(llama_build: llamacpp.Build, demo_model: Path,
                                                         workdir: Path, upstream_side: str) -> None:
    """Upstream's frontend (RamaLama's remoting image) against apirctl's host library, and apirctl's
    frontend against upstream's library (the macOS bundle's): both generate native's greedy tokens, with
    upstream's calls (a graph compute per token), the frontend having asked for the features and been
    told of none by an upstream library, which keeps the client."""
    upstream = upstream_apir.libraries()
    with llama_server(llama_build, demo_model, workdir, None) as (_, url, _log):
        native = greedy_tokens(url)
    trace = workdir / "trace.bin"
    backend_library = upstream / "libggml-virtgpu-backend.so" if upstream_side == "host" else None
    client_env = {"LD_LIBRARY_PATH": str(upstream)} if upstream_side == "frontend" else {}
    # upstream's library finds the build's libggml-base, as the frontend does
    host_env = {"LD_LIBRARY_PATH": str(llama_build.bin_dir)} if upstream_side == "host" else None
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace, env=host_env,
                   backend_library=backend_library) as (_, path, host_log):
        with llama_server(llama_build, demo_model, workdir, path, client_env) as (server, url, _log):
            maps = Path(f"/proc/{server.pid}/maps").read_text()
            remote = greedy_tokens(url)
        wait_for("the host to see its client go",
                 lambda: "client disconnected" in host_log.read_text(errors="replace"), 30)
    frontend = next(line.split()[-1] for line in maps.splitlines() if "libggml-virtgpu.so" in line)
    assert Path(frontend).resolve().parent == (upstream if upstream_side == "frontend"
                                               else llama_build.bin_dir).resolve()
    assert remote == native
    calls = [r for r in decode_trace(trace) if r[0] == FORWARD]
    computes = [r for r in calls if r[1] == GRAPH_COMPUTE and r[2] == FORWARD_BASE]
    assert len(computes) >= 24 and not any(r[1] == extensions.GRAPH_RUN for r in calls)
    asked = [r for r in calls if r[1] == extensions.GET_FEATURES]
    if upstream_side == "host":
        assert [r[2] for r in asked] == [FORWARD_BASE + 6]  # asked once, told the library lacks it
    else:
        assert asked == []  # upstream's frontend never asks


def test_host_killed_mid_decode_fails_the_client_clearly(llama_build: llamacpp.Build, demo_model: Path,
                                                          workdir: Path) -> None:
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir) as (host, path, _), \
            llama_server(llama_build, demo_model, workdir, path) as (client, url, log):
        body = json.dumps({"prompt": "Count:", "n_predict": 4000, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=60) as stream:
            stream.readline()  # decoding is under way
            host.send_signal(signal.SIGKILL)  # its child serving the client dies with it
            killed = time.monotonic()
            client.wait(timeout=30)
        assert client.poll() is not None, "llama-server hung after the APIR host died"
        assert time.monotonic() - killed < 30
        assert "the APIR host closed the connection" in log.read_text(errors="replace")


def test_socket_set_but_no_host_is_a_clear_error(llama_build: llamacpp.Build, demo_model: Path,
                                                 workdir: Path) -> None:
    env = {**os.environ, "GGML_VIRTGPU_SOCKET": str(workdir / "nobody.sock")}
    done = subprocess.run([str(llama_build.binary("llama-server")), "-m", str(demo_model), "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "cannot connect to the APIR host at GGML_VIRTGPU_SOCKET=" in done.stderr


# --- EXT_GRAPH_RUN (patch 0013): a token's exchange in one call, graphs kept by id -----------------

DATA_RES, OUT_RES = 2, 3
WRITES_AT, X_AT, Y_AT = 1 << 18, 1 << 19, (1 << 19) + 64  # in the data resource, after the graph
OUT = (extensions.Output(0, 0),)


class GraphRunClient(Client):
    """A client with a reply, a 1 MiB data and a 64 KiB output resource, the library loaded and a
    4 KiB buffer of the CPU backend's memory (what a GPU host's buffers are: copies are calls)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.shmem(1, REPLY_SIZE)
        self.shmem(DATA_RES, 1 << 20)
        self.shmem(OUT_RES, 1 << 16)
        assert self.call(LOADLIBRARY)[0] == 0
        buft = struct.unpack_from("<Q", self.call(FORWARD, DEVICE_GET_BUFFER_TYPE)[1])[0]
        ret, reply = self.call(FORWARD, BUFFER_TYPE_ALLOC_BUFFER, struct.pack("<QQ", buft, 4096))
        assert ret == FORWARD_BASE
        self.buffer = struct.unpack_from("<Q", reply)[0]

    def graph(self, name: str = "out") -> tuple[Tensor, Tensor, bytes]:
        """out = x + y, 16 floats each, in this client's buffer; (x, y, the graph's serialization)."""
        x = Tensor((16,), name="x", buffer=self.buffer, offset=0)
        y = Tensor((16,), name="y", buffer=self.buffer, offset=64)
        out = Tensor((16,), op=OP_ADD, src=[x, y], name=name, flags=FLAG_OUTPUT, buffer=self.buffer, offset=128)
        return x, y, Graph([out]).serialize()

    def inputs(self, x: Tensor, y: Tensor) -> tuple[extensions.Write, ...]:
        """Writes of x and y, their bytes at X_AT and Y_AT."""
        return (extensions.Write(self.buffer, x.to_rpc(), 0, 64, X_AT),
                extensions.Write(self.buffer, y.to_rpc(), 0, 64, Y_AT))

    def run(self, graph_id: int, graph: bytes = b"", writes: tuple[extensions.Write, ...] = (),
            outputs: tuple[extensions.Output, ...] = (), x: list[float] | None = None, y: list[float] | None = None,
            graph_size: int | None = None, res_id: int = DATA_RES, out_res_id: int = OUT_RES,
            n_writes: int | None = None, writes_offset: int = WRITES_AT) -> tuple[int, int, int]:
        """One EXT_GRAPH_RUN, its graph, writes and their bytes put in the data resource first:
        (forward return, result, status)."""
        data = self.maps[DATA_RES]
        data[0:len(graph)] = graph
        block = extensions.encode_writes(writes)[:len(data) - writes_offset]
        data[writes_offset:writes_offset + len(block)] = block
        for at, values in ((X_AT, x), (Y_AT, y)):
            if values is not None:
                data[at:at + 64] = struct.pack("<16f", *values)
        request = extensions.GraphRun(graph_id, res_id, len(graph) if graph_size is None else graph_size, writes_offset,
                                      len(writes) if n_writes is None else n_writes, out_res_id, outputs)
        ret, reply = self.call(FORWARD, extensions.GRAPH_RUN, request.encode())
        if ret != FORWARD_BASE:
            return ret, -1, -1
        result, status = extensions.decode_graph_run_reply(reply)
        return ret, result, status

    def output(self) -> list[float]:
        return list(struct.unpack("<16f", self.maps[OUT_RES][0:64]))


def test_graph_run_keeps_graphs_by_id_and_refuses_what_it_must(asan_host: Path, llama_build: llamacpp.Build,
                                                                workdir: Path) -> None:
    done = (FORWARD_BASE, extensions.RESULT_DONE, 0)
    with apir_host(asan_host, llama_build, workdir) as (host, path, log):
        c = GraphRunClient(path)
        ret, reply = c.call(FORWARD, extensions.GET_FEATURES)
        assert ret == FORWARD_BASE and extensions.decode_features(reply) & extensions.FEATURE_GRAPH_RUN
        x, y, graph = c.graph()
        ones, tens = [1.0 + i for i in range(16)], [10.0 * i for i in range(16)]
        assert c.run(1, graph, c.inputs(x, y), OUT, ones, tens) == done
        assert c.output() == [a + b for a, b in zip(ones, tens, strict=True)]

        # the graph named by its id computes the new inputs its writes bring
        assert c.run(1, b"", c.inputs(x, y), OUT, tens, tens) == done
        assert c.output() == [2 * b for b in tens]

        # an id the host does not hold is answered as unknown, and nothing of the call is applied
        assert c.run(99, b"", c.inputs(x, y), OUT, ones, ones)[:2] == (FORWARD_BASE, extensions.RESULT_UNKNOWN_GRAPH)
        c.maps[OUT_RES][0:64] = bytes(64)
        assert c.run(1, outputs=OUT) == done
        assert c.output() == [2 * b for b in tens], "the unknown graph's writes were applied"

        # writes alone (graph id 0): applied, nothing computed
        c.maps[OUT_RES][0:64] = bytes(64)
        assert c.run(0, b"", c.inputs(x, y), (), ones, ones) == done
        assert c.output() == [0.0] * 16
        assert c.run(1, outputs=OUT) == done
        assert c.output() == [2 * a for a in ones]

        # a cleared buffer keeps the graphs that name it (they hold its tensors, not its bytes): by its
        # id, the graph computes on the cleared bytes
        clear = messages.encode_request("buffer_clear", buffer=c.buffer, value=0x40)
        assert c.call(FORWARD, table.by_name("buffer_clear").index, clear)[0] == FORWARD_BASE
        assert c.run(1, outputs=OUT) == done
        filled = struct.unpack("<f", b"\x40" * 4)[0]
        assert c.output() == [filled + filled] * 16

        # the cache is bounded: four more graphs push the first out
        for graph_id in range(2, 6):
            assert c.run(graph_id, c.graph(f"out{graph_id}")[2]) == done
        assert c.run(1, outputs=OUT)[1] == extensions.RESULT_UNKNOWN_GRAPH
        assert c.run(5) == done

        # a freed buffer drops every graph that could name it; sending one again that names it is refused
        free = table.by_name("buffer_free_buffer").index
        assert c.call(FORWARD, free, struct.pack("<Q", c.buffer))[0] == FORWARD_BASE
        assert c.run(5)[1] == extensions.RESULT_UNKNOWN_GRAPH
        assert c.run(5, graph)[0] == FORWARD_BASE + 1
        assert c.closed_by_host(), "the host kept a client that named a freed buffer"
        c.close()

        # no sharing between clients: the next client's id 1 is not the last one's
        a = GraphRunClient(path)
        assert a.run(1, a.graph()[2]) == done
        a.close()
        b = GraphRunClient(path)
        assert b.run(1)[1] == extensions.RESULT_UNKNOWN_GRAPH
        b.close()

        def refused(name: str, send) -> None:  # type: ignore[no-untyped-def]
            c = GraphRunClient(path)
            try:
                x, y, graph = c.graph()
                assert send(c, x, y, graph)[0] == FORWARD_BASE + 1, name
                assert c.closed_by_host(), f"the host kept a client after {name}"
            finally:
                c.close()
            assert host.poll() is None, log.read_text(errors="replace")[-3000:]

        W, Out = extensions.Write, extensions.Output
        refused("a graph without an id", lambda c, x, y, g: c.run(0, g))
        refused("a graph larger than its resource", lambda c, x, y, g: c.run(1, g, graph_size=2 << 20))
        refused("a graph in an unknown resource", lambda c, x, y, g: c.run(1, g, res_id=77))
        refused("a write to an unknown buffer", lambda c, x, y, g: c.run(0, writes=(W(c.buffer + 1, x.to_rpc(), 0,
                                                                                       64, X_AT),)))
        refused("a write past its tensor", lambda c, x, y, g: c.run(0, writes=(W(c.buffer, x.to_rpc(), 32, 64, X_AT),)))
        refused("a write whose bytes wrap around",
                lambda c, x, y, g: c.run(0, writes=(W(c.buffer, x.to_rpc(), 0, 64, (1 << 64) - 32),)))
        refused("a write past its resource",
                lambda c, x, y, g: c.run(0, writes=(W(c.buffer, x.to_rpc(), 0, 64, (1 << 20) - 32),)))
        refused("write records past their resource",
                lambda c, x, y, g: c.run(0, writes=c.inputs(x, y), writes_offset=(1 << 20) - extensions.WRITE_SIZE))
        refused("more writes than the host takes", lambda c, x, y, g: c.run(0, writes=c.inputs(x, y), n_writes=257))
        refused("outputs without a graph", lambda c, x, y, g: c.run(0, outputs=OUT))
        refused("an output naming no node", lambda c, x, y, g: c.run(1, g, outputs=(Out(5, 0),)))
        refused("an output past its resource", lambda c, x, y, g: c.run(1, g, outputs=(Out(0, (1 << 16) - 32),)))
        refused("an output in an unknown resource", lambda c, x, y, g: c.run(1, g, outputs=OUT, out_res_id=77))

        # get_alloc_size hands the backend only tensors it can check (ggml-cuda asserts on a
        # FLASH_ATTN_EXT without its K): a product without its second source is refused
        c = GraphRunClient(path)
        buft = struct.unpack_from("<Q", c.call(FORWARD, DEVICE_GET_BUFFER_TYPE)[1])[0]
        plain = messages.encode_request("buffer_type_get_alloc_size", buft=buft, op=Tensor((16, 4), name="t"))
        ret, reply = c.call(FORWARD, table.by_name("buffer_type_get_alloc_size").index, plain)
        assert ret == FORWARD_BASE and struct.unpack_from("<Q", reply)[0] == 256
        lone = Tensor((4, 4), op=OP_MUL_MAT, src=[Tensor((16, 4), name="a")], name="mm")
        one_source = messages.encode_request("buffer_type_get_alloc_size", buft=buft, op=lone)
        assert c.call(FORWARD, table.by_name("buffer_type_get_alloc_size").index, one_source)[0] == FORWARD_BASE + 1
        assert c.closed_by_host()
        c.close()
        assert host.poll() is None
        good_session(path)
        text = log.read_text(errors="replace")
        assert "runtime error" not in text and "AddressSanitizer" not in text, text[-3000:]


def forwarded_between_computes(records: list[apir_trace.Record]) -> list[int]:
    """For each generated token after the first two computes: the forwarded calls from one compute to
    the next (1 when the compute is the token's only call). A graph run answered unknown or a delta
    refused computed nothing: the call that sends the graph again is the compute."""
    forwarded = [r for r in records if r.cmd_type == FORWARD]
    computes = [i for i, r in enumerate(forwarded)
                if r.name == "backend_graph_compute" or ((found := r.graph_run()) and found[0].graph_id
                                                         and found[1] == extensions.RESULT_DONE)]
    return [b - a for a, b in zip(computes[1:], computes[2:], strict=False)]


@pytest.mark.parametrize("shared_buffers", ["1", "0"], ids=["shared-buffers", "host-buffers"])
def test_graph_run_gives_native_tokens_in_one_call_per_token(llama_build: llamacpp.Build, demo_model: Path,
                                                            workdir: Path, shared_buffers: str) -> None:
    with llama_server(llama_build, demo_model, workdir, None) as (_, url, _log):
        native = greedy_tokens(url)
    summaries = {}
    for graph_run in ("1", "0"):
        trace = workdir / f"trace-{graph_run}.bin"
        env = {"GGML_VIRTGPU_SHARED_BUFFERS": shared_buffers, "GGML_VIRTGPU_GRAPH_RUN": graph_run}
        with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, _host_log), \
                llama_server(llama_build, demo_model, workdir, path, env) as (_, url, _log):
            assert greedy_tokens(url) == native, f"graph run {graph_run}, shared buffers {shared_buffers}"
        records = apir_trace.read(trace.read_bytes())
        summaries[graph_run] = (apir_trace.summarize(records), forwarded_between_computes(records))

    on, between_on = summaries["1"]
    off, between_off = summaries["0"]
    cache = on.graph_cache
    assert on.computes >= 24 and "backend_graph_compute" not in on.functions
    # with APIR_FEATURE_GRAPH_DELTA (0021) the first decode graph is a delta of the prompt's; the KV
    # cache's clear at the request's start leaves the host's kept graphs, so none is answered unknown
    assert cache.by_id >= 20 and cache.sent + cache.delta <= 3 and cache.unknown == 0, cache
    # generation: the compute is each token's only call (the first gap still has the server's start-up)
    assert len(between_on) >= 16 and set(between_on[1:]) == {1}, between_on
    if shared_buffers == "0":  # a GPU host's path: the inputs ride with the compute, the logits come back with it
        assert cache.writes >= 2 * on.computes and cache.outputs >= on.computes, cache
    else:  # inputs and outputs live in memory both sides map: nothing to carry
        assert cache.writes == 0 and cache.outputs == 0, cache
    # upstream's calls: the graph sent with every compute, and with host buffers its copies as calls
    assert off.computes >= 24 and off.graph_cache.by_id == 0 and "ext_graph_run" not in off.functions
    assert off.graph_bytes_per_compute and off.graph_bytes_per_compute > 100_000
    assert on.graph_bytes_per_compute is not None and on.graph_bytes_per_compute < off.graph_bytes_per_compute / 8
    if shared_buffers == "0":
        assert min(between_off[1:]) > 2, between_off


@pytest.mark.parametrize(("extra", "n"), [(["-b", "4", "-ub", "4"], 24),
                                         (["-c", "24", "-np", "1", "--context-shift"], 40)],
                         ids=["prompt-in-ubatches-of-4", "kv-cache-shift"])
def test_graph_run_follows_graphs_that_change_shape(llama_build: llamacpp.Build, demo_model: Path, workdir: Path,
                                                    extra: list[str], n: int) -> None:
    """Prompts cut into ubatches of other sizes, and a context shift (a K-shift graph, then generation
    over shifted positions): every graph that differs is sent, never mistaken for a kept one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", *extra], env) as (_, url, _log):
        native = greedy_tokens(url, n)
    trace = workdir / "trace.bin"
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, _host_log):
        remote_env = {**env, "GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0"}
        with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "99", *extra], remote_env) as \
                (_, url, _log):
            remote = greedy_tokens(url, n)
    assert remote == native
    cache = apir_trace.summarize(apir_trace.read(trace.read_bytes())).graph_cache
    # a graph of the same nodes in other shapes may travel as a delta (0021); the KV cache's clears
    # drop none of the kept graphs
    assert cache.sent + cache.delta >= 3 and cache.by_id >= n // 2 and cache.unknown == 0, cache


# --- indices: GET_ROWS, SET_ROWS and MUL_MAT_ID read them from tensor data while they compute -------

OP_GET_ROWS, TYPE_I32 = 40, 26
ROWS, WIDTH = 4, 16  # the table GET_ROWS reads from: 4 rows of 16 floats


def get_rows_graph(buffer: int, n_ids: int, ids_at: int = 512, out_at: int | None = None,
                   overwrite_ids: bool = False) -> tuple[Graph, Tensor]:
    """rows = GET_ROWS(table, ids) in one buffer: the table at 0, `n_ids` int32 ids at `ids_at`, the
    rows after them (or at `out_at`). With `overwrite_ids`, an ADD computed first writes its result over
    the ids' memory; (the graph, the ids)."""
    table_t = Tensor((WIDTH, ROWS), name="table", buffer=buffer, offset=0)
    ids = Tensor((n_ids,), type=TYPE_I32, name="ids", buffer=buffer, offset=ids_at)
    nodes = []
    if overwrite_ids:
        nodes.append(Tensor((n_ids,), op=OP_ADD, src=[Tensor((n_ids,), name="a", buffer=buffer,
                                                                      offset=ids_at + 4 * n_ids),
                                                      Tensor((n_ids,), name="b", buffer=buffer,
                                                             offset=ids_at + 8 * n_ids)],
                            name="over-ids", buffer=buffer, offset=ids_at))
    rows_at = ids_at + 12 * n_ids if out_at is None else out_at
    nodes.append(Tensor((WIDTH, n_ids), op=OP_GET_ROWS, src=[table_t, ids], name="rows", flags=FLAG_OUTPUT,
                        buffer=buffer, offset=rows_at))
    return Graph(nodes), ids


def test_indices_are_checked_where_the_guest_cannot_change_them(asan_host: Path, llama_build: llamacpp.Build,
                                                                workdir: Path) -> None:
    """Indices out of range are refused wherever they are, a graph whose nodes overwrite the indices a
    later node reads is refused, and indices in memory the guest shares are read from the host's copy:
    a guest flipping one between a good and a bad value while the host computes gets answers, never an
    abort (the CPU backend asserts on an index out of range)."""
    with apir_host(asan_host, llama_build, workdir) as (host, path, log):
        table_values = [float(r * 100 + c) for r in range(ROWS) for c in range(WIDTH)]

        # in a buffer of the host's memory, written by the call itself
        c = GraphRunClient(path)
        graph, ids = get_rows_graph(c.buffer, 4, ids_at=256, out_at=512)
        table_t = graph.nodes[-1].src[0]
        data = c.maps[DATA_RES]
        data[X_AT:X_AT + 256] = struct.pack(f"<{ROWS * WIDTH}f", *table_values)
        data[X_AT + 256:X_AT + 272] = struct.pack("<4i", 3, 0, 2, 3)
        writes = (extensions.Write(c.buffer, table_t.to_rpc(), 0, 256, X_AT),
                  extensions.Write(c.buffer, ids.to_rpc(), 0, 16, X_AT + 256))
        assert c.run(1, graph.serialize(), writes, OUT) == (FORWARD_BASE, extensions.RESULT_DONE, 0)
        got = struct.unpack(f"<{4 * WIDTH}f", c.maps[OUT_RES][0:4 * WIDTH * 4])
        assert list(got) == [table_values[r * WIDTH + col] for r in (3, 0, 2, 3) for col in range(WIDTH)]
        # the same graph by its id, an index past the table's rows
        data[X_AT + 256:X_AT + 272] = struct.pack("<4i", 3, 0, ROWS, 3)
        assert c.run(1, b"", writes[1:], OUT)[0] == FORWARD_BASE + 1
        assert c.closed_by_host()
        c.close()
        wait_for("the refusal logged", lambda: "has an index out of range" in log.read_text(errors="replace"), 30)

        # a clear keeps the graph, and fills its indices with -1: by its id, the run is refused (the
        # indices are checked on every run, not when the graph arrived)
        c = GraphRunClient(path)
        graph, ids = get_rows_graph(c.buffer, 4, ids_at=256, out_at=512)
        data = c.maps[DATA_RES]
        data[X_AT:X_AT + 256] = struct.pack(f"<{ROWS * WIDTH}f", *table_values)
        data[X_AT + 256:X_AT + 272] = struct.pack("<4i", 3, 0, 2, 3)
        writes = (extensions.Write(c.buffer, graph.nodes[-1].src[0].to_rpc(), 0, 256, X_AT),
                  extensions.Write(c.buffer, ids.to_rpc(), 0, 16, X_AT + 256))
        assert c.run(1, graph.serialize(), writes, OUT) == (FORWARD_BASE, extensions.RESULT_DONE, 0)
        clear = messages.encode_request("buffer_clear", buffer=c.buffer, value=0xff)
        assert c.call(FORWARD, table.by_name("buffer_clear").index, clear)[0] == FORWARD_BASE
        assert c.run(1, outputs=OUT)[0] == FORWARD_BASE + 1
        assert c.closed_by_host()
        c.close()
        assert host.poll() is None

        # a node computed before GET_ROWS writes over its indices: refused when the graph arrives
        c = GraphRunClient(path)
        graph, _ = get_rows_graph(c.buffer, 4, ids_at=256, out_at=512, overwrite_ids=True)
        assert c.run(1, graph.serialize())[0] == FORWARD_BASE + 1
        assert c.closed_by_host()
        c.close()
        assert "reads indices that node 0 writes" in log.read_text(errors="replace")

        # a buffer that is the guest's own shared memory, one index flipped while the host computes
        n_ids, size = 4096, 1 << 20
        ids_at = 1024
        fd = sealed_memfd(size)
        try:
            shared = mmap.mmap(fd, size)
            shared[0:ROWS * WIDTH * 4] = struct.pack(f"<{ROWS * WIDTH}f", *table_values)
            shared[ids_at:ids_at + 4 * n_ids] = struct.pack(f"<{n_ids}i", *(i % ROWS for i in range(n_ids)))
            flip_at = ids_at + 4 * (n_ids - 1)
            flipper = subprocess.Popen([sys.executable, "-c", (
                "import mmap, sys\n"
                f"m = mmap.mmap({fd}, {size})\n"
                "good, bad = (1).to_bytes(4, 'little'), (1 << 30).to_bytes(4, 'little')\n"
                f"while True:\n    m[{flip_at}:{flip_at + 4}] = bad\n    m[{flip_at}:{flip_at + 4}] = good\n")],
                pass_fds=(fd,))
            answered = refused = 0
            try:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and answered + refused < 200:
                    c = Client(path)
                    try:
                        c.shmem(1, REPLY_SIZE)
                        socket.send_fds(c.sock, [header(SHMEM_CREATE, DATA_RES, size)], [fd])
                        c.shmem(OUT_RES, 1 << 16)
                        assert c.call(LOADLIBRARY)[0] == 0
                        ret, reply = c.call(FORWARD, DEVICE_BUFFER_FROM_PTR, struct.pack("<IQQ", DATA_RES, size, size))
                        buffer = struct.unpack_from("<Q", reply)[0]
                        assert ret == FORWARD_BASE and buffer != 0
                        graph, _ = get_rows_graph(buffer, n_ids, ids_at=ids_at)
                        serialized = graph.serialize()
                        c.maps[OUT_RES][0:len(serialized)] = serialized
                        run = extensions.GraphRun(1, OUT_RES, len(serialized), 0, 0, OUT_RES, ())
                        ret, reply = c.call(FORWARD, extensions.GRAPH_RUN, run.encode())
                        assert ret in (FORWARD_BASE, FORWARD_BASE + 1), f"the host answered {ret}"
                        if ret == FORWARD_BASE:
                            assert extensions.decode_graph_run_reply(reply) == (extensions.RESULT_DONE, 0)
                            answered += 1
                        else:
                            refused += 1
                    finally:
                        c.close()
                    assert host.poll() is None
            finally:
                flipper.kill()
                flipper.wait()
        finally:
            os.close(fd)
        assert answered > 0 and refused > 0, (answered, refused)  # the flips met both checks
        good_session(path)
        text = log.read_text(errors="replace")
        assert "GGML_ASSERT" not in text and "ended by signal" not in text, text[-3000:]
        assert "runtime error" not in text and "AddressSanitizer" not in text, text[-3000:]


WIDE_OP_PROBE = """
import ctypes, struct, sys
ggml, base = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(sys.argv[2])
class Params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]
P, I64 = ctypes.c_void_p, ctypes.c_int64
for lib, name, res, args in ((base, "ggml_init", P, [Params]),
                             (base, "ggml_new_tensor_1d", P, [P, ctypes.c_int, I64]),
                             (base, "ggml_new_tensor_2d", P, [P, ctypes.c_int, I64, I64]),
                             (base, "ggml_mul_mat", P, [P, P, P]),
                             (base, "ggml_get_rows", P, [P, P, P]),
                             (base, "ggml_new_graph", P, [P]),
                             (base, "ggml_build_forward_expand", None, [P, P]),
                             (base, "ggml_backend_buft_alloc_buffer", P, [P, ctypes.c_size_t]),
                             (base, "ggml_backend_buffer_get_base", P, [P]),
                             (base, "ggml_backend_tensor_alloc", ctypes.c_int, [P, P, P]),
                             (base, "ggml_backend_tensor_set", None, [P, P, ctypes.c_size_t, ctypes.c_size_t]),
                             (base, "ggml_backend_tensor_get", None, [P, P, ctypes.c_size_t, ctypes.c_size_t]),
                             (base, "ggml_backend_graph_compute", ctypes.c_int, [P, P]),
                             (ggml, "ggml_backend_dev_count", ctypes.c_size_t, []),
                             (ggml, "ggml_backend_dev_get", P, [ctypes.c_size_t]),
                             (ggml, "ggml_backend_dev_name", ctypes.c_char_p, [P]),
                             (ggml, "ggml_backend_dev_buffer_type", P, [P]),
                             (ggml, "ggml_backend_dev_init", P, [P, ctypes.c_char_p]),
                             (ggml, "ggml_backend_dev_supports_op", ctypes.c_bool, [P, P])):
    getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
ctx = base.ggml_init(Params(1 << 20, None, True))  # tensors without memory: only their shapes matter
for i in range(ggml.ggml_backend_dev_count()):
    dev = ggml.ggml_backend_dev_get(i)
    name = ggml.ggml_backend_dev_name(dev).decode()
    for rows in (64, 1 << 32):
        a, b = base.ggml_new_tensor_2d(ctx, 0, 64, rows), base.ggml_new_tensor_2d(ctx, 0, 64, 4)
        product = base.ggml_mul_mat(ctx, a, b)
        print(name, rows, ggml.ggml_backend_dev_supports_op(dev, product))
    if sys.argv[3] != "transfer" or not name.startswith("[virtgpu]"):
        continue
    # two rows whose outer strides (over dimensions of one) are 2^40: a record only the wide tensors
    # carry; written, read back, and its rows taken by index in a graph computed on the device
    x = base.ggml_new_tensor_2d(ctx, 0, 4, 2)
    nb = (ctypes.c_size_t * 4).from_address(x + 48)  # ggml_tensor.nb
    nb[2] = nb[3] = 1 << 40
    ids = base.ggml_new_tensor_1d(ctx, 26, 2)  # GGML_TYPE_I32
    rows = base.ggml_get_rows(ctx, x, ids)
    buffer = base.ggml_backend_buft_alloc_buffer(ggml.ggml_backend_dev_buffer_type(dev), 4096)
    at = base.ggml_backend_buffer_get_base(buffer)
    for t, offset in ((x, 0), (ids, 64), (rows, 128)):
        assert base.ggml_backend_tensor_alloc(buffer, t, at + offset) == 0
    xs = struct.pack("<8f", 1, 2, 3, 4, 5, 6, 7, 8)
    base.ggml_backend_tensor_set(x, xs, 0, 32)
    base.ggml_backend_tensor_set(ids, struct.pack("<2i", 1, 0), 0, 8)
    back = ctypes.create_string_buffer(32)
    base.ggml_backend_tensor_get(x, back, 0, 32)
    print("get", back.raw == xs)
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, rows)
    print("compute", base.ggml_backend_graph_compute(ggml.ggml_backend_dev_init(dev, None), graph))
    base.ggml_backend_tensor_get(rows, back, 0, 32)
    print("rows", back.raw == xs[16:] + xs[:16])
"""


@pytest.mark.parametrize("mode", ["wide", "narrow", "upstream host"])
def test_an_op_wider_than_the_wire_is_claimed_only_with_the_wide_records(asan_host: Path, llama_build: llamacpp.Build,
                                                                         workdir: Path, mode: str) -> None:
    """Without the wide records (GGML_VIRTGPU_WIDE_TENSORS=0, or a host library that lacks them:
    upstream's), a graph's tensors reach the host as apir_rpc_tensor, with 32-bit shapes and strides, so
    the frontend does not claim an op with a tensor of 2^32 rows (which the CPU device takes), and it is
    never cut short. With them (patch 0014, negotiated) it is claimed, and a tensor with 2^40 strides (over
    dimensions of one: the node checks refuse a zero stride over many rows, so a tensor of 2^33 rows
    cannot fit a test's memory) crosses intact: written, read back and computed from through the
    frontend and apir-host."""
    client_env = {"GGML_VIRTGPU_WIDE_TENSORS": "0"} if mode == "narrow" else {}
    host, host_env, backend_library = asan_host, None, None
    if mode == "upstream host":
        upstream = upstream_apir.libraries()
        host, host_env = llama_build.binary("apir-host"), {"LD_LIBRARY_PATH": str(llama_build.bin_dir)}
        backend_library = upstream / "libggml-virtgpu-backend.so"
    trace = workdir / "trace.bin"
    with apir_host(host, llama_build, workdir, trace, env=host_env, backend_library=backend_library) as (
            _host, path, log):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
        env.update(GGML_VIRTGPU_SOCKET=str(path), **client_env)
        done = subprocess.run([sys.executable, "-c", WIDE_OP_PROBE, str(llama_build.library("ggml")),
                               str(llama_build.library("ggml-base")), "transfer" if mode == "wide" else "-"],
                              capture_output=True, text=True, timeout=300, env=env)
        host_log = log.read_text(errors="replace")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    answers = {tuple(line.rsplit(" ", 2)[:2]): line.endswith("True") for line in lines if line[0] in "[C"}
    assert answers == {("[virtgpu] CPU", "64"): True, ("[virtgpu] CPU", str(1 << 32)): mode == "wide",
                       ("CPU", "64"): True, ("CPU", str(1 << 32)): True}
    if mode == "wide":
        assert [line for line in lines if line[0] not in "[C"] == ["get True", "compute 0", "rows True"], done.stdout
        assert "ggml-virtgpu: apir_ext_init: tensors travel with 64-bit shapes and strides" in done.stderr
        assert "refused" not in host_log, host_log[-3000:]
    # what the frontend asked for and what it was told, in the host's trace
    asked = [apir_trace.Record(0, 0, r[0], r[1], r[2], 0, 0, b"", r[3]) for r in decode_trace(trace)
             if r[0] == FORWARD and r[1] == extensions.GET_FEATURES]
    assert len(asked) == 1
    granted = asked[0].features_granted()
    if mode == "upstream host":
        assert granted is None  # the library lacks the command: FORWARD_INDEX_INVALID
    else:
        assert granted is not None and bool(granted & extensions.FEATURE_WIDE_TENSORS) == (mode == "wide")
