"""A hostile RPC client against a real `ggml-rpc-server` on the CPU (llama_patches/ 0018).

The server deserializes a client's graph and computes it with ggml's kernels, which trust shapes and
types that only ggml's op constructors check. A graph the device does not support, or that breaks
what a kernel assumes, must be refused before it computes: the server drops that connection (the
protocol's answer to a bad command, GRAPH_COMPUTE has no reply) and serves the next client, whose
valid graph computes. The server also answers SUPPORTS_OP, so an honest client never sends such a
node. Every test runs against the release server and the one built with AddressSanitizer and
UndefinedBehaviorSanitizer, which stops at a finding: a refusal that itself misbehaves fails the test.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.remoting.test_shm_native import SANITIZED_ENV, build_rpc_server, no_sanitizer_report
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Unix socket")]

# commands and constants of the protocol (their numbers in ggml-rpc.cpp / ggml.h of the pinned source)
ALLOC_BUFFER, BUFFER_GET_BASE, SET_TENSOR, GET_TENSOR, GRAPH_COMPUTE, HELLO, DEVICE_COUNT = 0, 3, 6, 8, 10, 14, 15
GET_ALLOC_SIZE = 11
SUPPORTS_OP = 22
FEATURE_SUPPORTS_OP = 0x01  # rpc_msg_hello_rsp.features
FLAG_COMPUTE = 16  # GGML_TENSOR_FLAG_COMPUTE: backends skip a node without it
F32, F16, Q8_0, IQ2_XXS, I32, I64, F64, BF16 = 0, 1, 8, 16, 26, 27, 28, 30
BLOCK = {F32: (4, 1), F16: (2, 1), I32: (4, 1), I64: (8, 1), F64: (8, 1), BF16: (2, 1), Q8_0: (34, 32),
         IQ2_XXS: (66, 256)}  # bytes, elements
OP_NONE, OP_ADD, OP_MUL, OP_RMS_NORM, OP_MUL_MAT, OP_MUL_MAT_ID, OP_SCALE, OP_CPY = 0, 2, 7, 25, 29, 30, 32, 34
OP_GET_ROWS, OP_SET_ROWS, OP_ROPE, OP_UNARY, OP_GLU, OP_COUNT = 40, 42, 48, 91, 100, 101
UNARY_ABS, UNARY_COUNT, GLU_SWIGLU, GLU_SWIGLU_CLAMP, GLU_COUNT = 0, 22, 2, 6, 7
# rpc_tensor: id, type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10], view_src, view_offs, data,
# name[64], use_count
TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
assert TENSOR.size == 296
BUFFER_SIZE = 1 << 20
F32_ONE, F32_TWO, F32_MINUS_ONE = struct.unpack("<3i", struct.pack("<3f", 1.0, 2.0, -1.0))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def send(sock: socket.socket, cmd: int, payload: bytes = b"") -> None:
    sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)


def request(sock: socket.socket, cmd: int, payload: bytes = b"") -> bytes:
    send(sock, cmd, payload)
    (size,) = struct.unpack("<Q", recv_exact(sock, 8))
    return recv_exact(sock, size)


def tensor(tid: int, type_: int, ne: Sequence[int], buffer: int = 0, data: int = 0, op: int = OP_NONE,
           src: Sequence[int] = (), params: Sequence[int] = (), nb: Sequence[int] | None = None) -> bytes:
    ne = list(ne) + [1] * (4 - len(ne))
    if nb is None:
        size, block = BLOCK[type_]
        nb = [size, size * ne[0] // block]
        for i in range(2, 4):
            nb.append(nb[i - 1] * ne[i - 1])
    flags = FLAG_COMPUTE if op != OP_NONE else 0
    return TENSOR.pack(tid, type_, buffer, *ne, *nb, op, *(list(params) + [0] * (16 - len(params))), flags,
                       *(list(src) + [0] * (10 - len(src))), 0, 0, data, b"", 1)


class Session:
    """One client connection with a 1 MiB CPU buffer; tensors are placed at offsets in it."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        answer = request(self.sock, HELLO, bytes(24))
        self.features = answer[3]
        self.remote, self.base = self.alloc(BUFFER_SIZE)

    def alloc(self, size: int) -> tuple[int, int]:
        """A buffer of `size` bytes on the CPU device: its id and base."""
        remote, _ = struct.unpack("<QQ", request(self.sock, ALLOC_BUFFER, struct.pack("<IQ", 0, size)))
        assert remote != 0
        (base,) = struct.unpack("<Q", request(self.sock, BUFFER_GET_BASE, struct.pack("<Q", remote)))
        return remote, base

    def at(self, tid: int, type_: int, ne: Sequence[int], offset: int, **kw: object) -> bytes:
        return tensor(tid, type_, ne, buffer=self.remote, data=self.base + offset, **kw)  # type: ignore[arg-type]

    def set(self, t: bytes, values: bytes) -> None:
        send(self.sock, SET_TENSOR, t + struct.pack("<BQ", 0, 0) + values)  # no cache flag, offset 0

    def get(self, t: bytes, size: int) -> bytes:
        return request(self.sock, GET_TENSOR, t + struct.pack("<QQ", 0, size))

    def compute(self, nodes: Sequence[int], tensors: Sequence[bytes]) -> None:
        payload = struct.pack("<II", 0, len(nodes)) + struct.pack(f"<{len(nodes)}Q", *nodes)
        send(self.sock, GRAPH_COMPUTE, payload + struct.pack("<I", len(tensors)) + b"".join(tensors))

    def closed_by_server(self) -> bool:
        """True when the server dropped the connection (a further request gets no answer)."""
        try:
            request(self.sock, DEVICE_COUNT)
        except (ConnectionError, OSError):
            return True
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["release", "sanitized"])
def server(request: pytest.FixtureRequest, llama_build, tmp_path: Path  # type: ignore[no-untyped-def]
           ) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """The build's ggml-rpc-server, or the one built with ASan and UBSan (tests/remoting/test_shm_native.py),
    which stops at its first report: the test then finds it gone, and the report in its log."""
    path, log = tmp_path / "rpc.sock", tmp_path / "rpc.log"
    if request.param == "release":
        exe, env = llama_build.binary("ggml-rpc-server"), {}
    else:
        exe = build_rpc_server("sanitized-rpc-server", ["-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON"])
        env = SANITIZED_ENV

    def connects() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(path))
            except OSError:
                return False
        return True

    with log.open("wb") as out:
        proc = subprocess.Popen([str(exe), "-H", f"unix:{path}", "-d", "CPU", "-t", "1"], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_for("the rpc server's socket", lambda: path.exists() and connects(), 60)
        yield proc, path, log
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        no_sanitizer_report(log)
    finally:
        proc.kill()
        proc.wait()


def add_computes(path: Path) -> None:
    """A valid graph on a fresh connection: c = a + b, read back."""
    s = Session(path)
    try:
        a, b, c = (s.at(i + 1, F32, [4], 16 * i) for i in range(3))
        c = s.at(3, F32, [4], 32, op=OP_ADD, src=[1, 2])
        s.set(a, array.array("f", [1, 2, 3, 4]).tobytes())
        s.set(b, array.array("f", [10, 20, 30, 40]).tobytes())
        s.compute([3], [a, b, c])
        assert list(array.array("f", s.get(c, 16))) == [11, 22, 33, 44]
    finally:
        s.close()


def hostile_graphs(s: Session) -> dict[str, tuple[list[int], list[bytes]]]:
    """Graphs of one node each; every one crashed, aborted or corrupted a CPU server before 0018."""
    f32 = s.at(1, F32, [4096], 0)
    assert FEATURE_SUPPORTS_OP & s.features
    return {
        # IQ2_XXS has no conversion from float on the CPU: a call through a NULL pointer
        "cpy-to-a-type-without-conversion": ([2], [s.at(1, F32, [256, 16], 0),
                                                   s.at(2, IQ2_XXS, [256, 16], 65536, op=OP_CPY, src=[1, 3]),
                                                   s.at(3, IQ2_XXS, [256, 16], 65536)]),
        # the CPU converts src1 as if it were of src0's dot type: reads past it
        "mul-mat-of-unsupported-types": ([3], [s.at(1, F16, [64, 4], 0), s.at(2, BF16, [64, 4], 4096),
                                               s.at(3, F32, [4, 4], 8192, op=OP_MUL_MAT, src=[1, 2])]),
        # the CPU's RMS_NORM aborts on F16
        "rms-norm-on-f16": ([2], [s.at(1, F16, [64], 0), s.at(2, F16, [64], 4096, op=OP_RMS_NORM, src=[1])]),
        # rows of 4096 floats quantized into a work buffer sized for rows of 32: a heap overflow
        "cpy-rows-unlike-the-destination": ([2], [s.at(1, F32, [4096, 1], 0),
                                                  s.at(2, Q8_0, [32, 128], 65536, op=OP_CPY, src=[1, 3]),
                                                  s.at(3, Q8_0, [32, 128], 65536)]),
        # pairs rotated in a row of odd length: one element past the end
        "rope-of-an-odd-row": ([3], [s.at(1, F32, [3, 1, 1], 0), s.at(2, I32, [1], 4096),
                                     s.at(3, F32, [3, 1, 1], 8192, op=OP_ROPE, src=[1, 2], params=[0, 2])]),
        # 2^36 rows in 16 bytes (zero strides): the work buffer's size wraps
        "mul-mat-of-zero-strides": ([3], [s.at(1, F32, [4, 16], 0),
                                          s.at(2, F16, [4, 1 << 20, 1 << 16], 4096, nb=[2, 0, 0, 0]),
                                          s.at(3, F32, [16, 1 << 20, 1 << 16], 8192, op=OP_MUL_MAT, src=[1, 2],
                                               nb=[4, 0, 0, 0])]),
        # a copy of no rows whose rows are 2^29 floats: no extent bounds them, and ggml-cpu's graph plan
        # sizes the work buffer from them (2 GiB here; 64-bit records reach far past any memory)
        "empty-cpy-of-huge-rows": ([2], [s.at(1, F32, [1 << 29, 0], 0, nb=[4, 1 << 31, 1 << 31, 1 << 31]),
                                         s.at(2, Q8_0, [1 << 29, 0], 65536, op=OP_CPY, src=[1, 3],
                                              nb=[34, 34 << 24, 34 << 24, 34 << 24]),
                                         s.at(3, Q8_0, [1 << 29, 0], 65536, nb=[34, 34 << 24, 34 << 24, 34 << 24])]),
        # a node without a buffer: the kernel writes through a NULL data pointer
        "node-without-a-buffer": ([2], [f32, tensor(2, F32, [4096], op=OP_ADD, src=[1, 1])]),
        # found by the graph fuzzer (docs/reliability.md): the rotation cache reads ne0/2 = 4 frequency
        # factors, the constructor's n_dims/2 = 2 are there
        "rope-freq-factors-shorter-than-half-the-row": ([3], [
            s.at(1, F32, [8, 1, 1], 0), s.at(2, I32, [1], 4096), s.at(4, F32, [2], 8192),
            s.at(3, F32, [8, 1, 1], 12288, op=OP_ROPE, src=[1, 2, 4], params=[0, 4, 0, 4096, F32_ONE])]),
        # a [23,3] permuted to [23,1,3]: "contiguous" to ggml, and the CPU's SCALE reads row 2 at 2 * nb[1]
        "scale-of-a-permuted-source-with-a-dimension-of-1": ([2], [
            s.at(1, F32, [23, 1, 3], 0, nb=[4, 276, 92, 276]),
            s.at(2, F32, [23, 1, 3], 4096, op=OP_SCALE, src=[1], params=[F32_TWO])]),
        # found by the graph fuzzer (tests/apir/graph_fuzz/findings/, of the same names): the CPU's
        # binary kernels index a row's elements by the type's size, and assert it of src0
        "binary-op-of-a-transposed-source": ([3], [
            s.at(1, F16, [32, 4], 0, nb=[8, 2, 256, 256]), s.at(2, F32, [32, 4], 4096),
            s.at(3, F16, [32, 4], 8192, op=OP_MUL, src=[1, 2])]),
        # so do its unary kernels, of every unary op (ABS here, whose types the rules leave to the device)
        "unary-of-a-transposed-source": ([2], [
            s.at(1, F32, [40, 17], 0, nb=[68, 4, 2720, 2720]),
            s.at(2, F32, [40, 17], 8192, op=OP_UNARY, src=[1], params=[UNARY_ABS])]),
        # MUL_MAT_ID multiplies packed rows of src1
        "mul-mat-id-of-a-transposed-source": ([4], [
            s.at(1, F32, [32, 18, 2], 0), s.at(2, F32, [32, 2, 2], 8192, nb=[8, 4, 256, 512]),
            s.at(3, I32, [2, 2], 12288),
            s.at(4, F32, [18, 2, 2], 16384, op=OP_MUL_MAT_ID, src=[1, 2, 3])]),
        # the CPU's copy converts between F32 and I32 only: F64 into F32 aborts
        "cpy-from-f64-into-f32": ([2], [s.at(1, F64, [1, 9], 0), s.at(2, F32, [1, 9], 4096, op=OP_CPY, src=[1, 3]),
                                        s.at(3, F32, [1, 9], 4096)]),
        # SWIGLU_CLAMP clamps to [-limit, limit] with std::clamp, which asserts on a negative limit where
        # the C++ library checks its preconditions (found by the graph fuzzer)
        "swiglu-clamp-of-a-negative-limit": ([3], [
            s.at(1, F32, [16, 2], 0), s.at(2, F32, [16, 2], 4096),
            s.at(3, F32, [16, 2], 8192, op=OP_GLU, src=[1, 2], params=[GLU_SWIGLU_CLAMP, 0, 0, F32_MINUS_ONE])]),
        # multimodal ROPE (mode 8) whose sections are all 0: ggml-cpu asserts one (found by the graph fuzzer)
        "rope-multimodal-without-sections": ([3], [
            s.at(1, F32, [16, 1, 1], 0), s.at(2, I32, [4], 4096),
            s.at(3, F32, [16, 1, 1], 8192, op=OP_ROPE, src=[1, 2], params=[0, 16, 8, 0, 0, F32_ONE])]),
        # vision ROPE (mode 24, over half the row) of the third section alone: CUDA's vision kernel splits
        # the pairs by the first two sections only, and divides by their sum
        "rope-vision-of-the-third-section-alone": ([3], [
            s.at(1, F32, [16, 1, 1], 0), s.at(2, I32, [4], 4096),
            s.at(3, F32, [16, 1, 1], 8192, op=OP_ROPE, src=[1, 2],
                 params=[0, 8, 24, 0, 0, F32_ONE, F32_ONE, 0, F32_ONE, F32_ONE, F32_ONE, 0, 0, 4, 0])]),
        # rows of no elements: ggml-cpu plans no work buffer and steps through its NULL base converting
        # src1 (found by the graph fuzzer, UBSan in the sanitized server)
        "mul-mat-of-rows-of-no-elements": ([3], [s.at(1, F32, [0, 4], 0), s.at(2, F16, [0, 2], 4096),
                                                 s.at(3, F32, [4, 2], 8192, op=OP_MUL_MAT, src=[1, 2])]),
        # the Hadamard hint (op parameter 1): ggml-cpu writes B's rows of 4, transformed, into result rows
        # of src0's 2 (found by the graph fuzzer, ASan in the sanitized APIR host)
        "mul-mat-with-a-hadamard-hint-and-src0-not-square": ([3], [
            s.at(1, F32, [4, 2], 0), s.at(2, F32, [4, 3], 4096),
            s.at(3, F32, [2, 3], 8192, op=OP_MUL_MAT, src=[1, 2], params=[0, 1])]),
        # the result of a CPY has its destination's strides: ggml-cpu's dequantizing copy writes the result
        # from its own address at src[1]'s strides (found by the graph fuzzer, an assert in the APIR host)
        "cpy-dequantized-at-strides-other-than-its-destination": ([2], [
            s.at(1, Q8_0, [32, 2], 0), s.at(2, F32, [32, 2], 8192, op=OP_CPY, src=[1, 3]),
            s.at(3, F32, [32, 2], 8192, nb=[4, 1024, 2048, 2048])]),
        # the transform reads F32 or F16 rows of B; ggml-cpu aborts on any other type (BF16 here)
        "mul-mat-with-a-hadamard-hint-over-bf16-rows": ([3], [
            s.at(1, F32, [4, 4], 0), s.at(2, BF16, [4, 3], 4096),
            s.at(3, F32, [4, 3], 8192, op=OP_MUL_MAT, src=[1, 2], params=[0, 1])]),
        # with sections, but one position a token where the kernels read four: past the positions
        "rope-multimodal-of-one-position-a-token": ([3], [
            s.at(1, F32, [16, 1, 1], 0), s.at(2, I32, [1], 4096),
            s.at(3, F32, [16, 1, 1], 8192, op=OP_ROPE, src=[1, 2],
                 params=[0, 16, 8, 0, 0, F32_ONE, 0, 0, 0, 0, 0, 4, 2, 2, 0])]),
    }


def mul_mat_id(s: Session, ids: bytes) -> tuple[list[int], list[bytes]]:
    """out = as[ids] x b over 2 experts of 3 rows of 4 (expert 0 all 1, expert 1 all 2; b all 1), the ids
    I32 [2] at 4096 (id 3): each of out's columns is 4 or 8, by its expert."""
    experts, b = s.at(4, F32, [4, 3, 2], 8192), s.at(5, F32, [4, 1, 1], 12288)
    s.set(experts, array.array("f", [1.0] * 12 + [2.0] * 12).tobytes())
    s.set(b, array.array("f", [1.0] * 4).tobytes())
    return [6], [experts, b, ids, s.at(6, F32, [3, 2, 1], 16384, op=OP_MUL_MAT_ID, src=[4, 5, 3])]


def index_graphs(s: Session) -> dict[str, tuple[list[int], list[bytes]]]:
    """Graphs whose shapes are valid and whose indices are not: the server reads them before each run."""
    ids = s.at(3, I32, [2], 4096)
    s.set(ids, struct.pack("<2i", 1, 2))  # two experts: 2 is out of range
    table, rows = s.at(1, F32, [4, 8], 0), s.at(2, I32, [2], 36864)
    s.set(rows, struct.pack("<2i", 0, 9))  # a table of 8 rows: 9 is past it
    set_rows_src, set_rows_idx = s.at(7, F32, [4, 2], 20480), s.at(8, I64, [2], 24576)
    s.set(set_rows_src, bytes(32))
    s.set(set_rows_idx, struct.pack("<2q", 0, 8))  # a table of 8 rows: 8 is past it
    # ids the graph computes (as a mixture of experts computes its own): CPY of floats into I32
    floats, computed = s.at(9, F32, [2], 28672), s.at(3, I32, [2], 45056, op=OP_CPY, src=[9, 10])
    s.set(floats, array.array("f", [1.0, -1.0]).tobytes())  # -1: below the first expert
    nodes, tensors = mul_mat_id(s, computed)
    # indices read by a first node, then rewritten by a later node before a second node reads them: the
    # server reads each index tensor once per part, so the rewrite must start a new part and a new read
    shared = s.at(2, I32, [2], 53248)
    s.set(shared, struct.pack("<2i", 7, 2))
    nine = s.at(13, F32, [2], 57344)
    s.set(nine, array.array("f", [1.0, 9.0]).tobytes())
    rewrite = s.at(15, I32, [2], 53248, op=OP_CPY, src=[13, 14])
    reread = ([11, 15, 16], [table, shared, s.at(11, F32, [4, 2], 61440, op=OP_GET_ROWS, src=[1, 2]), nine,
                             s.at(14, I32, [2], 53248), rewrite,
                             s.at(16, F32, [4, 2], 73728, op=OP_GET_ROWS, src=[1, 2])])
    return {
        # the CPU reads the expert's matrix at ids * nb[2] (a wild pointer); GPUs do not look
        "mul-mat-id-with-an-expert-id-out-of-range": mul_mat_id(s, ids),
        "get-rows-with-an-index-out-of-range": ([11], [table, rows, s.at(11, F32, [4, 2], 8192, op=OP_GET_ROWS,
                                                                         src=[1, 2])]),
        "set-rows-with-an-index-out-of-range": ([12], [set_rows_src, set_rows_idx,
                                                       s.at(12, F32, [4, 8], 0, op=OP_SET_ROWS,
                                                            src=[7, 8])]),
        # the server computes up to the node that reads them, then checks them
        "mul-mat-id-with-a-computed-expert-id-out-of-range": ([3, *nodes], [floats, s.at(10, I32, [2], 45056),
                                                                            computed, *tensors]),
        "get-rows-with-indices-rewritten-out-of-range-after-a-first-read": reread,
    }


def test_the_server_says_it_answers_supports_op(server) -> None:  # type: ignore[no-untyped-def]
    _, path, _ = server
    s = Session(path)
    try:
        assert s.features & FEATURE_SUPPORTS_OP

        def supports(node: bytes, *srcs: bytes) -> int:
            srcs_bytes = b"".join(srcs) + bytes(TENSOR.size * (10 - len(srcs)))
            return request(s.sock, SUPPORTS_OP, struct.pack("<I", 0) + node + srcs_bytes)[0]

        a, b = tensor(2, F32, [64]), tensor(3, F32, [64])
        assert supports(tensor(1, F32, [64], op=OP_ADD, src=[2, 3]), a, b) == 1
        assert supports(tensor(1, IQ2_XXS, [256], op=OP_CPY, src=[2, 3]), tensor(2, F32, [256]),
                        tensor(3, IQ2_XXS, [256])) == 0
        assert supports(tensor(1, F16, [64], op=OP_RMS_NORM, src=[2]), tensor(2, F16, [64])) == 0
        assert supports(tensor(1, F32, [3], op=OP_ROPE, src=[2, 3], params=[0, 2]), tensor(2, F32, [3]),
                        tensor(3, I32, [1])) == 0
        # SCALE steps rows by nb[1]: refused over a permuted dimension of 1, answered over packed rows
        scale = tensor(1, F32, [23, 1, 3], op=OP_SCALE, src=[2], params=[F32_TWO])
        assert supports(scale, tensor(2, F32, [23, 1, 3], nb=[4, 276, 92, 276])) == 0
        assert supports(scale, tensor(2, F32, [23, 1, 3], nb=[4, 92, 92, 276])) == 1
        assert not s.closed_by_server()  # answers, never a dropped connection, for a well-formed question
    finally:
        s.close()


KERNEL_CASES = ["cpy-to-a-type-without-conversion", "mul-mat-of-unsupported-types", "rms-norm-on-f16",
                "cpy-rows-unlike-the-destination", "rope-of-an-odd-row", "mul-mat-of-zero-strides",
                "node-without-a-buffer", "rope-freq-factors-shorter-than-half-the-row",
                "scale-of-a-permuted-source-with-a-dimension-of-1", "binary-op-of-a-transposed-source",
                "unary-of-a-transposed-source", "mul-mat-id-of-a-transposed-source", "cpy-from-f64-into-f32",
                "empty-cpy-of-huge-rows", "swiglu-clamp-of-a-negative-limit", "rope-multimodal-without-sections",
                "rope-multimodal-of-one-position-a-token", "mul-mat-of-rows-of-no-elements",
                "mul-mat-with-a-hadamard-hint-and-src0-not-square", "rope-vision-of-the-third-section-alone",
                "mul-mat-with-a-hadamard-hint-over-bf16-rows", "cpy-dequantized-at-strides-other-than-its-destination"]
INDEX_CASES = ["mul-mat-id-with-an-expert-id-out-of-range", "get-rows-with-an-index-out-of-range",
               "set-rows-with-an-index-out-of-range", "mul-mat-id-with-a-computed-expert-id-out-of-range",
               "get-rows-with-indices-rewritten-out-of-range-after-a-first-read"]


@pytest.mark.parametrize("name", KERNEL_CASES + INDEX_CASES)
def test_a_graph_the_kernels_cannot_run_is_refused_and_the_server_serves_on(server, name: str) -> None:  # type: ignore[no-untyped-def]
    """Refused before anything computes (a node the rules fail, or an index out of range), the
    connection dropped, and the server serves the next client."""
    proc, path, log = server
    add_computes(path)
    s = Session(path)
    try:
        index = name in INDEX_CASES
        said = "index out of range" if index else "graph refused"
        nodes, tensors = (index_graphs if index else hostile_graphs)(s)[name]
        s.compute(nodes, tensors)
        assert s.closed_by_server()
    finally:
        s.close()
    wait_for("the refusal in the server's log", lambda: said in log.read_text(errors="replace"), 10)
    assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
    add_computes(path)


def test_indices_in_range_compute_whether_given_or_computed(server) -> None:  # type: ignore[no-untyped-def]
    """The value checks refuse nothing valid: expert ids the client set, and ids the graph computes
    (the server runs the graph in two parts around the check), give the expected products; GET_ROWS
    reads the rows named."""
    _, path, _ = server
    s = Session(path)
    try:
        ids = s.at(3, I32, [2], 4096)
        s.set(ids, struct.pack("<2i", 1, 0))
        nodes, tensors = mul_mat_id(s, ids)
        s.compute(nodes, tensors)
        assert list(array.array("f", s.get(tensors[-1], 24))) == [8.0] * 3 + [4.0] * 3
        floats, computed = s.at(9, F32, [2], 28672), s.at(3, I32, [2], 4096, op=OP_CPY, src=[9, 10])
        s.set(floats, array.array("f", [0.0, 1.0]).tobytes())
        nodes, tensors = mul_mat_id(s, computed)
        s.compute([3, *nodes], [floats, s.at(10, I32, [2], 4096), computed, *tensors])
        assert list(array.array("f", s.get(tensors[-1], 24))) == [4.0] * 3 + [8.0] * 3
        table, rows = s.at(1, F32, [4, 8], 32768), s.at(2, I32, [2], 36864)
        s.set(table, array.array("f", range(32)).tobytes())
        s.set(rows, struct.pack("<2i", 7, 2))
        out = s.at(11, F32, [4, 2], 40960, op=OP_GET_ROWS, src=[1, 2])
        s.compute([11], [table, rows, out])
        assert list(array.array("f", s.get(out, 32))) == [28.0, 29.0, 30.0, 31.0, 8.0, 9.0, 10.0, 11.0]
        # two nodes that read one index tensor (as every layer reads the KV cache's rows): read once, both right
        s.set(rows, struct.pack("<2i", 1, 6))
        second = s.at(12, F32, [4, 2], 49152, op=OP_GET_ROWS, src=[1, 2])
        s.compute([11, 12], [table, rows, out, second])
        for result in (out, second):
            assert list(array.array("f", s.get(result, 32))) == [4.0, 5.0, 6.0, 7.0, 24.0, 25.0, 26.0, 27.0]
        assert not s.closed_by_server()
    finally:
        s.close()


# --- a result's room, at its boundary ----------------------------------------------------------------

ROOM_BYTES = 4 * 4 * 4  # MUL_MAT's F32 [4,4] result below


def mul_mat_into(s: Session, room: int) -> tuple[list[int], list[bytes], bytes]:
    """out = a x b (a and b F32 [16,4], all 1 and 2) with out F32 [4,4] alone in a buffer of `room` bytes."""
    a, b = s.at(1, F32, [16, 4], 0), s.at(2, F32, [16, 4], 4096)
    s.set(a, array.array("f", [1.0] * 64).tobytes())
    s.set(b, array.array("f", [2.0] * 64).tobytes())
    remote, base = s.alloc(room)
    out = tensor(3, F32, [4, 4], buffer=remote, data=base, op=OP_MUL_MAT, src=[1, 2])
    return [3], [a, b, out], out


def test_a_result_with_exactly_its_room_computes_and_one_byte_less_is_refused(server) -> None:  # type: ignore[no-untyped-def]
    """The rule that a result has the room its buffer's get_alloc_size asks for (0015's
    `has_room_for_result`, for the ops `ggml_op_alloc_size_may_expand` names: MUL_MAT here) has no case
    of its own on a CPU server: the CPU's buffer types answer ggml_nbytes, and deserialize_tensor
    refuses a tensor whose ggml_nbytes runs past its buffer before any rule runs. So the boundary is
    tested here as a client meets it: a result in exactly its room computes, one byte less is refused,
    and the server serves on. The rule's own arithmetic, over a buffer type that asks for more (as
    CUDA's does), is llama_patches/tests/node_check_test.cpp (test_node_check_native.py)."""
    proc, path, log = server
    s = Session(path)
    try:
        nodes, tensors, out = mul_mat_into(s, ROOM_BYTES)
        s.compute(nodes, tensors)
        assert list(array.array("f", s.get(out, ROOM_BYTES))) == [32.0] * 16
        nodes, tensors, out = mul_mat_into(s, ROOM_BYTES - 1)
        s.compute(nodes, tensors)
        assert s.closed_by_server()
    finally:
        s.close()
    wait_for("the refusal in the server's log", lambda: "out of buffer bounds" in log.read_text(errors="replace"), 10)
    assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
    add_computes(path)


# --- ops outside ggml's tables --------------------------------------------------------------------

#: (op, op_params[0]) of nodes a hostile client sends: ggml_op_desc indexes its name tables with them,
#: and a load of ggml_op beyond its values is undefined (UBSan: "not a valid value for type 'ggml_op'")
UNKNOWN_OPS = {"op-count": (OP_COUNT, 0), "op-far-past-the-table": (0x7FFFFFFF, 0), "op-all-ones": (0xFFFFFFFF, 0),
               "unary-op-count": (OP_UNARY, UNARY_COUNT), "unary-op-negative": (OP_UNARY, -1),
               "glu-op-count": (OP_GLU, GLU_COUNT), "glu-op-far-past-the-table": (OP_GLU, 0x7FFFFFFF)}


@pytest.mark.parametrize("name", sorted(UNKNOWN_OPS))
def test_a_node_of_an_unknown_op_is_refused_and_named_safely(server, name: str) -> None:  # type: ignore[no-untyped-def]
    """Refused (the rules' `op_is_known`), named "unknown op" in the refusal's log line
    (`ggml_node_op_desc`), answered "unsupported" to SUPPORTS_OP, and the server serves on: under the
    sanitizers, no read past a name table and no load of an invalid enum on the way."""
    op, param = UNKNOWN_OPS[name]

    def send(s: Session) -> None:
        node = s.at(2, F32, [32], 4096, op=op, src=[1], params=[param])
        bare = tensor(2, F32, [32], op=op, src=[1], params=[param])
        assert request(s.sock, SUPPORTS_OP, struct.pack("<I", 0) + bare + tensor(1, F32, [32]) +
                       bytes(TENSOR.size * 9))[0] == 0
        s.compute([2], [s.at(1, F32, [32], 0), node])

    refused_and_served_on(server, send, "graph node 0 (unknown op, f32) is not supported")


def refused_and_served_on(server, send: Callable[[Session], None], said: str) -> None:  # type: ignore[no-untyped-def]
    """What `send` sends on a new connection is refused: the server closes it and logs `said`, lives on,
    and computes for the next client."""
    proc, path, log = server
    s = Session(path)
    try:
        send(s)
        assert s.closed_by_server()
    finally:
        s.close()
    wait_for("the refusal in the server's log", lambda: said in log.read_text(errors="replace"), 10)
    assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
    add_computes(path)


#: dimensions of 32 bits each whose product passes int64_t: ggml_new_tensor asserts on it
HUGE_SHAPES = {"two-dimensions-of-2^32-1": [0xFFFFFFFF, 0xFFFFFFFF],
               "four-of-2^16": [1 << 16, 1 << 16, 1 << 16, 1 << 16],
               "three-of-2^21-and-one-of-4": [1 << 21, 1 << 21, 1 << 21, 4]}


@pytest.mark.parametrize("name", sorted(HUGE_SHAPES))
def test_a_tensor_of_more_elements_than_int64_holds_is_refused_not_asserted(server, name: str) -> None:  # type: ignore[no-untyped-def]
    """Found by the graph fuzzer's campaign (2026-11-29): a node whose element count passes int64_t
    reached ggml_new_tensor's GGML_ASSERT from deserialize_tensor, ending the server. Now the tensor is
    refused where it is read, as any malformed tensor: the connection closes, the server serves on."""
    def send(s: Session) -> None:
        node = tensor(2, F32, HUGE_SHAPES[name], buffer=s.remote, data=s.base, op=OP_RMS_NORM, src=[1],
                      nb=[4, 4, 4, 4])
        s.compute([2], [s.at(1, F32, [32], 0), node])

    refused_and_served_on(server, send, "[deserialize_tensor] tensor of")
