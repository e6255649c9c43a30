"""Tensors and graphs as APIR carries them.

Two C structs travel as raw memory images: `apir_rpc_tensor` (set/get/cpy tensor and graphs; ids
instead of pointers, shapes and strides narrowed to uint32, data as an offset from its buffer's base)
and, for supports_op/get_alloc_size, the frontend's own `struct ggml_tensor` followed by what its
pointers point to. Once the host granted `extensions.FEATURE_WIDE_TENSORS`, `apir_rpc_tensor_wide`
(ggml's int64 shapes and uint64 strides) takes `apir_rpc_tensor`'s place everywhere; the `wide`
arguments below choose it. All are described here with ctypes, whose layout rules are the C
compiler's; tests/apir checks every offset against g++ on the patched headers.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field

from apirctl.apir.wire import ApirDecodeError, Decoder, Encoder

MAX_DIMS = 4
MAX_SRC = 10
MAX_OP_PARAMS = 64  # bytes
MAX_NAME = 64

# The few ggml enum values the selftest needs (checked against ggml.h in tests/apir).
TYPE_F32 = 0
OP_NONE = 0
OP_ADD = 2
OP_MUL = 7
OP_MUL_MAT = 29
FLAG_INPUT = 1
FLAG_OUTPUT = 2
FLAG_COMPUTE = 16  # set by ggml's graph builder on every node; backends skip nodes without it


#: The fields both tensor records have after their shape and strides, in the same order.
_RECORD_TAIL: list[tuple[str, type]] = [
    ("op", ctypes.c_uint32),
    ("op_params", ctypes.c_int32 * (MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.c_uint64 * MAX_SRC),
    ("view_src", ctypes.c_uint64),
    ("view_offs", ctypes.c_uint64),
    ("data", ctypes.c_uint64),
    ("name", ctypes.c_char * MAX_NAME),
]


class RpcTensorC(ctypes.Structure):
    """`struct apir_rpc_tensor`, 304 bytes on 64-bit hosts."""

    _fields_ = [
        ("id", ctypes.c_uint64),
        ("type", ctypes.c_uint32),
        ("buffer", ctypes.c_uint64),
        ("ne", ctypes.c_uint32 * MAX_DIMS),
        ("nb", ctypes.c_uint32 * MAX_DIMS),
        *_RECORD_TAIL,
        ("padding", ctypes.c_char * 4),
    ]


class RpcTensorWideC(ctypes.Structure):
    """`struct apir_rpc_tensor_wide`, 328 bytes: the same fields, 64-bit shapes and strides, no implicit padding."""

    _fields_ = [
        ("id", ctypes.c_uint64),
        ("type", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("buffer", ctypes.c_uint64),
        ("ne", ctypes.c_int64 * MAX_DIMS),
        ("nb", ctypes.c_uint64 * MAX_DIMS),
        *_RECORD_TAIL,
    ]


class GgmlTensorC(ctypes.Structure):
    """`struct ggml_tensor` of the pinned ggml (pointers as 64-bit integers), 336 bytes."""

    _fields_ = [
        ("type", ctypes.c_int32),
        ("buffer", ctypes.c_uint64),
        ("ne", ctypes.c_int64 * MAX_DIMS),
        ("nb", ctypes.c_uint64 * MAX_DIMS),
        ("op", ctypes.c_int32),
        ("op_params", ctypes.c_int32 * (MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_uint64 * MAX_SRC),
        ("view_src", ctypes.c_uint64),
        ("view_offs", ctypes.c_uint64),
        ("data", ctypes.c_uint64),
        ("name", ctypes.c_char * MAX_NAME),
        ("extra", ctypes.c_uint64),
        ("padding", ctypes.c_char * 8),
    ]


RPC_TENSOR_SIZE = ctypes.sizeof(RpcTensorC)
RPC_TENSOR_WIDE_SIZE = ctypes.sizeof(RpcTensorWideC)
#: the largest shape or stride a narrow record holds
NARROW_MAX = (1 << 32) - 1


def rpc_tensor_size(wide: bool) -> int:
    """Bytes of one tensor record in the width the connection agreed on."""
    return RPC_TENSOR_WIDE_SIZE if wide else RPC_TENSOR_SIZE


GGML_TENSOR_SIZE = ctypes.sizeof(GgmlTensorC)


def layout(struct_type: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """Field name -> (offset, size): what the conformance test compares with `offsetof`."""
    return {name: (getattr(struct_type, name).offset, getattr(struct_type, name).size)
            for name, *_ in struct_type._fields_}


def _fixed(values: list[int] | tuple[int, ...], n: int, fill: int = 0) -> list[int]:
    if len(values) > n:
        raise ValueError(f"at most {n} values, got {len(values)}")
    return list(values) + [fill] * (n - len(values))


@dataclass
class RpcTensor:
    """One `apir_rpc_tensor`, with references to other tensors by id (0 = none)."""

    id: int
    type: int = TYPE_F32
    buffer: int = 0
    ne: list[int] = field(default_factory=lambda: [1] * MAX_DIMS)
    nb: list[int] = field(default_factory=lambda: [0] * MAX_DIMS)
    op: int = OP_NONE
    op_params: list[int] = field(default_factory=lambda: [0] * (MAX_OP_PARAMS // 4))
    flags: int = 0
    src: list[int] = field(default_factory=lambda: [0] * MAX_SRC)
    view_src: int = 0
    view_offs: int = 0
    data: int = 0
    name: bytes = b""

    def fits_narrow(self) -> bool:
        """Whether `apir_rpc_tensor` holds the shape and strides (else only the wide record does)."""
        return all(0 <= v <= NARROW_MAX for v in [*self.ne, *self.nb])

    def to_c(self, wide: bool = False) -> RpcTensorC | RpcTensorWideC:
        """The record; a narrow one raises ValueError on a shape or stride it cannot hold (the C
        frontend never sends one: it leaves such ops to another device)."""
        if not wide and not self.fits_narrow():
            raise ValueError(f"tensor {self.id:#x}: ne {self.ne} / nb {self.nb} need the wide record")
        c: RpcTensorC | RpcTensorWideC = RpcTensorWideC() if wide else RpcTensorC()
        c.id, c.type, c.buffer = self.id, self.type, self.buffer
        c.ne[:] = _fixed(self.ne, MAX_DIMS, 1)
        c.nb[:] = _fixed(self.nb, MAX_DIMS)
        c.op = self.op
        c.op_params[:] = _fixed(self.op_params, MAX_OP_PARAMS // 4)
        c.flags = self.flags
        c.src[:] = _fixed(self.src, MAX_SRC)
        c.view_src, c.view_offs, c.data = self.view_src, self.view_offs, self.data
        if len(self.name) >= MAX_NAME:
            raise ValueError(f"tensor name longer than {MAX_NAME - 1} bytes")
        c.name = self.name
        return c

    def to_bytes(self, wide: bool = False) -> bytes:
        return bytes(self.to_c(wide))

    @classmethod
    def from_c(cls, c: RpcTensorC | RpcTensorWideC) -> RpcTensor:
        return cls(id=c.id, type=c.type, buffer=c.buffer, ne=list(c.ne), nb=list(c.nb), op=c.op,
                   op_params=list(c.op_params), flags=c.flags, src=list(c.src), view_src=c.view_src,
                   view_offs=c.view_offs, data=c.data, name=c.name)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, wide: bool = False) -> RpcTensor:
        size = rpc_tensor_size(wide)
        if len(data) != size:
            raise ApirDecodeError(f"{_record_name(wide)} needs {size} bytes, got {len(data)}", 0)
        return cls.from_c(RpcTensorWideC.from_buffer_copy(data) if wide else RpcTensorC.from_buffer_copy(data))


def _record_name(wide: bool) -> str:
    return "apir_rpc_tensor_wide" if wide else "apir_rpc_tensor"


def encode_rpc_tensor(enc: Encoder, t: RpcTensor, wide: bool = False) -> None:
    enc.raw(t.to_bytes(wide))


def decode_rpc_tensor(dec: Decoder, wide: bool = False) -> RpcTensor:
    return RpcTensor.from_bytes(dec.raw(rpc_tensor_size(wide), _record_name(wide)), wide)


_ids = itertools.count(0x1000, 0x10)


@dataclass(eq=False)
class Tensor:
    """A tensor of a graph being built in Python: what the frontend would hold as `ggml_tensor`.

    `buffer` is the host handle of the buffer holding it and `offset` its data offset in that
    buffer; `src` and `view_src` point at other `Tensor`s.
    """

    shape: tuple[int, ...]
    type: int = TYPE_F32
    op: int = OP_NONE
    src: list[Tensor] = field(default_factory=list)
    view_src: Tensor | None = None
    view_offs: int = 0
    op_params: list[int] = field(default_factory=list)
    flags: int = 0
    buffer: int = 0
    offset: int | None = None
    name: str = ""
    element_size: int = 4
    strides: tuple[int, ...] | None = None  # bytes per step in each dimension; default contiguous
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def ne(self) -> list[int]:
        return _fixed(list(self.shape), MAX_DIMS, 1)

    @property
    def nb(self) -> list[int]:
        if self.strides is not None:
            given = list(self.strides)
            while len(given) < MAX_DIMS:
                given.append(given[-1] * self.ne[len(given) - 1])
            return given
        strides = [self.element_size]
        for n in self.ne[:-1]:
            strides.append(strides[-1] * n)
        return strides

    @property
    def nbytes(self) -> int:
        """Bytes from the first element to just past the last (ggml_nbytes for plain types)."""
        return self.element_size + sum((n - 1) * b for n, b in zip(self.ne, self.nb, strict=True))

    def to_rpc(self) -> RpcTensor:
        return RpcTensor(
            id=self.id, type=self.type, buffer=self.buffer, ne=self.ne, nb=self.nb, op=self.op,
            op_params=_fixed(self.op_params, MAX_OP_PARAMS // 4), flags=self.flags,
            src=_fixed([s.id for s in self.src], MAX_SRC),
            view_src=self.view_src.id if self.view_src else 0, view_offs=self.view_offs,
            data=self.offset or 0, name=self.name.encode())

    def to_ggml(self) -> GgmlTensorC:
        """The raw `ggml_tensor` image; ids stand in for the guest's pointers."""
        c = GgmlTensorC()
        c.type, c.buffer = self.type, self.buffer
        c.ne[:] = self.ne
        c.nb[:] = self.nb
        c.op = self.op
        c.op_params[:] = _fixed(self.op_params, MAX_OP_PARAMS // 4)
        c.flags = self.flags
        c.src[:] = _fixed([s.id for s in self.src], MAX_SRC)
        c.view_src = self.view_src.id if self.view_src else 0
        c.view_offs = self.view_offs
        c.data = self.offset or 0
        c.name = self.name.encode()
        return c


def encode_inline_tensor(enc: Encoder, t: Tensor) -> None:
    """The `ggml_tensor` image, then its buffer handle, its view source and each source.

    Upstream's frontend means to send the buffer handle here but writes the address of a local
    variable instead (see docs/apir.md); we send the handle.
    """
    enc.raw(bytes(t.to_ggml()))
    if t.buffer:
        enc.handle(t.buffer)
    if t.view_src is not None:
        enc.raw(bytes(t.view_src.to_ggml()))
    for s in t.src:
        enc.raw(bytes(s.to_ggml()))


@dataclass
class InlineTensor:
    """What a host decodes from an inline tensor: the struct, then what followed it."""

    tensor: GgmlTensorC
    buffer: int = 0
    view_src: GgmlTensorC | None = None
    src: list[GgmlTensorC] = field(default_factory=list)


def decode_inline_tensor(dec: Decoder) -> InlineTensor:
    def one() -> GgmlTensorC:
        return GgmlTensorC.from_buffer_copy(dec.raw(GGML_TENSOR_SIZE, "ggml_tensor"))

    out = InlineTensor(one())
    if out.tensor.buffer:
        out.buffer = dec.handle()
    if out.tensor.view_src:
        out.view_src = one()
    for ptr in out.tensor.src:
        if not ptr:
            break
        out.src.append(one())
    return out


@dataclass
class Graph:
    """A compute graph: its nodes, in order; leaves are reached through their `src`.

    Like ggml's graph builder, it marks every node with FLAG_COMPUTE: current backends skip nodes
    without it and still answer SUCCESS.
    """

    nodes: list[Tensor]

    def __post_init__(self) -> None:
        for n in self.nodes:
            n.flags |= FLAG_COMPUTE

    def tensors(self) -> list[Tensor]:
        """Every tensor reachable, sources before users, each once (upstream's order)."""
        seen: set[int] = set()
        out: list[Tensor] = []

        def visit(t: Tensor | None) -> None:
            if t is None or t.id in seen:
                return
            seen.add(t.id)
            for s in t.src:
                visit(s)
            visit(t.view_src)
            out.append(t)

        for n in self.nodes:
            visit(n)
        return out

    def serialize(self, wide: bool = False) -> bytes:
        """| n_nodes u32 | node ids u64[n_nodes] | n_tensors u32 | apir_rpc_tensor[n_tensors] |
        (`wide`: apir_rpc_tensor_wide records)"""
        enc = Encoder()
        enc.u32(len(self.nodes))
        enc.u64_array([n.id for n in self.nodes])
        tensors = self.tensors()
        enc.u32(len(tensors))
        for t in tensors:
            encode_rpc_tensor(enc, t.to_rpc(), wide)
        return enc.getvalue()


@dataclass
class SerializedGraph:
    """A graph as decoded from the wire: node ids and the flat tensor records."""

    nodes: list[int]
    tensors: list[RpcTensor]

    def check(self) -> None:
        """What the host assumes without checking: every reference resolves."""
        ids = {t.id for t in self.tensors}
        for n in self.nodes:
            if n and n not in ids:
                raise ApirDecodeError(f"graph node {n:#x} is not among its tensors", 0)
        for t in self.tensors:
            for ref in [*t.src, t.view_src]:
                if ref and ref not in ids:
                    raise ApirDecodeError(f"tensor {t.id:#x} refers to unknown tensor {ref:#x}", 0)


def deserialize_graph(data: bytes | memoryview, strict: bool = True, wide: bool = False) -> SerializedGraph:
    dec = Decoder(data, strict=strict)
    n_nodes = dec.u32()
    nodes = dec.u64_array(n_nodes)
    n_tensors = dec.u32()
    if dec.strict and n_tensors * rpc_tensor_size(wide) > dec.remaining:
        raise ApirDecodeError(f"{n_tensors} tensors do not fit in {dec.remaining} bytes", dec.pos)
    tensors = [decode_rpc_tensor(dec, wide) for _ in range(n_tensors)] if not dec.fatal else []
    return SerializedGraph(nodes, tensors)
