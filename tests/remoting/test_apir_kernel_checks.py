"""A container's graph cannot break what ggml's kernels assume, nor hold more host memory than its cap.

apir-host computes a client's graph with ggml's CPU kernels, which trust the shapes, types and strides
of their nodes. Each graph below is one a hostile client sent to today's host (issue 30): a heap
overflow through CPY, an out-of-bounds read through FLASH_ATTN_EXT, a write past a row through ROPE,
aborts through types the kernels lack. The library's node checks (llama_patches 0015) refuse each one,
and the host serves the next client. A client is also held to its cap on host memory, shared and
allocated (GGML_VIRTGPU_HOST_MEM_CAP): past it, a resource or a buffer is refused and the child's
memory stays below it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from apirctl.apir.tensor import FLAG_OUTPUT, OP_ADD, OP_MUL_MAT, Graph, Tensor
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import (
    BUFFER_TYPE_ALLOC_BUFFER,
    DEVICE_GET_BUFFER_TYPE,
    FORWARD,
    FORWARD_BASE,
    GRAPH_COMPUTE,
    LOADLIBRARY,
    REPLY_SIZE,
    SHMEM_CREATE,
    SHMEM_DESTROY,
    Client,
    apir_host,
    asan_host,  # noqa: F401 - a fixture, used by name
    good_session,
    header,
    sealed_memfd,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

# ggml.h of the pinned source
TYPE_F32, TYPE_F16, TYPE_Q4_0, TYPE_Q8_0 = 0, 1, 2, 8
TYPE_I8, TYPE_I16, TYPE_I32, TYPE_I64, TYPE_F64, TYPE_BF16 = 24, 25, 26, 27, 28, 30
OP_NORM, OP_RMS_NORM, OP_SCALE, OP_CPY = 24, 25, 32, 34
OP_SET_ROWS, OP_SOFT_MAX, OP_ROPE, OP_FLASH_ATTN_EXT = 42, 46, 48, 74
OP_GLU, GLU_SWIGLU_CLAMP = 100, 6
# the dispatch table (docs/apir.md)
BUFFER_CLEAR, BUFFER_FREE = 20, 21

DATA_RES = 2
BUFFER_SIZE = 1 << 20
REFUSED_NODE = "has shapes its op does not allow"


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


class Layout:
    """Tensors placed one after another in one buffer of the host's memory."""

    def __init__(self, buffer: int) -> None:
        self.buffer = buffer
        self.at = 0

    def t(self, shape: tuple[int, ...], type_: int, strides: tuple[int, int, int, int], op: int = 0,
          src: list[Tensor] | None = None, params: list[int] | None = None, extent: int | None = None,
          at: int | None = None) -> Tensor:
        """A tensor; `extent`: its bytes when they are not what Tensor.nbytes says (blocks, zero strides)."""
        t = Tensor(shape, type=type_, strides=strides, op=op, src=src or [], op_params=params or [],
                   buffer=self.buffer, name=f"t{self.at}")
        if at is None:
            t.offset = self.at
            self.at += ((extent if extent is not None else t.nbytes) + 255) // 256 * 256
        else:
            t.offset = at
        assert (t.offset or 0) + (extent or 0) <= BUFFER_SIZE
        return t

    def node(self, out: Tensor) -> Graph:
        out.flags |= FLAG_OUTPUT
        return Graph([out])


def contiguous(shape: tuple[int, ...], size: int) -> tuple[int, int, int, int]:
    ne = list(shape) + [1] * (4 - len(shape))
    nb = [size]
    for n in ne[:3]:
        nb.append(nb[-1] * n)
    return nb[0], nb[1], nb[2], nb[3]


# --- the graphs of the findings ---------------------------------------------------------------------


def cpy_f32_rows_into_q8_0(lay: Layout) -> Graph:
    """F32 [4096,1] into a contiguous Q8_0 [32,128]: the work buffer is sized from the destination's rows."""
    a = lay.t((4096, 1), TYPE_F32, contiguous((4096,), 4))
    b = lay.t((32, 128), TYPE_Q8_0, (34, 34, 34 * 128, 34 * 128), extent=34 * 128)
    return lay.node(lay.t((32, 128), TYPE_Q8_0, b.nb, OP_CPY, [a, b], at=b.offset))


def cpy_between_quantized_types(lay: Layout) -> Graph:
    a = lay.t((32, 1), TYPE_Q4_0, (18, 18, 18, 18), extent=18)
    b = lay.t((32, 1), TYPE_Q8_0, (34, 34, 34, 34), extent=34)
    return lay.node(lay.t((32, 1), TYPE_Q8_0, b.nb, OP_CPY, [a, b], at=b.offset))


def cpy_f32_into_strided_q8_0(lay: Layout) -> Graph:
    a = lay.t((32, 2), TYPE_F32, contiguous((32, 2), 4))
    b = lay.t((32, 2), TYPE_Q8_0, (34, 68, 136, 136), extent=102)
    return lay.node(lay.t((32, 2), TYPE_Q8_0, b.nb, OP_CPY, [a, b], at=b.offset))


def cpy_i32_to_f16(lay: Layout) -> Graph:
    a = lay.t((16,), TYPE_I32, contiguous((16,), 4))
    b = lay.t((16,), TYPE_F16, contiguous((16,), 2))
    return lay.node(lay.t((16,), TYPE_F16, b.nb, OP_CPY, [a, b], at=b.offset))


def flash_attn(v_heads: int, v_head_stride: int) -> Callable[[Layout], Graph]:
    """q of 3 heads, k of 1, v of `v_heads` heads `v_head_stride` bytes apart."""

    def build(lay: Layout) -> Graph:
        q = lay.t((64, 1, 3, 1), TYPE_F32, contiguous((64, 1, 3), 4))
        k = lay.t((64, 1, 1, 1), TYPE_F16, contiguous((64,), 2))
        v = lay.t((64, 1, v_heads, 1), TYPE_F16, (2, 128, v_head_stride, v_head_stride * max(v_heads, 1)),
                  extent=128 + v_head_stride * max(v_heads - 1, 0))
        params = [f32_bits(0.125), 0, 0, 0]  # scale, max_bias, logit_softcap, precision
        return lay.node(lay.t((64, 3, 1, 1), TYPE_F32, contiguous((64, 3), 4), OP_FLASH_ATTN_EXT, [q, k, v],
                              params))

    return build


def rope(ne0: int, n_dims: int, n_offs: int = 0) -> Callable[[Layout], Graph]:
    def build(lay: Layout) -> Graph:
        a = lay.t((ne0, 1, 1), TYPE_F32, contiguous((ne0,), 4))
        pos = lay.t((1,), TYPE_I32, contiguous((1,), 4))
        params = [0, n_dims, 0, 4096, f32_bits(10000.0), f32_bits(1.0), f32_bits(0.0), f32_bits(1.0),
                  f32_bits(32.0), f32_bits(1.0), 0, 0, 0, 0, 0, n_offs]
        return lay.node(lay.t((ne0, 1, 1), TYPE_F32, contiguous((ne0,), 4), OP_ROPE, [a, pos], params))

    return build


def rope_multi(sections: tuple[int, int, int, int], positions: int = 4, mode: int = 8,
               n_dims: int = 16) -> Callable[[Layout], Graph]:
    """Multimodal ROPE (MROPE: mode 8; VISION: 24, over half the row) of one token's row of 16: `positions`
    positions (the kernels read four a token) and the row's pairs split into `sections` (op parameters
    11-14)."""

    def build(lay: Layout) -> Graph:
        a = lay.t((16, 1, 1), TYPE_F32, contiguous((16,), 4))
        pos = lay.t((positions,), TYPE_I32, contiguous((positions,), 4))
        # n_past, n_dims, mode, n_ctx, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast,
        # beta_slow, the sections, n_offs: as ggml_rope_multi lays them out
        params = [0, n_dims, mode, 0, 4096, f32_bits(10000.0), f32_bits(1.0), f32_bits(0.0), f32_bits(1.0),
                  f32_bits(32.0), f32_bits(1.0), *sections, 0]
        return lay.node(lay.t((16, 1, 1), TYPE_F32, contiguous((16,), 4), OP_ROPE, [a, pos], params))

    return build


def rope_freq_factors(ne0: int, n_dims: int, n_factors: int) -> Callable[[Layout], Graph]:
    """ROPE of a row of `ne0` with `n_factors` frequency factors: ggml-cpu's rotation cache reads ne0/2."""

    def build(lay: Layout) -> Graph:
        a = lay.t((ne0, 1, 1), TYPE_F32, contiguous((ne0,), 4))
        pos = lay.t((1,), TYPE_I32, contiguous((1,), 4))
        factors = lay.t((n_factors,), TYPE_F32, contiguous((n_factors,), 4))
        params = [0, n_dims, 0, 4096, f32_bits(10000.0), f32_bits(1.0), f32_bits(0.0), f32_bits(1.0),
                  f32_bits(32.0), f32_bits(1.0)]
        return lay.node(lay.t((ne0, 1, 1), TYPE_F32, contiguous((ne0,), 4), OP_ROPE, [a, pos, factors], params))

    return build


def scale_of_rows(nb1: int) -> Callable[[Layout], Graph]:
    """SCALE of [23,1,3] F32 rows 92 bytes apart, its dimension of 1 of stride `nb1`: 276 is a [23,3]
    permuted, which ggml_is_contiguous calls contiguous, and ggml-cpu read row 2 at 2 * 276."""

    def build(lay: Layout) -> Graph:
        a = lay.t((23, 1, 3), TYPE_F32, (4, nb1, 92, 276), extent=276)
        return lay.node(lay.t((23, 1, 3), TYPE_F32, contiguous((23, 1, 3), 4), OP_SCALE, [a],
                              [f32_bits(2.0), f32_bits(0.0)]))

    return build


def mul_mat_b_strides(strides: tuple[int, int, int, int]) -> Callable[[Layout], Graph]:
    """A [4,4] times B [4,8] whose rows are `strides` apart: zero or overlapping."""

    def build(lay: Layout) -> Graph:
        a = lay.t((4, 4), TYPE_F32, contiguous((4, 4), 4))
        b = lay.t((4, 8), TYPE_F32, strides, extent=16 + 7 * strides[1])
        return lay.node(lay.t((4, 8), TYPE_F32, contiguous((4, 8), 4), OP_MUL_MAT, [a, b]))

    return build


def mul_mat_src0(type_: int, size: int) -> Callable[[Layout], Graph]:
    def build(lay: Layout) -> Graph:
        a = lay.t((4, 4), type_, contiguous((4, 4), size))
        b = lay.t((4, 2), TYPE_F32, contiguous((4, 2), 4))
        return lay.node(lay.t((4, 2), TYPE_F32, contiguous((4, 2), 4), OP_MUL_MAT, [a, b]))

    return build


def mul_mat_hadamard(rows: int, b_type: int = TYPE_F32) -> Callable[[Layout], Graph]:
    """A [4,`rows`] times B [4,3] with the Hadamard hint (op parameter 1): ggml-cpu then writes B's
    rows of 4 values (F32 or F16), transformed, into result rows of `rows` elements."""

    def build(lay: Layout) -> Graph:
        a = lay.t((4, rows), TYPE_F32, contiguous((4, rows), 4))
        size = 4 if b_type == TYPE_F32 else 2
        b = lay.t((4, 3), b_type, contiguous((4, 3), size))
        return lay.node(lay.t((rows, 3), TYPE_F32, contiguous((rows, 3), 4), OP_MUL_MAT, [a, b], [0, 1]))

    return build


def cpy_dequantized(result_strides: tuple[int, int, int, int] | None) -> Callable[[Layout], Graph]:
    """A Q8_0 [32,2] dequantized by CPY into F32 rows 1024 bytes apart, the result at its destination's
    strides or at `result_strides`: ggml-cpu's dequantizing copy writes the result from its own address
    at its destination's (src[1]'s) strides."""

    def build(lay: Layout) -> Graph:
        a = lay.t((32, 2), TYPE_Q8_0, (34, 34, 68, 68), extent=68)
        b = lay.t((32, 2), TYPE_F32, (4, 1024, 2048, 2048), extent=1024 + 128)
        return lay.node(lay.t((32, 2), TYPE_F32, result_strides or b.nb, OP_CPY, [a, b], at=b.offset))

    return build


def f16_row_op(op: int, params: list[int]) -> Callable[[Layout], Graph]:
    def build(lay: Layout) -> Graph:
        a = lay.t((16, 2), TYPE_F16, contiguous((16, 2), 2))
        return lay.node(lay.t((16, 2), TYPE_F16, contiguous((16, 2), 2), op, [a], params))

    return build


def set_rows_into(type_: int, size: int) -> Callable[[Layout], Graph]:
    def build(lay: Layout) -> Graph:
        dst = lay.t((4, 4), type_, contiguous((4, 4), size))
        rows = lay.t((4, 2), TYPE_F32, contiguous((4, 2), 4))
        ids = lay.t((2,), TYPE_I64, contiguous((2,), 8))
        return lay.node(lay.t((4, 4), type_, dst.nb, OP_SET_ROWS, [rows, ids], at=dst.offset))

    return build


def swiglu_clamp(limit: float) -> Callable[[Layout], Graph]:
    def build(lay: Layout) -> Graph:
        a = lay.t((16, 2), TYPE_F32, contiguous((16, 2), 4))
        b = lay.t((16, 2), TYPE_F32, contiguous((16, 2), 4))
        return lay.node(lay.t((16, 2), TYPE_F32, contiguous((16, 2), 4), OP_GLU, [a, b],
                              [GLU_SWIGLU_CLAMP, 0, 0, f32_bits(limit)]))

    return build


FINDINGS: dict[str, Callable[[Layout], Graph]] = {
    "cpy-f32-rows-into-q8_0": cpy_f32_rows_into_q8_0,
    "cpy-q4_0-to-q8_0": cpy_between_quantized_types,
    "cpy-f32-into-strided-q8_0": cpy_f32_into_strided_q8_0,
    "cpy-i32-to-f16": cpy_i32_to_f16,
    "flash-attn-v-heads-not-k-heads": flash_attn(2, 1 << 16),
    "flash-attn-no-v-heads": flash_attn(0, 128),
    "flash-attn-more-v-heads-than-q": flash_attn(4, 128),
    "rope-odd-row": rope(3, 2),
    "rope-odd-offset": rope(4, 2, n_offs=1),
    "rope-offset-past-the-row": rope(4, 2, n_offs=4),
    "rope-negative-offset": rope(4, 2, n_offs=-2),
    "mul-mat-zero-stride": mul_mat_b_strides((4, 0, 0, 0)),
    "mul-mat-overlapping-rows": mul_mat_b_strides((4, 8, 64, 64)),
    "mul-mat-i32-src0": mul_mat_src0(TYPE_I32, 4),
    "mul-mat-f64-src0": mul_mat_src0(TYPE_F64, 8),
    "rms-norm-f16": f16_row_op(OP_RMS_NORM, [f32_bits(1e-6)]),
    "norm-f16": f16_row_op(OP_NORM, [f32_bits(1e-6)]),
    "soft-max-f16": f16_row_op(OP_SOFT_MAX, [f32_bits(1.0), f32_bits(0.0)]),
    "scale-f16": f16_row_op(OP_SCALE, [f32_bits(2.0), f32_bits(0.0)]),
    "set-rows-into-f64": set_rows_into(TYPE_F64, 8),
    "set-rows-into-i8": set_rows_into(TYPE_I8, 1),
    "set-rows-into-i16": set_rows_into(TYPE_I16, 2),
    # found by the graph fuzzer (docs/reliability.md), past the rules of both hosts
    "rope-freq-factors-shorter-than-half-the-row": rope_freq_factors(8, 4, 2),
    "scale-of-a-permuted-source-with-a-dimension-of-1": scale_of_rows(276),
    # std::clamp(x, -limit, limit) asserts on a negative limit where the C++ library checks it
    "swiglu-clamp-of-a-negative-limit": swiglu_clamp(-1.0),
    # multimodal ROPE: ggml-cpu asserts a section, divides by their sum, reads four positions a token,
    # and aborts on a mode it does not know
    "rope-multimodal-without-sections": rope_multi((0, 0, 0, 0)),
    "rope-multimodal-of-a-negative-section": rope_multi((8, -4, 4, 0)),
    "rope-multimodal-of-sections-past-the-row": rope_multi((8, 8, 8, 0)),
    "rope-multimodal-of-one-position-a-token": rope_multi((4, 2, 2, 0), positions=1),
    "rope-of-an-unknown-mode": rope_multi((4, 2, 2, 0), mode=4),
    # CUDA's vision kernel splits the pairs by the first two sections alone, and divides by their sum
    "rope-vision-of-the-third-section-alone": rope_multi((0, 0, 4, 0), mode=24, n_dims=8),
    # the Hadamard hint makes ggml-cpu transform B's rows into the result's, which are shorter here
    "mul-mat-with-a-hadamard-hint-and-src0-not-square": mul_mat_hadamard(2),
    # the transform reads F32 or F16 rows; ggml-cpu aborts on any other type
    "mul-mat-with-a-hadamard-hint-over-bf16-rows": mul_mat_hadamard(4, TYPE_BF16),
    # found by the graph fuzzer (ggml-cpu asserted its destination's rows packed; with them packed, it
    # writes past the result's extent): the result of a CPY has its destination's strides
    "cpy-dequantized-at-strides-other-than-its-destination": cpy_dequantized(contiguous((32, 2), 4)),
}


def cpy_f32_into_q8_0_rows(lay: Layout) -> Graph:
    """What a KV cache store does: rows of floats quantized into rows of the same length."""
    a = lay.t((32, 4), TYPE_F32, contiguous((32, 4), 4))
    b = lay.t((32, 4), TYPE_Q8_0, (34, 34, 136, 136), extent=136)
    return lay.node(lay.t((32, 4), TYPE_Q8_0, b.nb, OP_CPY, [a, b], at=b.offset))


def set_rows_into_f16(lay: Layout) -> Graph:
    dst = lay.t((4, 4), TYPE_F16, contiguous((4, 4), 2))
    rows = lay.t((4, 2), TYPE_F32, contiguous((4, 2), 4))
    ids = lay.t((2,), TYPE_I64, contiguous((2,), 8))
    return lay.node(lay.t((4, 4), TYPE_F16, dst.nb, OP_SET_ROWS, [rows, ids], at=dst.offset))


def f32_row_op(op: int, params: list[int]) -> Callable[[Layout], Graph]:
    def build(lay: Layout) -> Graph:
        a = lay.t((16, 2), TYPE_F32, contiguous((16, 2), 4))
        return lay.node(lay.t((16, 2), TYPE_F32, contiguous((16, 2), 4), op, [a], params))

    return build


#: The same ops as the findings, as ggml builds them: computed (the rules refuse no more than they must).
LEGIT: dict[str, Callable[[Layout], Graph]] = {
    "cpy-f32-into-q8_0-rows": cpy_f32_into_q8_0_rows,
    "flash-attn-grouped-heads": flash_attn(1, 128),
    "rope-even-row-with-offset": rope(8, 4, n_offs=2),
    "mul-mat-f16-src0": mul_mat_src0(TYPE_F16, 2),
    "mul-mat-f32": mul_mat_b_strides((4, 16, 128, 128)),
    "rms-norm-f32": f32_row_op(OP_RMS_NORM, [f32_bits(1e-6)]),
    "soft-max-f32": f32_row_op(OP_SOFT_MAX, [f32_bits(1.0), f32_bits(0.0)]),
    "set-rows-into-f16": set_rows_into_f16,
    "rope-freq-factors-of-half-the-row": rope_freq_factors(8, 4, 4),
    "scale-of-rows-packed-across-a-dimension-of-1": scale_of_rows(92),
    "swiglu-clamp-of-a-limit-of-7": swiglu_clamp(7.0),
    "rope-multimodal-of-sections-in-the-row": rope_multi((4, 2, 2, 0)),
    "rope-vision-of-two-sections-over-half-the-row": rope_multi((2, 2, 0, 0), mode=24, n_dims=8),
    "mul-mat-with-a-hadamard-hint-and-a-square-src0": mul_mat_hadamard(4),
    "mul-mat-with-a-hadamard-hint-over-f16-rows": mul_mat_hadamard(4, TYPE_F16),
    "cpy-dequantized-into-rows-apart": cpy_dequantized(None),
}


class ComputeClient(Client):
    """A client with the library loaded, a 1 MiB data resource and a 1 MiB buffer of host memory."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.shmem(1, REPLY_SIZE)
        self.shmem(DATA_RES, 1 << 20)
        assert self.call(LOADLIBRARY)[0] == 0
        self.buft = struct.unpack_from("<Q", self.call(FORWARD, DEVICE_GET_BUFFER_TYPE)[1])[0]
        self.buffer = self.alloc(BUFFER_SIZE)
        assert self.buffer != 0

    def alloc(self, size: int) -> int:
        ret, reply = self.call(FORWARD, BUFFER_TYPE_ALLOC_BUFFER, struct.pack("<QQ", self.buft, size))
        assert ret == FORWARD_BASE
        return int(struct.unpack_from("<Q", reply)[0])

    def compute(self, graph: Graph) -> int:
        data = graph.serialize()
        self.maps[DATA_RES][0:len(data)] = data
        return self.call(FORWARD, GRAPH_COMPUTE, struct.pack("<IQ", DATA_RES, len(data)))[0]


def refused_and_serving(host: subprocess.Popen[bytes], path: Path, log: Path, said: str) -> None:
    """The host logged the refusal `said`, computes for a new client, and lives."""
    wait_for("the refusal logged", lambda: said in log.read_text(errors="replace"), 30)
    legit_compute(path)
    assert host.poll() is None


def legit_compute(path: Path) -> None:
    """out = x + y on a new connection, checked: the host still computes."""
    c = ComputeClient(path)
    try:
        lay = Layout(c.buffer)
        x = lay.t((16,), TYPE_F32, contiguous((16,), 4))
        y = lay.t((16,), TYPE_F32, contiguous((16,), 4))
        out = lay.t((16,), TYPE_F32, contiguous((16,), 4), OP_ADD, [x, y])
        for t, values in ((x, range(16)), (y, range(100, 116))):
            # a transfer goes through the start of the resource, `offset` is into the tensor
            c.maps[DATA_RES][0:64] = struct.pack("<16f", *values)
            args = struct.pack("<Q", c.buffer) + t.to_rpc().to_bytes() + struct.pack("<IQQ", DATA_RES, 0, 64)
            assert c.call(FORWARD, 17, args)[0] == FORWARD_BASE  # buffer_set_tensor
        assert c.compute(lay.node(out)) == FORWARD_BASE
        args = struct.pack("<Q", c.buffer) + out.to_rpc().to_bytes() + struct.pack("<IQQ", DATA_RES, 0, 64)
        assert c.call(FORWARD, 18, args)[0] == FORWARD_BASE  # buffer_get_tensor
        assert list(struct.unpack("<16f", c.maps[DATA_RES][0:64])) == [float(100 + 2 * i) for i in range(16)]
    finally:
        c.close()


@pytest.fixture(scope="module", params=["release", "sanitized"])
def any_host(request: pytest.FixtureRequest, llama_build: llamacpp.Build,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """apir-host over the CPU library, as built and as built with ASan and UBSan (test_apir_host_native.py's
    `asan_host`), which stops at its first report."""
    exe = llama_build.binary("apir-host") if request.param == "release" else request.getfixturevalue("asan_host")
    d = tmp_path_factory.mktemp(f"checks-{request.param}") / "apir"
    d.mkdir(mode=0o700)
    with apir_host(exe, llama_build, d) as served:
        yield served
        log = served[2].read_text(errors="replace")
        assert "runtime error:" not in log and "Sanitizer" not in log, log[-3000:]


@pytest.mark.parametrize("finding", sorted(FINDINGS))
def test_a_graph_the_kernels_cannot_compute_is_refused_and_the_host_serves_on(
        finding: str, any_host: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    """Each finding by a client of its own, against the release host and the ASan+UBSan one (`any_host`,
    which asserts no sanitizer report when its module is done)."""
    host, path, log = any_host
    before = log.read_text(errors="replace").count(REFUSED_NODE)
    c = ComputeClient(path)
    try:
        assert c.compute(FINDINGS[finding](Layout(c.buffer))) == FORWARD_BASE + 1
        assert c.closed_by_host()
    finally:
        c.close()
    wait_for("the refusal logged", lambda: log.read_text(errors="replace").count(REFUSED_NODE) > before, 30)
    legit_compute(path)
    assert host.poll() is None
    text = log.read_text(errors="replace")
    assert "ended by signal" not in text and "GGML_ASSERT" not in text, text[-3000:]


@pytest.mark.parametrize("graph", sorted(LEGIT))
def test_the_same_ops_as_ggml_builds_them_are_computed(graph: str,
                                                      any_host: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    """The accepted forms beside the findings, computed through the kernels on both builds of the host."""
    c = ComputeClient(path := any_host[1])
    try:
        lay = Layout(c.buffer)
        built = LEGIT[graph](lay)
        if graph == "set-rows-into-f16":  # the indices are read: in range
            ids = built.nodes[0].src[1]
            args = struct.pack("<Q", c.buffer) + ids.to_rpc().to_bytes() + struct.pack("<IQQ", DATA_RES, 0, 16)
            c.maps[DATA_RES][0:16] = struct.pack("<2q", 3, 1)
            assert c.call(FORWARD, 17, args)[0] == FORWARD_BASE
        assert c.compute(built) == FORWARD_BASE
    finally:
        c.close()
    legit_compute(path)


# --- the cap on a client's host memory ----------------------------------------------------------------

MiB = 1 << 20
CAP = 64 * MiB


def child_of(host: subprocess.Popen[bytes]) -> int:
    """The child serving the one connected client."""
    def found() -> list[int]:
        with contextlib.suppress(OSError):
            return [int(p) for p in Path(f"/proc/{host.pid}/task/{host.pid}/children").read_text().split()]
        return []

    wait_for("the client's child", lambda: len(found()) == 1, 30)
    return found()[0]


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def capped(llama_build: llamacpp.Build, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    d = tmp_path / "apir"
    d.mkdir(mode=0o700)
    with apir_host(llama_build.binary("apir-host"), llama_build, d, env={"GGML_VIRTGPU_HOST_MEM_CAP": str(CAP)}) as s:
        yield s


def test_a_resource_past_the_cap_is_refused_and_a_destroyed_one_is_uncharged(
        capped: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    host, path, log = capped
    # a sparse sealed memfd of 1 TiB: today's host maps it, and a BUFFER_CLEAR of a buffer over it
    # would make it write a TiB
    c = Client(path)
    c.shmem(1, REPLY_SIZE)
    fd = sealed_memfd(1 << 40)
    try:
        socket.send_fds(c.sock, [header(SHMEM_CREATE, DATA_RES, 1 << 40)], [fd])
    finally:
        os.close(fd)
    assert c.closed_by_host()
    c.close()
    wait_for("the refusal logged", lambda: "would pass the client's host memory cap" in log.read_text(), 30)

    # resources within the cap, one destroyed: another as large fits again; without the destroy it would not
    c = Client(path)
    try:
        c.shmem(1, REPLY_SIZE)
        for res in (2, 3):
            c.shmem(res, 24 * MiB)
        c.sock.sendall(header(SHMEM_DESTROY, 3))
        c.shmem(4, 24 * MiB)
        assert c.call(LOADLIBRARY)[0] == 0  # still served
        c.shmem(5, 24 * MiB)
        assert c.closed_by_host()
    finally:
        c.close()
    good_session(path)
    assert host.poll() is None


def test_buffers_past_the_cap_are_refused_and_the_child_stays_below_it(
        capped: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    host, path, _log = capped
    c = ComputeClient(path)  # 1 MiB shared, 1 MiB allocated
    try:
        child = child_of(host)
        baseline = status_kb(child, "VmRSS")
        first = c.alloc(40 * MiB)
        assert first != 0
        # every page of it written by the host
        assert c.call(FORWARD, BUFFER_CLEAR, struct.pack("<QQ", first, 7))[0] == FORWARD_BASE
        assert c.alloc(40 * MiB) == 0  # past the cap: no buffer, and the client is served on
        assert c.alloc(1 << 62) == 0
        assert c.call(FORWARD, BUFFER_FREE, struct.pack("<Q", first))[0] == FORWARD_BASE
        second = c.alloc(40 * MiB)  # its bytes were given back
        assert second != 0
        assert c.call(FORWARD, BUFFER_CLEAR, struct.pack("<QQ", second, 7))[0] == FORWARD_BASE
        peak = status_kb(child, "VmHWM")
        # the 40 MiB written are measured, and nothing near the cap more
        assert 36 * MiB < (peak - baseline) * 1024 < CAP, (peak, baseline)
    finally:
        c.close()
    legit_compute(path)


def test_apirctl_starts_the_host_with_the_containers_memory_limit_as_its_cap(with_build: llamacpp.Build) -> None:
    from apirctl.remoting import apir_hosts

    host = apir_hosts.start(with_build, "capped", mem_cap=96 * MiB)
    try:
        environ = Path(f"/proc/{host.pid}/environ").read_bytes().split(b"\0")
        assert f"{apir_hosts.MEM_CAP_ENV}={96 * MiB}".encode() in environ
        assert apir_hosts.get(host.id) is not None and apir_hosts.get(host.id).mem_cap == 96 * MiB  # type: ignore[union-attr]
    finally:
        apir_hosts.stop(host)


# --- a result's room, and ops outside ggml's tables, on both builds of the host (`any_host`) ---------------

ROOM_BYTES = 4 * 4 * 4  # MUL_MAT's F32 [4,4] result


def set_f32(c: ComputeClient, buffer: int, t: Tensor, values: list[float]) -> None:
    data = struct.pack(f"<{len(values)}f", *values)
    c.maps[DATA_RES][0:len(data)] = data
    args = struct.pack("<Q", buffer) + t.to_rpc().to_bytes() + struct.pack("<IQQ", DATA_RES, 0, len(data))
    assert c.call(FORWARD, 17, args)[0] == FORWARD_BASE  # buffer_set_tensor


def mul_mat_into(c: ComputeClient, room: int) -> tuple[Graph, Tensor, int]:
    """out = a x b (a and b F32 [16,4], all 1 and 2) with out F32 [4,4] alone in a buffer of `room` bytes."""
    lay = Layout(c.buffer)
    a = lay.t((16, 4), TYPE_F32, contiguous((16, 4), 4))
    b = lay.t((16, 4), TYPE_F32, contiguous((16, 4), 4))
    set_f32(c, c.buffer, a, [1.0] * 64)
    set_f32(c, c.buffer, b, [2.0] * 64)
    small = c.alloc(room)
    assert small != 0
    out = Layout(small).t((4, 4), TYPE_F32, contiguous((4, 4), 4), OP_MUL_MAT, [a, b], at=0)
    return Layout(small).node(out), out, small


def test_a_result_with_exactly_its_room_computes_and_one_byte_less_is_refused(
        any_host: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    """The rule that a result has the room its buffer's get_alloc_size asks for (0015's
    `has_room_for_result`, for the ops `ggml_op_alloc_size_may_expand` names: MUL_MAT here) has no case of
    its own on a CPU host: the CPU's buffer types answer ggml_nbytes, and the library refuses a tensor whose
    ggml_nbytes runs past its buffer when it decodes it, before any rule runs. So the boundary is tested
    as a client meets it: a result in exactly its room computes, one byte less is refused, and the host
    serves on. The rule's own arithmetic, over a buffer type that asks for more (as CUDA's does), is
    llama_patches/tests/node_check_test.cpp (test_node_check_native.py)."""
    host, path, log = any_host
    c = ComputeClient(path)
    try:
        graph, out, small = mul_mat_into(c, ROOM_BYTES)
        assert c.compute(graph) == FORWARD_BASE
        args = struct.pack("<Q", small) + out.to_rpc().to_bytes() + struct.pack("<IQQ", DATA_RES, 0, ROOM_BYTES)
        assert c.call(FORWARD, 18, args)[0] == FORWARD_BASE  # buffer_get_tensor
        assert list(struct.unpack("<16f", c.maps[DATA_RES][0:ROOM_BYTES])) == [32.0] * 16
        graph, _, _ = mul_mat_into(c, ROOM_BYTES - 1)
        assert c.compute(graph) == FORWARD_BASE + 1
        assert c.closed_by_host()
    finally:
        c.close()
    refused_and_serving(host, path, log,
                        f"a tensor of {ROOM_BYTES} bytes at offset 0 of a buffer of {ROOM_BYTES - 1} bytes")


OP_UNARY, OP_GLU, OP_COUNT = 91, 100, 101
UNARY_COUNT, GLU_COUNT = 22, 7
#: (op, op_params[0]) of nodes a hostile client sends: ggml_op_desc would index its name tables with them
UNKNOWN_OPS = {"op-count": (OP_COUNT, 0), "op-far-past-the-table": (0x7FFFFFFF, 0), "op-all-ones": (0xFFFFFFFF, 0),
               "unary-op-count": (OP_UNARY, UNARY_COUNT), "unary-op-negative": (OP_UNARY, -1),
               "glu-op-count": (OP_GLU, GLU_COUNT), "glu-op-far-past-the-table": (OP_GLU, 0x7FFFFFFF)}


@pytest.mark.parametrize("name", sorted(UNKNOWN_OPS))
def test_a_node_of_an_unknown_op_is_refused_and_named_safely(
        name: str, any_host: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    """The library refuses the op's enums as it decodes the tensor (`apir_enums_are_known`), before any
    rule or log line reads a name table: its line gives the numbers. (ggml_node_op_desc, which names
    such a node "unknown op" where a host reaches it, is ggml-rpc's: test_rpc_graph_check.py, and
    node_check_test.cpp under the sanitizers.)"""
    host, path, log = any_host
    op, param = UNKNOWN_OPS[name]
    c = ComputeClient(path)
    try:
        lay = Layout(c.buffer)
        a = lay.t((32,), TYPE_F32, contiguous((32,), 4))
        assert c.compute(lay.node(lay.t((32,), TYPE_F32, contiguous((32,), 4), op, [a], [param]))) == FORWARD_BASE + 1
        assert c.closed_by_host()
    finally:
        c.close()
    refused_and_serving(host, path, log, f"a tensor with an unknown type {TYPE_F32} or op {op}\n")
