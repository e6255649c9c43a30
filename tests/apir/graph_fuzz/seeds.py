"""The graph fuzzers' seed corpus: programs for graph_gen.h, a few per op.

Each seed is one graph of the op in the shapes upstream's test-backend-ops and a served llama model
give it (a 64-wide head, 4 heads over 2 KV heads, a Q4_0 or Q8_0 weight of 256 by 64, ...), written
in the generator's program form (graph_gen.h): the op's byte, then its fields in the order the
generator reads them. None of them is one of issue 30's findings: the rediscovery figures measure
the fuzzer, not the seeds. Usage:

    python -m tests.apir.graph_fuzz.seeds OUT_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"

# graph_gen.h's op selectors and type tables
MUL_MAT, MUL_MAT_ID, BINARY, SCALE, NORM, SOFT_MAX, ROPE, FLASH_ATTN, CPY, DUP, GET_ROWS, SET_ROWS, GLU, UNARY, \
    RESHAPE = range(15)
ANY = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q5_0": 6, "q5_1": 7, "q4_k": 8, "q6_k": 9,
       "q2_k": 10, "iq4_nl": 11}
FLOAT = {"f32": 0, "f16": 2, "bf16": 3}
LEAF, TRANSPOSED, PERMUTED, STRIDED = 0, 1, 2, 3
NO_MUTATION = 0


def dim(n: int) -> bytes:
    """A dimension: one byte for 1..48, else its exact value."""
    return bytes([n - 1]) if 1 <= n <= 48 else bytes([0xEF]) + struct.pack("<H", n)


def b(*values: int) -> bytes:
    return bytes(v & 0xFF for v in values)


def weight(name: str) -> bytes:
    """weight_type(): a model's weight type (the first 12 of the table)."""
    return b(1, ANY[name])


def program(*nodes: bytes, wide: bool = False, seed: int = 30, deltas: bytes = b"", clears: bool = False) -> bytes:
    """With `deltas` (deltas()), the APIR harness keeps the graph by id and updates it by EXT_GRAPH_DELTA;
    with `clears` too, `deltas` is cleared()'s: each delta preceded by a clear and a run of the kept graph."""
    flags = int(wide) | (2 if deltas else 0) | (4 if clears else 0)
    return b(flags) + struct.pack("<I", seed) + b(len(nodes) - 1) + b"".join(nodes) + deltas


# apir_graph_fuzz.cpp's delta steps (how % 8)
BATCH, VIEW_OFFSET, DATA_OFFSET, HOSTILE = 0, 1, 2, 3


def batch(which: int, d: int, size: int) -> bytes:
    """Dimension `d` of tensor `which` (and the same dimension of every tensor of its size) to `size`,
    at most its first size."""
    return b(which, BATCH | d << 3, size - 1)


def view_offset(which: int, elements: int, back: bool = False) -> bytes:
    """A view's offset moved by `elements` (1..4) of its first stride."""
    return b(which, VIEW_OFFSET, (elements - 1) << 1 | (0x80 if back else 0))


def hostile(which: int, kind: int) -> bytes:
    return b(which, HOSTILE, kind)


def deltas(*each: tuple[bytes, ...]) -> bytes:
    """The deltas after a graph: each a tuple of 1..4 steps."""
    return b(len(each) - 1) + b"".join(b(len(steps) - 1) + b"".join(steps) for steps in each)


#: No clear before a delta (an odd byte)
NO_CLEAR = b(1)


def clear(buffer: int, value: int) -> bytes:
    """BUFFER_CLEAR of the graph's buffer `buffer` (one per tensor that is not a view, in the generator's
    order) with `value`, then the kept graph run by id."""
    return b(2 * buffer, value)


def cleared(*each: tuple[bytes, tuple[bytes, ...]]) -> bytes:
    """The deltas after a graph with clears (program(clears=True)): each a clear() or NO_CLEAR, and its steps."""
    return b(len(each) - 1) + b"".join(c + b(len(steps) - 1) + b"".join(steps) for c, steps in each)


def mul_mat(w: str, k: int, m: int, n: int, a2: int = 1, a3: int = 1, r2: int = 1, r3: int = 1,
            a_how: int = LEAF, b_f16: bool = False, b_how: int = LEAF) -> bytes:
    return (b(MUL_MAT) + weight(w) + dim(k) + dim(m) + dim(n) + b(a2 - 1, a3 - 1, r2 - 1, r3 - 1, a_how)
            + b(0 if b_f16 else 1, b_how, NO_MUTATION))


def mul_mat_id(w: str, k: int, m: int, n_exp: int, n_used: int, n_tok: int) -> bytes:
    return (b(MUL_MAT_ID) + weight(w) + dim(k) + dim(m) + b(n_exp - 1, n_used - 1, n_tok - 1, 1, LEAF)
            + b(NO_MUTATION))


def binary(op: int, t: str, ne: tuple[int, int, int, int], broadcast: int = 0, b_f32: bool = True) -> bytes:
    return (b(BINARY, op, FLOAT[t]) + dim(ne[0]) + dim(ne[1]) + b(ne[2] - 1, ne[3] - 1, LEAF, broadcast)
            + b(0 if b_f32 else 1, LEAF, NO_MUTATION))


def scale(t: str, ne0: int, ne1: int, how: int = LEAF) -> bytes:
    return b(SCALE, FLOAT[t]) + dim(ne0) + dim(ne1) + b(0, how, 3, 0, NO_MUTATION)


def norm(rms: bool, ne0: int, ne1: int, ne2: int = 1, how: int = LEAF) -> bytes:
    return b(NORM, 0 if rms else 1, 1) + dim(ne0) + dim(ne1) + b(ne2 - 1, how, NO_MUTATION)


def soft_max(ne0: int, ne1: int, ne2: int, mask: str | None, sinks: bool = False, alibi: bool = False) -> bytes:
    what = (1 if mask else 0) | (2 if mask == "f16" else 0) | (4 if mask else 0) | (8 if sinks else 0)
    what |= 16 if alibi else 0
    return b(SOFT_MAX, 1) + dim(ne0) + dim(ne1) + b(ne2 - 1, 0, what) + (b(0) if mask else b"") + b(NO_MUTATION)


def rope(ne0: int, heads: int, tokens: int, neox: bool = False, f16: bool = False, n_dims: int | None = None,
         freq_factors: bool = False, how: int = LEAF) -> bytes:
    what = (0 if n_dims else 1) | (2 if freq_factors else 0) | (4 if neox else 0)
    out = b(ROPE, 0 if f16 else 1, ne0 // 2 - 1, heads - 1, tokens - 1, how, what)
    if n_dims:
        out += b(n_dims // 2 - 1)
    return out + b(NO_MUTATION)


def flash_attn(d: int, n_q: int, n_kv: int, h_kv: int, gqa: int, kv: str = "f16", mask: bool = True,
               sinks: bool = False, softcap: bool = False, dv: int | None = None) -> bytes:
    out = b(FLASH_ATTN, d // 16 - 1) + (b(0, dv // 16 - 1) if dv else b(1))
    out += b(n_q - 1, n_kv - 1, h_kv - 1, gqa - 1)
    out += b(0) if kv == "f16" else (b(1, 0) if kv == "q8_0" else b(1, 1))
    what = (1 if mask else 0) | (4 if sinks else 0) | (16 if softcap else 0)
    return out + b(PERMUTED, PERMUTED, 0, PERMUTED, what, NO_MUTATION)


def cpy(src: str, dst: str, ne0: int, ne1: int, ne2: int = 1, b_how: int = LEAF) -> bytes:
    return b(CPY, ANY[src], ANY[dst], 1) + dim(ne0) + dim(ne1) + b(ne2 - 1, LEAF, 1, b_how, NO_MUTATION)


def dup(t: str, ne0: int, ne1: int, how: int = LEAF, cont: bool = True) -> bytes:
    return b(DUP, ANY[t]) + dim(ne0) + dim(ne1) + b(0, how, 0 if cont else 1, NO_MUTATION)


def get_rows(t: str, ne0: int, n_rows: int, n_idx: int) -> bytes:
    return b(GET_ROWS, ANY[t]) + dim(n_rows) + dim(n_idx) + b(0) + dim(ne0) + b(LEAF, NO_MUTATION)


def set_rows(t: str, ne0: int, n_rows: int, n_set: int, i64: bool = True, f16_rows: bool = False) -> bytes:
    return (b(SET_ROWS, ANY[t]) + dim(ne0) + dim(n_rows) + b(n_set - 1, 0, 0 if f16_rows else 1, LEAF)
            + b(0 if i64 else 1, NO_MUTATION))


def glu(t: str, n: int, rows: int, op: int, split: bool) -> bytes:
    if split:
        return b(GLU, FLOAT[t]) + dim(n) + b(op, 1) + dim(rows) + b(0, NO_MUTATION)
    return b(GLU, FLOAT[t]) + dim(n) + b(op, 0) + dim(rows) + b(0, 0, NO_MUTATION)


def unary(t: str, ne0: int, ne1: int, op: int) -> bytes:
    return b(UNARY, FLOAT[t]) + dim(ne0) + dim(ne1) + b(0, LEAF, op, NO_MUTATION)


def reshape(t: str, ne0: int, ne1: int) -> bytes:
    return b(RESHAPE, FLOAT[t]) + dim(ne0) + dim(ne1) + b(NO_MUTATION)


def seeds() -> dict[str, bytes]:
    """name -> program: one graph per case."""
    out = {
        # a llama layer's matrix products: the weights' types, one token and a batch
        "mul_mat-q4_0-token": program(mul_mat("q4_0", 256, 64, 1)),
        "mul_mat-q8_0-batch": program(mul_mat("q8_0", 256, 64, 7)),
        "mul_mat-q4_k-batch": program(mul_mat("q4_k", 256, 32, 3)),
        "mul_mat-q6_k-token": program(mul_mat("q6_k", 256, 16, 1)),
        "mul_mat-f16-bcast": program(mul_mat("f16", 64, 16, 4, a2=2, r2=2, b_f16=True)),
        "mul_mat-f32-kq": program(mul_mat("f32", 64, 32, 4, a2=2, r2=2, a_how=PERMUTED, b_how=PERMUTED)),
        "mul_mat-bf16-transposed": program(mul_mat("bf16", 32, 16, 5, b_how=TRANSPOSED)),
        "mul_mat_id-q4_0": program(mul_mat_id("q4_0", 64, 32, 8, 2, 4)),
        "mul_mat_id-f16": program(mul_mat_id("f16", 32, 16, 4, 2, 3)),
        "add-f32-bcast": program(binary(0, "f32", (64, 8, 2, 1), broadcast=0b0010)),
        "mul-f16": program(binary(1, "f16", (32, 4, 1, 1), b_f32=False)),
        "sub-bf16": program(binary(2, "bf16", (16, 3, 1, 1))),
        "div-f32": program(binary(3, "f32", (8, 8, 1, 1))),
        "scale-f32": program(scale("f32", 64, 4)),
        "rms_norm-f32": program(norm(True, 256, 7)),
        "norm-f32": program(norm(False, 64, 3, 2)),
        "soft_max-mask-f16": program(soft_max(32, 4, 4, "f16")),
        "soft_max-mask-f32-sinks": program(soft_max(16, 3, 2, "f32", sinks=True)),
        "soft_max-alibi": program(soft_max(64, 2, 4, "f16", alibi=True)),
        "soft_max-plain": program(soft_max(48, 5, 1, None)),
        "rope-norm": program(rope(64, 4, 3)),
        "rope-neox-f16": program(rope(64, 2, 5, neox=True, f16=True)),
        "rope-partial": program(rope(32, 4, 2, n_dims=16, freq_factors=True)),
        "rope-permuted": program(rope(16, 2, 4, how=PERMUTED)),
        "flash_attn-f16-gqa": program(flash_attn(64, 1, 32, 2, 2)),
        "flash_attn-q8_0": program(flash_attn(64, 4, 64, 1, 4, kv="q8_0")),
        "flash_attn-f32-sinks": program(flash_attn(32, 3, 16, 2, 1, kv="f32", sinks=True, softcap=True)),
        "flash_attn-no-mask": program(flash_attn(128, 2, 8, 1, 1, mask=False)),
        "cpy-f32-f16": program(cpy("f32", "f16", 64, 4)),
        "cpy-f32-q8_0": program(cpy("f32", "q8_0", 64, 2)),
        "cpy-f16-f32-transposed": program(cpy("f16", "f32", 16, 8, b_how=TRANSPOSED)),
        "cpy-f32-bf16-3d": program(cpy("f32", "bf16", 32, 4, 3)),
        "cont-f32-transposed": program(dup("f32", 16, 8, how=TRANSPOSED)),
        "dup-f16": program(dup("f16", 32, 4, cont=False)),
        "get_rows-q4_0": program(get_rows("q4_0", 64, 16, 7)),
        "get_rows-f16": program(get_rows("f16", 32, 8, 3)),
        "get_rows-f32": program(get_rows("f32", 16, 20, 1)),
        "set_rows-f16-kv": program(set_rows("f16", 64, 32, 3)),
        "set_rows-f32-i32": program(set_rows("f32", 16, 8, 2, i64=False)),
        "set_rows-q8_0": program(set_rows("q8_0", 32, 8, 2)),
        "glu-swiglu-split": program(glu("f32", 32, 4, 2, split=True)),
        "glu-geglu-fused": program(glu("f16", 16, 3, 1, split=False)),
        "unary-silu": program(unary("f32", 64, 2, 10)),
        "unary-gelu-f16": program(unary("f16", 32, 3, 8)),
        "reshape-scale": program(reshape("f32", 16, 4)),
        # a layer's attention as a graph: norm, rope, attention, projection (several nodes)
        "layer-attention": program(norm(True, 64, 4), rope(64, 4, 4), flash_attn(64, 4, 32, 2, 2),
                                   mul_mat("q8_0", 256, 64, 4)),
        "layer-ffn": program(norm(True, 64, 2), mul_mat("q4_0", 64, 48, 2), glu("f32", 24, 2, 2, split=True),
                             binary(0, "f32", (64, 2, 1, 1))),
        "kv-store": program(rope(64, 2, 3, neox=True), set_rows("f16", 64, 16, 3), cpy("f32", "f16", 64, 3)),
        "wide-mul_mat": program(mul_mat("q8_0", 256, 32, 2), wide=True),
        "wide-flash_attn": program(flash_attn(64, 2, 16, 2, 2), wide=True),
        # a kept graph updated by EXT_GRAPH_DELTA (APIR): the batch shrinks and grows back, the KV
        # cache grows, a view moves; and a hostile change, refused
        "delta-mul_mat-batch": program(mul_mat("q8_0", 256, 64, 7),
                                       deltas=deltas((batch(1, 1, 3),), (batch(1, 1, 7),), (batch(1, 1, 1),))),
        "delta-layer-ffn-batch": program(norm(True, 64, 2), mul_mat("q4_0", 64, 48, 2),
                                         glu("f32", 24, 2, 2, split=True), binary(0, "f32", (64, 2, 1, 1)),
                                         deltas=deltas((batch(0, 1, 1),), (batch(0, 1, 2),))),
        "delta-flash_attn-kv": program(flash_attn(64, 1, 32, 2, 2),
                                       deltas=deltas((batch(6, 0, 16),), (batch(6, 0, 32),))),
        "delta-kv-store-batch": program(rope(64, 2, 3, neox=True), set_rows("f16", 64, 16, 3),
                                        cpy("f32", "f16", 64, 3), deltas=deltas((batch(1, 0, 2),))),
        "delta-rms_norm-view": program(norm(True, 64, 4, how=STRIDED),
                                    deltas=deltas((view_offset(1, 1),), (view_offset(1, 1, back=True),))),
        "delta-soft_max-rows": program(soft_max(32, 4, 4, "f16"), deltas=deltas((batch(0, 1, 2),), (batch(0, 1, 4),))),
        "delta-get_rows-ids": program(get_rows("f16", 32, 8, 3), deltas=deltas((batch(1, 0, 1),), (batch(1, 0, 3),))),
        "delta-set_rows-rows": program(set_rows("f32", 16, 8, 2, i64=False),
                                       deltas=deltas((batch(2, 0, 1),), (batch(2, 0, 2),))),
        "delta-mul_mat_id-tokens": program(mul_mat_id("q4_0", 64, 32, 8, 2, 4),
                                           deltas=deltas((batch(1, 2, 2),), (batch(1, 2, 4),))),
        "delta-add-bcast": program(binary(0, "f32", (64, 8, 2, 1), broadcast=0b0010),
                                   deltas=deltas((batch(0, 1, 3),), (batch(0, 1, 8),))),
        "delta-mul_mat-kq-kv": program(mul_mat("f32", 64, 32, 4, a2=2, r2=2, a_how=PERMUTED, b_how=PERMUTED),
                                       deltas=deltas((batch(0, 2, 16),), (batch(0, 2, 32),))),
        "delta-rope-neox-tokens": program(rope(64, 2, 5, neox=True, f16=True),
                                          deltas=deltas((batch(1, 0, 3),), (batch(1, 0, 5),))),
        "delta-cpy-transposed": program(cpy("f16", "f32", 16, 8, b_how=TRANSPOSED),
                                        deltas=deltas((batch(0, 1, 4),), (batch(0, 1, 8),))),
        "delta-rope-hostile": program(rope(64, 4, 3), wide=True,
                                      deltas=deltas((batch(1, 0, 2),), (hostile(2, 1),))),
        # a kept graph's buffer cleared (BUFFER_CLEAR keeps the host's graphs), then the graph run by id:
        # indices cleared to 0 or floats to anything compute, indices cleared to 0xff (-1) are refused.
        # Buffers: GET_ROWS rows 0, ids 1; MUL_MAT_ID experts 0, b 1, ids 2; SET_ROWS rows 0, b 1, ids 2
        "clear-get_rows-ids": program(get_rows("f16", 32, 8, 3), clears=True,
                                      deltas=cleared((clear(1, 0x00), (batch(1, 0, 1),)),
                                                     (clear(1, 0xFF), (batch(1, 0, 3),)))),
        "clear-mul_mat_id-ids": program(mul_mat_id("q4_0", 64, 32, 8, 2, 4), clears=True,
                                        deltas=cleared((clear(1, 0x3F), (batch(1, 2, 2),)),
                                                       (clear(2, 0xFF), (batch(1, 2, 4),)))),
        "clear-set_rows-f32": program(set_rows("f32", 16, 8, 2, i64=False), clears=True,
                                      deltas=cleared((clear(1, 0x00), (batch(2, 0, 1),)),
                                                     (NO_CLEAR, (batch(2, 0, 2),)),
                                                     (clear(2, 0x00), (batch(2, 0, 1),)))),
        "clear-set_rows-i64-kv": program(set_rows("f16", 64, 32, 3), clears=True,
                                         deltas=cleared((clear(2, 0xFF), (batch(2, 0, 1),)))),
    }
    return out


def write(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in seeds().items():
        path = out_dir / f"{name}-{hashlib.sha256(data).hexdigest()[:8]}"
        path.write_bytes(data)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, nargs="?", default=CORPUS)
    args = parser.parse_args()
    for path in write(args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
