"""Seed inputs for the APIR dispatch fuzzer (apir_dispatch_fuzz.cpp) from a real `apir-host --trace`.

The trace holds every FORWARD command a frontend sent and the host's replies, but not the shared
memory (docs/apir.md, Traces). Each FORWARD record becomes one call of the harness's input format:

- handles the host answered (buffer types, buffers, bases) are replaced, where a request names them,
  by the harness's placeholders, numbered the way the harness keeps them in each seed;
- shared-resource ids are mapped to the harness's resources (buffer_from_ptr: its buffer memory,
  set/get tensor: its data region, graphs: its graph region) and sizes cut to their 1 MiB;
- graph_compute's graph, which lives in shared memory and not in the trace, is built here: small
  llama-like graphs (matrix products, norms, softmax, rows, views, activations) in the buffer the
  session made last.

From that call list it writes a few dozen short inputs: the session's start, a handful of distinct
calls of each function with the calls that made the handles they use, a buffer's whole life, and one
graph_compute per graph. A trace whose host granted the wide records (FEATURE_WIDE_TENSORS) gives
calls in that width, and every input asks for it before its first such call; the `wide-*` seeds
take the wide decoding paths whatever the trace. Usage:

    python -m tests.apir.fuzz.seeds_from_trace TRACE OUT_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from apirctl.apir import extensions, protocol, trace
from apirctl.apir.tensor import (
    FLAG_INPUT,
    FLAG_OUTPUT,
    GGML_TENSOR_SIZE,
    OP_ADD,
    OP_MUL_MAT,
    Graph,
    Tensor,
    rpc_tensor_size,
)

PLACEHOLDER = 0x4150495248000000
CALL = struct.Struct("<BBHII")
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
RES_DATA, RES_GRAPH, RES_BUFFER, RES_SMALL = 1, 2, 3, 4
RES_SIZE = 1 << 20
MAX_CALLS = 64  # the harness reads at most this many calls of an input

# function indexes (docs/apir.md, the functions)
SUPPORTS_OP, GET_BUFFER_TYPE, BUFFER_FROM_PTR = 6, 7, 9
ALLOC_BUFFER, GET_ALLOC_SIZE, GET_BASE = 14, 15, 16
SET_TENSOR, GET_TENSOR, CPY_TENSOR, CLEAR, FREE_BUFFER, GRAPH_COMPUTE = 17, 18, 19, 20, 21, 22
N_FUNCTIONS = 23
# the harness's numbers for the extension commands (llama_patches 0013, 0021, 0028): 256 to 259 on the wire
EXT_GET_FEATURES, EXT_GRAPH_RUN, EXT_GRAPH_DELTA = N_FUNCTIONS + 1, N_FUNCTIONS + 2, N_FUNCTIONS + 3
EXT_TENSORS_GET = N_FUNCTIONS + 4
# the functions whose request starts with a buffer-type or buffer handle
HANDLE_FIRST = {10, 11, 12, ALLOC_BUFFER, GET_ALLOC_SIZE, GET_BASE, SET_TENSOR, GET_TENSOR, CPY_TENSOR, CLEAR,
                FREE_BUFFER}
RPC_BUFFER_AT = 16  # apir_rpc_tensor.buffer
CHANGE_BUFFER_AT = 24  # apir_graph_change.buffer
GGML_BUFFER_AT = 8  # ggml_tensor.buffer

# ggml's enums at the pinned source (ggml.h)
TYPE_I32 = 26
OP_MUL, OP_RMS_NORM, OP_SCALE, OP_CPY, OP_CONT = 7, 25, 32, 34, 35
OP_RESHAPE, OP_VIEW, OP_PERMUTE, OP_TRANSPOSE, OP_GET_ROWS = 36, 37, 38, 39, 40
OP_SOFT_MAX, OP_UNARY, OP_GLU = 46, 91, 100
UNARY_SILU, GLU_SWIGLU = 10, 2


@dataclass
class Call:
    """One forwarded call: raw request fields (host handles as the trace had them) and resource bytes."""

    fn: int
    request: bytes
    handle_offsets: list[int] = field(default_factory=list)  # where the request names a handle
    res: int = 0  # harness resource to write res_bytes into, 0 for none
    res_bytes: bytes = b""
    res_handle_offsets: list[int] = field(default_factory=list)
    produces: list[int] = field(default_factory=list)  # handle values the reply gave, in the harness's order
    wide: bool = False  # its tensor records are apir_rpc_tensor_wide: the input negotiates them first

    def uses(self) -> list[int]:
        return [v for v in (_u64(self.request, o) for o in self.handle_offsets) if v] + \
            [v for v in (_u64(self.res_bytes, o) for o in self.res_handle_offsets) if v]


def _u64(data: bytes | bytearray, at: int) -> int:
    return U64.unpack_from(data, at)[0] if at + 8 <= len(data) else 0


def _put64(data: bytearray, at: int, value: int) -> None:
    if at + 8 <= len(data):
        U64.pack_into(data, at, value)


def produced(fn: int, reply: bytes) -> list[int]:
    """The handles the harness keeps from a successful reply (its keep_handle calls)."""
    offsets = {GET_BUFFER_TYPE: [0], BUFFER_FROM_PTR: [0, 8], ALLOC_BUFFER: [0], GET_BASE: [0]}.get(fn, [])
    return [_u64(reply, o) for o in offsets if o + 8 <= len(reply)]


def handle_offsets(fn: int, request: bytes, wide: bool = False) -> list[int]:
    out = [0] if fn in HANDLE_FIRST else []
    if fn in (SET_TENSOR, GET_TENSOR, CPY_TENSOR):
        out.append(8 + RPC_BUFFER_AT)
    if fn == CPY_TENSOR:
        out.append(8 + rpc_tensor_size(wide) + RPC_BUFFER_AT)
    if fn in (SUPPORTS_OP, GET_ALLOC_SIZE):  # the inline tensor: its buffer handle follows the struct
        start = 8 if fn == GET_ALLOC_SIZE else 0
        if _u64(request, start + GGML_BUFFER_AT):
            out.append(start + GGML_TENSOR_SIZE)
    return out


def adapt(fn: int, request: bytearray, wide: bool = False) -> None:
    """Map resource ids to the harness's and cut sizes to its resources."""
    def cut(at: int) -> None:
        _put64(request, at, min(_u64(request, at), RES_SIZE))

    if fn == BUFFER_FROM_PTR and len(request) >= 20:
        U32.pack_into(request, 0, RES_BUFFER)
        cut(4)
        cut(12)
    elif fn == ALLOC_BUFFER:
        cut(8)
    elif fn in (SET_TENSOR, GET_TENSOR) and len(request) >= 8 + rpc_tensor_size(wide) + 20:
        at = 8 + rpc_tensor_size(wide)
        U32.pack_into(request, at, RES_DATA)
        cut(at + 12)


# --- graphs: the trace does not hold them ----------------------------------------------------------

def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _place(tensors: Iterable[Tensor], buffer: int) -> None:
    offset = 0
    for t in tensors:
        if t.view_src is None:
            t.buffer, t.offset = buffer, offset
            offset = (offset + t.nbytes + 63) // 64 * 64
        else:
            t.buffer, t.offset = buffer, (t.view_src.offset or 0) + t.view_offs
    assert offset <= RES_SIZE


def graph_matmul_add(buffer: int) -> Graph:
    a, b, c = Tensor((64, 32), name="a", flags=FLAG_INPUT), Tensor((64, 8), name="b"), Tensor((32, 8), name="c")
    mm = Tensor((32, 8), op=OP_MUL_MAT, src=[a, b], name="a*b")
    out = Tensor((32, 8), op=OP_ADD, src=[mm, c], name="out", flags=FLAG_OUTPUT)
    _place([a, b, c, mm, out], buffer)
    return Graph([mm, out])


def graph_norm_ffn(buffer: int) -> Graph:
    """rms_norm, scale by a weight, gate and up projections, swiglu, down projection."""
    x, w = Tensor((64, 4), name="x"), Tensor((64,), name="norm.weight")
    gate_w, up_w, down_w = Tensor((64, 128), name="ffn_gate"), Tensor((64, 128), name="ffn_up"), \
        Tensor((128, 64), name="ffn_down")
    norm = Tensor((64, 4), op=OP_RMS_NORM, src=[x], op_params=[_f32_bits(1e-5)], name="norm")
    scaled = Tensor((64, 4), op=OP_MUL, src=[norm, w], name="attn_norm")
    gate = Tensor((128, 4), op=OP_MUL_MAT, src=[gate_w, scaled], name="gate")
    up = Tensor((128, 4), op=OP_MUL_MAT, src=[up_w, scaled], name="up")
    act = Tensor((128, 4), op=OP_GLU, src=[gate, up], op_params=[GLU_SWIGLU, 0], name="swiglu")
    down = Tensor((64, 4), op=OP_MUL_MAT, src=[down_w, act], name="down", flags=FLAG_OUTPUT)
    _place([x, w, gate_w, up_w, down_w, norm, scaled, gate, up, act, down], buffer)
    return Graph([norm, scaled, gate, up, act, down])


def graph_attention(buffer: int) -> Graph:
    """scores = k·q, scaled softmax, times v; with a permuted view and a copy."""
    q, k, v = Tensor((32, 8, 2), name="q"), Tensor((32, 16, 2), name="k"), Tensor((16, 32, 2), name="v")
    kq = Tensor((16, 8, 2), op=OP_MUL_MAT, src=[k, q], name="kq")
    sm = Tensor((16, 8, 2), op=OP_SOFT_MAX, src=[kq], op_params=[_f32_bits(0.125), _f32_bits(0.0)], name="soft_max")
    kqv = Tensor((32, 8, 2), op=OP_MUL_MAT, src=[v, sm], name="kqv")
    perm = Tensor((32, 2, 8), op=OP_PERMUTE, src=[kqv], view_src=kqv, op_params=[0, 2, 1, 3], name="kqv_merged",
                  strides=(4, 32 * 8 * 4, 32 * 4, 32 * 8 * 2 * 4))
    cont = Tensor((32, 2, 8), op=OP_CONT, src=[perm], name="kqv_cont", flags=FLAG_OUTPUT)
    _place([q, k, v, kq, sm, kqv, perm, cont], buffer)
    return Graph([kq, sm, kqv, perm, cont])


def graph_rows_silu(buffer: int) -> Graph:
    """get_rows of token embeddings, silu, scale, a reshape view and a copy into another tensor."""
    emb = Tensor((64, 100), name="token_embd")
    ids = Tensor((4,), type=TYPE_I32, name="inp_tokens", flags=FLAG_INPUT)
    rows = Tensor((64, 4), op=OP_GET_ROWS, src=[emb, ids], name="inp_embd")
    act = Tensor((64, 4), op=OP_UNARY, src=[rows], op_params=[UNARY_SILU], name="silu")
    scaled = Tensor((64, 4), op=OP_SCALE, src=[act], op_params=[_f32_bits(0.5), _f32_bits(0.0)], name="scaled")
    flat = Tensor((256,), op=OP_RESHAPE, src=[scaled], view_src=scaled, name="flat")
    dst = Tensor((256,), name="dst")
    cpy = Tensor((256,), op=OP_CPY, src=[flat, dst], view_src=dst, name="cpy", flags=FLAG_OUTPUT)
    _place([emb, ids, rows, act, scaled, flat, dst, cpy], buffer)
    return Graph([rows, act, scaled, flat, cpy])


def graph_transpose(buffer: int) -> Graph:
    a = Tensor((16, 8), name="a")
    t = Tensor((8, 16), op=OP_TRANSPOSE, src=[a], view_src=a, strides=(16 * 4, 4, 16 * 8 * 4, 16 * 8 * 4), name="aT")
    c = Tensor((8, 16), op=OP_CONT, src=[t], name="aT_cont")
    view = Tensor((8, 8), op=OP_VIEW, src=[c], view_src=c, view_offs=0, strides=(4, 8 * 4), name="half")
    out = Tensor((8, 8), op=OP_ADD, src=[view, view], name="twice", flags=FLAG_OUTPUT)
    _place([a, t, c, view, out], buffer)
    return Graph([t, c, view, out])


GRAPHS: list[Callable[[int], Graph]] = [graph_matmul_add, graph_norm_ffn, graph_attention, graph_rows_silu,
                                        graph_transpose]


def graph_call(graph: Graph, wide: bool = False) -> Call:
    data = graph.serialize(wide)
    n_nodes = U32.unpack_from(data, 0)[0]
    first = 4 + 8 * n_nodes + 4
    size = rpc_tensor_size(wide)
    n_tensors = (len(data) - first) // size
    request = U32.pack(RES_GRAPH) + U64.pack(len(data))
    return Call(GRAPH_COMPUTE, request, res=RES_GRAPH, res_bytes=data,
                res_handle_offsets=[first + i * size + RPC_BUFFER_AT for i in range(n_tensors)], wide=wide)


# --- from the trace -------------------------------------------------------------------------------

def calls_from_trace(records: Iterable[trace.Record]) -> list[Call]:
    calls: list[Call] = []
    last_buffer = 0
    computes = 0
    for r in records:
        if r.cmd_type != protocol.CommandType.FORWARD or not 0 <= r.cmd_flags < N_FUNCTIONS:
            continue
        fn, wide = r.cmd_flags, r.wide_tensors
        if fn == GRAPH_COMPUTE:
            if last_buffer:  # the trace's graph is in shared memory: one of ours in the last buffer instead
                calls.append(graph_call(GRAPHS[computes % len(GRAPHS)](last_buffer), wide))
                computes += 1
            continue
        request = bytearray(r.request[protocol.COMMAND_HEADER_SIZE:])
        adapt(fn, request, wide)
        call = Call(fn, bytes(request), handle_offsets=handle_offsets(fn, bytes(request), wide), wide=wide)
        if r.ok:
            call.produces = produced(fn, r.reply)
            if fn in (BUFFER_FROM_PTR, ALLOC_BUFFER) and call.produces and call.produces[0]:
                last_buffer = call.produces[0]
        calls.append(call)
    return calls


def features_call(wide: bool) -> Call:
    """EXT_GET_FEATURES asking for the records of that width (and EXT_GRAPH_RUN)."""
    wanted = extensions.FEATURES if wide else extensions.FEATURE_GRAPH_RUN
    return Call(EXT_GET_FEATURES, extensions.encode_features_request(wanted))


def negotiated(calls: list[Call]) -> list[Call]:
    """The calls with an EXT_GET_FEATURES before each change of width (every input starts narrow)."""
    out: list[Call] = []
    wide = False
    for call in calls:
        if call.fn == EXT_GET_FEATURES:  # one of the input's own: the width it asks for
            wanted = extensions.decode_features_request(call.request) if len(call.request) >= 8 else None
            wide = bool((wanted or 0) & extensions.FEATURE_WIDE_TENSORS)
        elif call.wide != wide:
            out.append(features_call(call.wide))
            wide = call.wide
        out.append(call)
    return out


def encode_input(calls: list[Call]) -> bytes:
    """The harness's input: handles replaced by placeholders numbered as the harness will keep them."""
    table: list[int] = []
    out = bytearray()
    for call in negotiated(calls)[:MAX_CALLS]:
        def ref(value: int) -> int | None:
            for i in range(len(table) - 1, -1, -1):
                if table[i] == value:
                    return PLACEHOLDER | (i & 0xFF)
            return None

        request, res = bytearray(call.request), bytearray(call.res_bytes)
        for data, offsets in ((request, call.handle_offsets), (res, call.res_handle_offsets)):
            for at in offsets:
                value = _u64(data, at)
                placeholder = ref(value) if value else None
                if placeholder is not None:
                    _put64(data, at, placeholder)
        out += CALL.pack(call.fn, call.res, len(request), 0, len(res)) + request + res
        table.extend(call.produces)
    return bytes(out)


def with_producers(calls: list[Call], chosen: list[int]) -> list[Call]:
    """The chosen calls (indexes) with the calls that made the handles they use, in trace order."""
    keep = set(chosen)
    for i in sorted(chosen, reverse=True):
        pending = set(calls[i].uses())
        j = i - 1
        while pending and j >= 0:
            made = set(calls[j].produces) & pending
            if made:
                keep.add(j)
                pending -= made
                pending |= set(calls[j].uses())
            j -= 1
    return [calls[i] for i in sorted(keep)]


def buffer_life(buft_call: Call | None, wide: bool = False) -> list[Call]:
    """A buffer allocated, asked its base, cleared, written, read, copied within, freed. With `wide`,
    its tensors are wide records, one of them 2^33 rows of stride 0 (which a narrow record cannot say)."""
    buft = buft_call.produces[0] if buft_call and buft_call.produces else 0x1000
    buffer = 0xB0FFE4
    out = [buft_call] if buft_call else []
    size = 4096
    out.append(Call(ALLOC_BUFFER, U64.pack(buft) + U64.pack(size), [0], produces=[buffer]))
    out.append(Call(GET_BASE, U64.pack(buffer), [0], produces=[0xBA5E]))
    out.append(Call(CLEAR, U64.pack(buffer) + U32.pack(0x5A), [0]))
    shape, strides = ((64, 1 << 33), (4, 0)) if wide else ((64,), None)
    t = Tensor(shape, name="t", buffer=buffer, offset=256, strides=strides).to_rpc().to_bytes(wide)
    u = Tensor((64,), name="u", buffer=buffer, offset=1024).to_rpc().to_bytes(wide)
    payload = bytes(range(256))
    tail = U32.pack(RES_DATA) + U64.pack(0) + U64.pack(len(payload))
    tensor_offsets = [0, 8 + RPC_BUFFER_AT]
    out.append(Call(SET_TENSOR, U64.pack(buffer) + t + tail, tensor_offsets, res=RES_DATA, res_bytes=payload,
                    wide=wide))
    out.append(Call(GET_TENSOR, U64.pack(buffer) + t + tail, tensor_offsets, wide=wide))
    out.append(Call(CPY_TENSOR, U64.pack(buffer) + u + t,
                    [*tensor_offsets, 8 + rpc_tensor_size(wide) + RPC_BUFFER_AT], wide=wide))
    out.append(Call(FREE_BUFFER, U64.pack(buffer), [0]))
    return out


def graph_run_life(buft_call: Call | None, wide: bool = False) -> list[Call]:
    """EXT_GRAPH_RUN: a graph sent with a write and an output, the same graph named by its id with
    another write, a flush of writes alone, then the buffer freed and the id named again."""
    buft = buft_call.produces[0] if buft_call and buft_call.produces else 0x1000
    buffer = 0xB0FFE5
    out = [buft_call] if buft_call else []
    out.append(features_call(wide) if wide else Call(EXT_GET_FEATURES, b""))
    out.append(Call(ALLOC_BUFFER, U64.pack(buft) + U64.pack(RES_SIZE), [0], produces=[buffer], wide=wide))
    graph = graph_matmul_add(buffer)
    data = graph.serialize(wide)
    n_nodes = U32.unpack_from(data, 0)[0]
    first = 4 + 8 * n_nodes + 4
    record = rpc_tensor_size(wide)
    n_tensors = (len(data) - first) // record
    leaf = graph.nodes[0].src[0]
    assert leaf is not None
    write = U64.pack(buffer) + leaf.to_rpc().to_bytes(wide) + U64.pack(0) + U64.pack(64) + U64.pack(len(data))
    write_offsets = [4 + 8 + 4 + 8 + 4, 4 + 8 + 4 + 8 + 4 + 8 + RPC_BUFFER_AT]
    # a wide session asks for every feature: its outputs name their resource (FEATURE_OUTPUT_RESOURCES)
    outputs = U32.pack(RES_DATA) + U32.pack(1) + U32.pack(1) + (U32.pack(RES_DATA) if wide else b"") + U64.pack(0)
    res = data + bytes(range(64))
    graph_offsets = [first + i * record + RPC_BUFFER_AT for i in range(n_tensors)]

    def run(graph_id: int, size: int, writes: int) -> bytes:
        return U64.pack(graph_id) + U32.pack(RES_GRAPH) + U64.pack(size) + U32.pack(writes) + \
            (write if writes else b"") + outputs

    out.append(Call(EXT_GRAPH_RUN, run(1, len(data), 1), write_offsets, res=RES_GRAPH, res_bytes=res,
                    res_handle_offsets=graph_offsets, wide=wide))
    out.append(Call(EXT_GRAPH_RUN, run(1, 0, 1), write_offsets, wide=wide))
    out.append(Call(EXT_GRAPH_RUN, U64.pack(0) + U32.pack(RES_GRAPH) + U64.pack(0) + U32.pack(1) + write +
                    U32.pack(RES_DATA) + U32.pack(0), write_offsets, wide=wide))
    out.append(Call(FREE_BUFFER, U64.pack(buffer), [0], wide=wide))
    out.append(Call(EXT_GRAPH_RUN, run(1, 0, 0), [], wide=wide))
    return out


def graph_delta_life(buft_call: Call | None) -> list[Call]:
    """EXT_GRAPH_DELTA (wide records, as the feature is asked with them): a graph kept under an id, then
    updated by a delta of a smaller batch, by one the host refuses (another op), named after the refusal,
    and updated after its buffer was freed."""
    buft = buft_call.produces[0] if buft_call and buft_call.produces else 0x1000
    buffer = 0xB0FFE6
    out = [buft_call] if buft_call else []
    out.append(Call(ALLOC_BUFFER, U64.pack(buft) + U64.pack(RES_SIZE), [0], produces=[buffer], wide=True))
    graph = graph_matmul_add(buffer)
    data = graph.serialize(True)
    first = 4 + 8 * len(graph.nodes) + 4
    tensors = graph.tensors()
    graph_offsets = [first + i * rpc_tensor_size(True) + RPC_BUFFER_AT for i in range(len(tensors))]
    out.append(Call(EXT_GRAPH_RUN, extensions.GraphRun(1, RES_GRAPH, len(data)).encode(), res=RES_GRAPH,
                    res_bytes=data, res_handle_offsets=graph_offsets, wide=True))

    def delta(changes: list[extensions.Change]) -> Call:
        return Call(EXT_GRAPH_DELTA, extensions.GraphRun(1, RES_GRAPH, n_changes=len(changes)).encode(),
                    res=RES_GRAPH, res_bytes=extensions.encode_changes(changes),
                    res_handle_offsets=[i * extensions.CHANGE_SIZE + CHANGE_BUFFER_AT for i in range(len(changes))],
                    wide=True)

    b, c, mm, result = tensors[1], tensors[3], tensors[2], tensors[4]
    for t in (b, c, mm, result):
        t.shape = (t.shape[0], 4)
    out.append(delta([extensions.Change(tensors.index(t), t.to_rpc()) for t in (b, mm, c, result)]))
    result.op = OP_MUL
    out.append(delta([extensions.Change(tensors.index(result), result.to_rpc())]))
    out.append(Call(EXT_GRAPH_RUN, extensions.GraphRun(1, RES_GRAPH).encode(), wide=True))
    out.append(Call(FREE_BUFFER, U64.pack(buffer), [0], wide=True))
    out.append(delta([extensions.Change(tensors.index(b), b.to_rpc())]))
    return out


def tensors_get_life(buft_call: Call | None) -> list[Call]:
    """EXT_TENSORS_GET (wide records): a buffer written, two reads of it in one call, a batch whose second
    read runs past its tensor (refused, nothing copied), and a read after the buffer was freed."""
    buft = buft_call.produces[0] if buft_call and buft_call.produces else 0x1000
    buffer = 0xB0FFE7
    out = [buft_call] if buft_call else []
    out.append(features_call(True))
    out.append(Call(ALLOC_BUFFER, U64.pack(buft) + U64.pack(4096), [0], produces=[buffer], wide=True))
    t = Tensor((64,), name="k", buffer=buffer, offset=256).to_rpc().to_bytes(True)
    u = Tensor((64,), name="v", buffer=buffer, offset=1024).to_rpc().to_bytes(True)
    payload = bytes(range(256))
    out.append(Call(SET_TENSOR, U64.pack(buffer) + t + U32.pack(RES_DATA) + U64.pack(0) + U64.pack(len(payload)),
                    [0, 8 + RPC_BUFFER_AT], res=RES_DATA, res_bytes=payload, wide=True))

    def reads(*records: tuple[bytes, int, int]) -> Call:
        data = b"".join(U64.pack(buffer) + rec + U64.pack(off) + U64.pack(size) + U64.pack(4096 + 256 * i)
                        for i, (rec, off, size) in enumerate(records))
        offsets = [i * extensions.WRITE_SIZE_WIDE + at for i in range(len(records)) for at in (0, 8 + RPC_BUFFER_AT)]
        return Call(EXT_TENSORS_GET, extensions.TensorsGet(RES_GRAPH, len(records)).encode(), res=RES_GRAPH,
                    res_bytes=data, res_handle_offsets=offsets, wide=True)

    out.append(reads((t, 0, 256), (u, 64, 128)))
    out.append(reads((t, 0, 256), (u, 128, 256)))
    out.append(Call(FREE_BUFFER, U64.pack(buffer), [0], wide=True))
    out.append(reads((t, 0, 64)))
    return out


def seeds(calls: list[Call], per_function: int = 6, max_chunks: int = 4) -> dict[str, bytes]:
    """Named seed inputs from the trace's calls."""
    out: dict[str, bytes] = {"session-start": encode_input(calls[:48])}
    by_fn: dict[int, list[int]] = {}
    seen: set[bytes] = set()
    for i, call in enumerate(calls):
        key = encode_input([call])
        if call.fn != GRAPH_COMPUTE and key not in seen:
            seen.add(key)
            by_fn.setdefault(call.fn, []).append(i)
    for fn, indexes in sorted(by_fn.items()):
        chunks = [indexes[k:k + per_function] for k in range(0, len(indexes), per_function)][:max_chunks]
        for n, chunk in enumerate(chunks):
            out[f"fn{fn:02d}-{n}"] = encode_input(with_producers(calls, chunk))
    computes = [i for i, c in enumerate(calls) if c.fn == GRAPH_COMPUTE]
    for n, i in enumerate(computes[:len(GRAPHS)]):
        out[f"graph-{GRAPHS[n].__name__.removeprefix('graph_')}"] = encode_input(with_producers(calls, [i]))
    buft = next((c for c in calls if c.fn == GET_BUFFER_TYPE and c.produces), None)
    out["buffer-life"] = encode_input(buffer_life(buft))
    out["graph-run-life"] = encode_input(graph_run_life(buft))
    # the wide records, negotiated: their decoding, and graphs and writes in them
    out["wide-buffer-life"] = encode_input(buffer_life(buft, wide=True))
    out["wide-graph-run-life"] = encode_input(graph_run_life(buft, wide=True))
    out["wide-graph-delta-life"] = encode_input(graph_delta_life(buft))
    out["wide-tensors-get-life"] = encode_input(tensors_get_life(buft))
    last_buffer = next((c.produces[0] for c in reversed(calls) if c.fn in (BUFFER_FROM_PTR, ALLOC_BUFFER)
                        and c.produces and c.produces[0]), 0)
    if last_buffer:
        chain = with_producers(calls, [i for i, c in enumerate(calls) if c.produces and c.produces[0] == last_buffer])
        out["wide-graph"] = encode_input([*chain, graph_call(GRAPHS[0](last_buffer), wide=True)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    calls = calls_from_trace(trace.read(args.trace.read_bytes()))
    args.out.mkdir(parents=True, exist_ok=True)
    found = seeds(calls)
    for name, data in found.items():
        digest = hashlib.sha1(data).hexdigest()[:10]  # noqa: S324 - a file name, not security
        (args.out / f"{name}-{digest}").write_bytes(data)
    print(f"{len(calls)} forwarded calls -> {len(found)} seeds in {args.out}")


if __name__ == "__main__":
    main()
