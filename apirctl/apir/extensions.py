"""apirctl's commands beyond upstream's dispatch table (llama_patches, `apir_backend_ext.h`).

They are numbered from 256, outside the generated table, so that `table` and the headers it
generates stay upstream's. An upstream library answers them with FORWARD_INDEX_INVALID, and the
frontend then keeps to the upstream calls.

EXT_GET_FEATURES negotiates: the request carries the features the frontend would use (u64; a
frontend from before sends nothing and is granted FEATURE_GRAPH_RUN), the reply those the host
grants. A host from before the request carried them ignores it and answers every feature it has,
so the frontend keeps only those it asked for. FEATURE_WIDE_TENSORS, once granted, makes every
tensor record of the client `apir_rpc_tensor_wide` (`tensor.RpcTensorWideC`) and every write record
`WRITE_SIZE_WIDE` bytes; it is granted only to a frontend that asks, so upstream's frontend and an
older one keep the narrow records. FEATURE_OP_CLASSES (llama_patches 0020) changes nothing the host
reads: the host vouches that its backend's supports_op and get_alloc_size answers follow rules the
frontend caches by op class, not by batch size; a library grants it only for the CPU and CUDA backends.
FEATURE_GRAPH_DELTA (llama_patches 0021) offers EXT_GRAPH_DELTA: a graph the host keeps is updated by the
shapes, strides, view and data offsets of the tensors that moved (`Change`), named by their index in
the serialization it was sent as, instead of being sent whole; the host checks them as a new graph's
and answers RESULT_DELTA_REFUSED (the graph dropped, the frontend sends it whole) for one it does not take.

EXT_GRAPH_RUN is a generated token's whole exchange in one call: the writes of its inputs, the
graph (sent once, then named by the client's id), and its outputs copied into shared memory.

FEATURE_TENSORS_GET (llama_patches 0028) offers EXT_TENSORS_GET: the reads a frontend's backend was asked
for before its synchronize (a state save's K and V, a layer each), in one call. Each read is a `Write`
record the other way: `size` bytes of the tensor at `offset`, copied to `data_offset` of the request's
resource, whose offset 0 holds the records. The host checks them all, from a copy, before it makes any.

FEATURE_OUTPUT_RESOURCES (llama_patches 0029), granted only with FEATURE_GRAPH_RUN, makes each output of
EXT_GRAPH_RUN and EXT_GRAPH_DELTA name its resource (`Output.res_id`): the frontend's compute waits for the
caller's reads of its outputs, and an output read into the frontend's host buffer (a shared resource) is
written there by the host instead of being copied there by the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apirctl.apir.tensor import RPC_TENSOR_SIZE, RPC_TENSOR_WIDE_SIZE, RpcTensor, encode_rpc_tensor
from apirctl.apir.wire import Decoder, Encoder

GET_FEATURES = 256
GRAPH_RUN = 257
GRAPH_DELTA = 258
TENSORS_GET = 259
NAMES = {GET_FEATURES: "ext_get_features", GRAPH_RUN: "ext_graph_run", GRAPH_DELTA: "ext_graph_delta",
         TENSORS_GET: "ext_tensors_get"}

FEATURE_GRAPH_RUN = 1 << 0
FEATURE_WIDE_TENSORS = 1 << 1
FEATURE_OP_CLASSES = 1 << 2
FEATURE_GRAPH_DELTA = 1 << 3  # granted only with FEATURE_GRAPH_RUN
FEATURE_TENSORS_GET = 1 << 4
FEATURE_OUTPUT_RESOURCES = 1 << 5  # granted only with FEATURE_GRAPH_RUN
#: what this library's host grants when asked
FEATURES = (FEATURE_GRAPH_RUN | FEATURE_WIDE_TENSORS | FEATURE_OP_CLASSES | FEATURE_GRAPH_DELTA | FEATURE_TENSORS_GET
            | FEATURE_OUTPUT_RESOURCES)

RESULT_DONE = 0
RESULT_UNKNOWN_GRAPH = 1
RESULT_DELTA_REFUSED = 2

MAX_WRITES = 256
MAX_OUTPUTS = 16
MAX_READS = 256


#: struct apir_graph_run_write: u64 buffer, apir_rpc_tensor, u64 offset, u64 size, u64 data_offset
WRITE_SIZE = 8 + RPC_TENSOR_SIZE + 24
#: struct apir_graph_run_write_wide: the same with apir_rpc_tensor_wide
WRITE_SIZE_WIDE = 8 + RPC_TENSOR_WIDE_SIZE + 24


@dataclass(frozen=True)
class Write:
    """`size` bytes into a tensor at `offset`, taken from `data_offset` of the request's resource."""

    buffer: int
    tensor: RpcTensor
    offset: int
    size: int
    data_offset: int


def encode_writes(writes: tuple[Write, ...] | list[Write], wide: bool = False) -> bytes:
    """The writes' records as the host reads them from shared memory (`wide`: once granted)."""
    enc = Encoder()
    for w in writes:
        enc.u64(w.buffer)
        encode_rpc_tensor(enc, w.tensor, wide)
        enc.u64(w.offset)
        enc.u64(w.size)
        enc.u64(w.data_offset)
    return enc.getvalue()


#: struct apir_graph_change: u32 index, u32 op, u64 id, u64 view_src (as kept: checked), u64 buffer,
#: i64 ne[4], u64 nb[4], u64 view_offs, u64 data (what a delta may change)
CHANGE_SIZE = 112


@dataclass(frozen=True)
class Change:
    """A kept graph's tensor number `index` (in its serialization's order) now has `tensor`'s buffer,
    shape, strides, view offset and data offset; its id, op and view source are stated as kept."""

    index: int
    tensor: RpcTensor

    def encode(self, enc: Encoder) -> None:
        t = self.tensor
        enc.u32(self.index)
        enc.u32(t.op)
        enc.u64(t.id)
        enc.u64(t.view_src)
        enc.u64(t.buffer)
        for n in t.ne:
            enc.u64(n % (1 << 64))  # int64_t
        for b in t.nb:
            enc.u64(b)
        enc.u64(t.view_offs)
        enc.u64(t.data)


def encode_changes(changes: tuple[Change, ...] | list[Change]) -> bytes:
    """EXT_GRAPH_DELTA's records as the host reads them from offset 0 of the request's resource."""
    enc = Encoder()
    for c in changes:
        c.encode(enc)
    return enc.getvalue()


@dataclass(frozen=True)
class Output:
    """Graph node `node` copied to `offset` of the output resource after the compute, or of `res_id`
    (FEATURE_OUTPUT_RESOURCES granted: every output names its resource)."""

    node: int
    offset: int
    res_id: int | None = None


@dataclass(frozen=True)
class GraphRun:
    """An EXT_GRAPH_RUN request. `graph_size` 0 names a graph the host keeps; else the graph's
    serialization is at offset 0 of `res_id` and is kept under `graph_id`. The `n_writes` records
    of the writes are at `writes_offset` of `res_id` (`encode_writes`), not in the command.
    `n_changes` set: an EXT_GRAPH_DELTA, whose changes (`encode_changes`) are at offset 0 of `res_id`
    and update the graph kept under `graph_id`."""

    graph_id: int
    res_id: int
    graph_size: int = 0
    writes_offset: int = 0
    n_writes: int = 0
    out_res_id: int = 0
    outputs: tuple[Output, ...] = field(default=())
    n_changes: int | None = None
    #: FEATURE_OUTPUT_RESOURCES granted: each output is (node, res_id, offset)
    output_resources: bool = False

    @property
    def command(self) -> int:
        return GRAPH_RUN if self.n_changes is None else GRAPH_DELTA

    @property
    def graph_bytes(self) -> int:
        """Bytes of graph the host reads: the serialization, or the changes."""
        return self.graph_size + (self.n_changes or 0) * CHANGE_SIZE

    def encode(self) -> bytes:
        enc = Encoder()
        enc.u64(self.graph_id)
        enc.u32(self.res_id)
        enc.u64(self.graph_size)
        if self.n_changes is not None:
            enc.u32(self.n_changes)
        enc.u64(self.writes_offset)
        enc.u32(self.n_writes)
        enc.u32(self.out_res_id)
        enc.u32(len(self.outputs))
        for o in self.outputs:
            enc.u32(o.node)
            if self.output_resources:
                enc.u32(self.out_res_id if o.res_id is None else o.res_id)
            enc.u64(o.offset)
        return enc.getvalue()

    @classmethod
    def decode(cls, data: bytes | memoryview, delta: bool = False, output_resources: bool = False) -> GraphRun:
        """Raises `ApirDecodeError` on a cut request, ValueError on counts past the host's limits
        (`delta`: an EXT_GRAPH_DELTA's; `output_resources`: a client granted FEATURE_OUTPUT_RESOURCES)."""
        dec = Decoder(data)
        graph_id, res_id, graph_size = dec.u64(), dec.u32(), dec.u64()
        n_changes = dec.u32() if delta else None
        writes_offset, n_writes = dec.u64(), dec.u32()
        if n_writes > MAX_WRITES:
            raise ValueError(f"{n_writes} writes, more than the host takes ({MAX_WRITES})")
        out_res_id, n_outputs = dec.u32(), dec.u32()
        if n_outputs > MAX_OUTPUTS:
            raise ValueError(f"{n_outputs} outputs, more than the host takes ({MAX_OUTPUTS})")
        outputs = []
        for _ in range(n_outputs):
            node = dec.u32()
            res = dec.u32() if output_resources else None
            outputs.append(Output(node, dec.u64(), res))
        return cls(graph_id, res_id, graph_size, writes_offset, n_writes, out_res_id, tuple(outputs), n_changes,
                   output_resources)


@dataclass(frozen=True)
class TensorsGet:
    """An EXT_TENSORS_GET request: `n_reads` `Write` records (read the other way) at offset 0 of `res_id`."""

    res_id: int
    n_reads: int

    def encode(self) -> bytes:
        enc = Encoder()
        enc.u32(self.res_id)
        enc.u32(self.n_reads)
        return enc.getvalue()

    @classmethod
    def decode(cls, data: bytes | memoryview) -> TensorsGet:
        """Raises `ApirDecodeError` on a cut request, ValueError on a count the host refuses."""
        dec = Decoder(data)
        res_id, n_reads = dec.u32(), dec.u32()
        if not 0 < n_reads <= MAX_READS:
            raise ValueError(f"{n_reads} reads: the host takes 1 to {MAX_READS}")
        return cls(res_id, n_reads)


def decode_graph_run_reply(data: bytes | memoryview) -> tuple[int, int]:
    """(result, ggml status) of an EXT_GRAPH_RUN reply."""
    dec = Decoder(data)
    return dec.u32(), dec.i32()


def encode_features_request(wanted: int) -> bytes:
    """EXT_GET_FEATURES's request: the features the frontend would use."""
    enc = Encoder()
    enc.u64(wanted)
    return enc.getvalue()


def decode_features_request(data: bytes | memoryview) -> int | None:
    """The features asked for; None for a request of a frontend from before them (no bytes)."""
    if len(data) == 0:
        return None
    return Decoder(data).u64()


def decode_features(data: bytes | memoryview) -> int:
    return Decoder(data).u64()


def granted(wanted: int, answered: int) -> int:
    """What the frontend uses of the host's answer: a host from before the request carried the wanted
    features ignores it and answers all it has."""
    return wanted & answered
