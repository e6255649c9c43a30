"""The forwarded-function table: every function the frontend can call on the host, as data.

Our equivalent of upstream's `ggmlremoting_functions.yaml`, extended with what the YAML leaves to
hand-written C: the wire fields of each request and reply. The header generator, the message codecs,
the docs and the selftest all read this one table, so they cannot disagree with each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache


class Kind(str, Enum):
    """How one field travels on the wire (see `wire` for the byte rules)."""

    I32 = "int32"
    U32 = "uint32"
    U8 = "uint8"  # padded to 4 bytes
    BOOL = "bool"  # padded to 4 bytes
    SIZE = "size"  # size_t, always 8 bytes
    HANDLE = "handle"  # a host pointer (buffer or buffer type), 8 bytes
    RES_ID = "res_id"  # a shared-memory resource id, uint32
    STRING = "string"  # uint64 length (NUL included), then the bytes padded to 4
    STATUS = "status"  # enum ggml_status, 4 bytes
    RPC_TENSOR = "rpc_tensor"  # struct apir_rpc_tensor
    INLINE_TENSOR = "inline_tensor"  # raw struct ggml_tensor + buffer handle + view source + sources


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    doc: str = ""


@dataclass(frozen=True)
class Function:
    """One forwarded function: its place in the dispatch table and its two messages."""

    group: str
    name: str
    doc: str
    request: tuple[Field, ...] = ()
    reply: tuple[Field, ...] = ()
    frontend_return: str = "void"
    frontend_params: tuple[str, ...] = ()
    deprecated: bool = False
    enabled: bool = True
    shmem: str = ""  # what travels in shared memory beside the message, if anything
    index: int = -1  # filled in by `functions()`

    @property
    def qualname(self) -> str:
        return f"{self.group}_{self.name}"

    @property
    def enum_name(self) -> str:
        return f"APIR_COMMAND_TYPE_{self.group.upper()}_{self.name.upper()}"

    @property
    def backend_function(self) -> str:
        return f"backend_{self.qualname}"

    @property
    def frontend_function(self) -> str:
        return f"apir_{self.qualname}"


@dataclass(frozen=True)
class Group:
    name: str
    description: str
    functions: tuple[Function, ...] = field(default_factory=tuple)


def _f(name: str, kind: Kind, doc: str = "") -> Field:
    return Field(name, kind, doc)


_BUFT = _f("buft", Kind.HANDLE, "buffer-type handle from device_get_buffer_type")
_BUF = _f("buffer", Kind.HANDLE, "buffer handle from alloc_buffer or buffer_from_ptr")
_STR = "char *"
_BUFT_P = "apir_buffer_type_host_handle_t host_handle"
_CTX_P = "apir_buffer_context_t *buffer_context"

GROUPS: tuple[Group, ...] = (
    Group("device", "device", (
        Function("device", "get_device_count", "number of devices of the GGML backend",
                 reply=(_f("count", Kind.I32),)),
        Function("device", "get_count", "number of devices (same answer as get_device_count)",
                 reply=(_f("count", Kind.I32),), frontend_return="int"),
        Function("device", "get_name", "name of device 0", reply=(_f("name", Kind.STRING),),
                 frontend_return=_STR),
        Function("device", "get_description", "description of device 0",
                 reply=(_f("description", Kind.STRING),), frontend_return=_STR),
        Function("device", "get_type", "enum ggml_backend_dev_type of device 0",
                 reply=(_f("type", Kind.U32),), frontend_return="uint32_t"),
        Function("device", "get_memory", "free and total device memory in bytes",
                 reply=(_f("free", Kind.SIZE), _f("total", Kind.SIZE)), frontend_return="void",
                 frontend_params=("size_t *free", "size_t *total")),
        Function("device", "supports_op", "whether the device can run this tensor's operation",
                 request=(_f("op", Kind.INLINE_TENSOR),), reply=(_f("supported", Kind.BOOL),),
                 frontend_return="bool", frontend_params=("const ggml_tensor *op",)),
        Function("device", "get_buffer_type", "the device's default buffer type",
                 reply=(_BUFT,), frontend_return="apir_buffer_type_host_handle_t"),
        Function("device", "get_props", "device capabilities",
                 reply=(_f("async", Kind.BOOL), _f("host_buffer", Kind.BOOL),
                        _f("buffer_from_host_ptr", Kind.BOOL), _f("events", Kind.BOOL),
                        _f("mmap_support", Kind.BOOL)),
                 frontend_params=("bool *async", "bool *host_buffer", "bool *buffer_from_host_ptr",
                                  "bool *events", "bool *mmap_support")),
        Function("device", "buffer_from_ptr", "wrap a shared-memory resource as a device buffer",
                 request=(_f("res_id", Kind.RES_ID, "shared resource holding the buffer memory"),
                          _f("size", Kind.SIZE), _f("max_tensor_size", Kind.SIZE)),
                 reply=(_BUF, _BUFT), frontend_return="apir_buffer_context_t",
                 frontend_params=("size_t size", "size_t max_tensor_size"),
                 shmem="resource `res_id` becomes the buffer's memory"),
    )),
    Group("buffer_type", "buffer-type", (
        Function("buffer_type", "get_name", "name of a buffer type", request=(_BUFT,),
                 reply=(_f("name", Kind.STRING),), frontend_return=_STR, frontend_params=(_BUFT_P,)),
        Function("buffer_type", "get_alignment", "allocation alignment in bytes", request=(_BUFT,),
                 reply=(_f("alignment", Kind.SIZE),), frontend_return="size_t",
                 frontend_params=(_BUFT_P,)),
        Function("buffer_type", "get_max_size", "largest buffer (SIZE_MAX when unbounded)",
                 request=(_BUFT,), reply=(_f("max_size", Kind.SIZE),), frontend_return="size_t",
                 frontend_params=(_BUFT_P,)),
        Function("buffer_type", "is_host", "always answers false",
                 reply=(_f("is_host", Kind.BOOL),), deprecated=True),
        Function("buffer_type", "alloc_buffer", "allocate a buffer in device memory",
                 request=(_BUFT, _f("size", Kind.SIZE)), reply=(_BUF,),
                 frontend_return="apir_buffer_context_t",
                 frontend_params=(_BUFT_P, "size_t size")),
        Function("buffer_type", "get_alloc_size", "bytes a tensor needs in this buffer type",
                 request=(_BUFT, _f("op", Kind.INLINE_TENSOR)), reply=(_f("size", Kind.SIZE),),
                 frontend_return="size_t", frontend_params=(_BUFT_P, "const ggml_tensor *op")),
    )),
    Group("buffer", "buffer", (
        Function("buffer", "get_base", "host address of the buffer's memory", request=(_BUF,),
                 reply=(_f("base", Kind.HANDLE),), frontend_return="void *", frontend_params=(_CTX_P,)),
        Function("buffer", "set_tensor", "copy bytes from shared memory into a tensor",
                 request=(_BUF, _f("tensor", Kind.RPC_TENSOR), _f("res_id", Kind.RES_ID),
                          _f("offset", Kind.SIZE), _f("size", Kind.SIZE)),
                 frontend_params=(_CTX_P, "ggml_tensor *tensor", "const void *data", "size_t offset",
                                  "size_t size"),
                 shmem="the `size` bytes to write, at the start of resource `res_id`"),
        Function("buffer", "get_tensor", "copy bytes of a tensor into shared memory",
                 request=(_BUF, _f("tensor", Kind.RPC_TENSOR), _f("res_id", Kind.RES_ID),
                          _f("offset", Kind.SIZE), _f("size", Kind.SIZE)),
                 frontend_params=(_CTX_P, "const ggml_tensor *tensor", "void *data", "size_t offset",
                                  "size_t size"),
                 shmem="the host writes `size` bytes at the start of resource `res_id`"),
        Function("buffer", "cpy_tensor", "copy one tensor into another on the device",
                 request=(_BUF, _f("src", Kind.RPC_TENSOR), _f("dst", Kind.RPC_TENSOR)),
                 reply=(_f("copied", Kind.BOOL),), frontend_return="bool",
                 frontend_params=(_CTX_P, "const ggml_tensor *src", "const ggml_tensor *dst")),
        Function("buffer", "clear", "fill the whole buffer with one byte value",
                 request=(_BUF, _f("value", Kind.U8)), frontend_params=(_CTX_P, "uint8_t value")),
        Function("buffer", "free_buffer", "release a buffer", request=(_BUF,), frontend_params=(_CTX_P,)),
    )),
    Group("backend", "backend", (
        Function("backend", "graph_compute", "run a serialized compute graph",
                 request=(_f("res_id", Kind.RES_ID, "shared resource holding the serialized graph"),
                          _f("graph_size", Kind.SIZE)),
                 reply=(_f("status", Kind.STATUS),), frontend_return="ggml_status",
                 frontend_params=("ggml_cgraph *cgraph",),
                 shmem="the serialized graph (see `tensor.Graph`), `graph_size` bytes"),
        Function("backend", "graph_optimize", "disabled upstream; not in the dispatch table",
                 frontend_return="ggml_cgraph *", frontend_params=("ggml_cgraph *cgraph",), enabled=False),
    )),
)


@lru_cache(maxsize=1)
def functions() -> tuple[Function, ...]:
    """The enabled functions in dispatch order, each with its command index."""
    out: list[Function] = []
    for group in GROUPS:
        for fn in group.functions:
            if fn.enabled:
                out.append(_with_index(fn, len(out)))
    return tuple(out)


def _with_index(fn: Function, index: int) -> Function:
    from dataclasses import replace

    return replace(fn, index=index)


def dispatch_table_count() -> int:
    return len(functions())


def by_name(qualname: str) -> Function:
    """Look a function up by `group_name` (e.g. `device_get_name`)."""
    for fn in functions():
        if fn.qualname == qualname:
            return fn
    raise KeyError(qualname)


def by_index(index: int) -> Function:
    return functions()[index]


def group_description(group: str) -> str:
    for g in GROUPS:
        if g.name == group:
            return g.description
    raise KeyError(group)
