"""Hostile commands sent to the real backend library: each must be refused, and the library live on.

Each probe starts a fresh child process (see `session`), sets up what it needs with valid calls, then
sends one malformed or hostile command. The outcome is `rejected` (a non-zero return code), `accepted`
(it answered 0, whatever it did), or `crashed` (the child died: which signal). `expected` records what
apirctl's patched library does (llama_patches: guest objects are ids, every tensor and range is
checked), so a test notices any regression; docs/apir.md keeps the table, with what upstream's library
did. `apirctl backend probe` runs them against any backend/GGML library pair, upstream's included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from apirctl.apir import messages, table, tensor
from apirctl.apir.session import BackendCrashed, BackendProcess, CallFailed, HostError, describe_exit

Outcome = Literal["rejected", "accepted", "crashed"]


class ProbeResult(BaseModel):
    name: str
    what: str
    expected: str
    outcome: str
    detail: str
    as_expected: bool
    #: What the library wrote to stderr before it crashed (the CLI quotes its most telling line).
    stderr: str = ""


@dataclass
class Ctx:
    proc: BackendProcess
    buft: int = 0
    buffer: int = 0
    base: int = 0
    shmem: int = 0
    shmem_size: int = 4096
    shared: bool = False


class Sent(Exception):
    """Raised by a probe to report the dispatcher's answer to its malformed command."""

    def __init__(self, ret: int, detail: str = "") -> None:
        super().__init__(detail)
        self.ret = ret
        self.detail = detail


class SetupFailed(Exception):
    """The valid calls a probe needs before its malformed one did not work."""


class Skip(Exception):
    """The probe does not apply to this device."""


def _send(ctx: Ctx, fn: str | int, data: bytes, detail: str = "") -> None:
    cmd = table.by_name(fn).index if isinstance(fn, str) else fn
    ret, _reply, _ = ctx.proc.dispatch_raw(cmd, data)
    raise Sent(ret, detail)


def _rpc(ctx: Ctx, **kw: int) -> tensor.RpcTensor:
    t = tensor.RpcTensor(id=1, buffer=ctx.buffer, ne=[16, 1, 1, 1], nb=[4, 64, 64, 64], data=0, name=b"t")
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def _set(ctx: Ctx, t: tensor.RpcTensor, res_id: int, offset: int, size: int, buffer: int | None = None) -> bytes:
    return messages.encode_request("buffer_set_tensor", buffer=ctx.buffer if buffer is None else buffer, tensor=t,
                                   res_id=res_id, offset=offset, size=size)


# ---- the probes -------------------------------------------------------------------------------

def p_before_init(ctx: Ctx) -> None:
    ctx.proc.load(*_LIBS)
    _send(ctx, "device_get_count", b"")


def p_index_past_table(ctx: Ctx) -> None:
    _send(ctx, table.dispatch_table_count(), b"")


def p_index_max(ctx: Ctx) -> None:
    _send(ctx, 0xFFFFFFFF, b"")


def p_double_init(ctx: Ctx) -> None:
    raise Sent(ctx.proc.initialize(*_LIBS), "second apir_backend_initialize")


def p_get_base_unknown_handle(ctx: Ctx) -> None:
    _send(ctx, "buffer_get_base", messages.encode_request("buffer_get_base", buffer=0xDEADBEEF000))


def p_free_twice(ctx: Ctx) -> None:
    owned = ctx.proc.call("buffer_type_alloc_buffer", buft=ctx.buft, size=256)[0]["buffer"]
    data = messages.encode_request("buffer_free_buffer", buffer=owned)
    ctx.proc.dispatch_raw(table.by_name("buffer_free_buffer").index, data)
    _send(ctx, "buffer_free_buffer", data)


def p_free_shared(ctx: Ctx) -> None:
    if not ctx.shared:
        raise Skip("the device cannot wrap host memory")
    _send(ctx, "buffer_free_buffer", messages.encode_request("buffer_free_buffer", buffer=ctx.buffer))


def p_get_base_empty(ctx: Ctx) -> None:
    _send(ctx, "buffer_get_base", b"")


def p_reply_too_small(ctx: Ctx) -> None:
    # The reply resource is sized by the guest; the host's encoder has no bounds check in release builds.
    ret, _, _, overrun = ctx.proc.dispatch_limited(table.by_name("device_get_description").index, b"", reply_limit=4)
    raise Sent(ret, f"wrote {overrun} bytes past a 4-byte reply area" if overrun else "stayed inside the reply area")


def p_buft_unknown_handle(ctx: Ctx) -> None:
    _send(ctx, "buffer_type_get_name", messages.encode_request("buffer_type_get_name", buft=0xDEADBEEF000))


def p_buft_empty(ctx: Ctx) -> None:
    _send(ctx, "buffer_type_get_alignment", b"")


def p_supports_op_empty(ctx: Ctx) -> None:
    _send(ctx, "device_supports_op", b"")


def p_supports_op_source_pointer(ctx: Ctx) -> None:
    # What a real guest sends: the sources' `buffer` fields hold guest pointers, which the host
    # does not translate (only the top tensor's buffer handle is checked).
    a = tensor.Tensor((4, 4), name="a", buffer=0xDEADBEEF000)
    op = tensor.Tensor((4, 4), op=tensor.OP_ADD, src=[a, a], name="sum")
    _send(ctx, "device_supports_op", messages.encode_request("device_supports_op", op=op))


def p_set_tensor_truncated(ctx: Ctx) -> None:
    full = _set(ctx, _rpc(ctx), ctx.shmem, 0, 64)
    _send(ctx, "buffer_set_tensor", full[: 8 + 100], "request cut inside the tensor")


def p_set_tensor_unknown_res(ctx: Ctx) -> None:
    _send(ctx, "buffer_set_tensor", _set(ctx, _rpc(ctx), 999_999, 0, 64))


def p_set_tensor_data_past_buffer(ctx: Ctx) -> None:
    _send(ctx, "buffer_set_tensor", _set(ctx, _rpc(ctx, data=ctx.shmem_size * 4), ctx.shmem, 0, 64))


def p_set_tensor_size_past_tensor(ctx: Ctx) -> None:
    # A 64-byte tensor at the start of a 4 KiB buffer; write 3 KiB: past the tensor, inside the buffer.
    _send(ctx, "buffer_set_tensor", _set(ctx, _rpc(ctx), ctx.shmem, 0, 3072))


def p_set_tensor_size_past_buffer(ctx: Ctx) -> None:
    _send(ctx, "buffer_set_tensor", _set(ctx, _rpc(ctx), ctx.shmem, 0, 64 << 20), "64 MiB into a 4 KiB buffer")


def p_get_tensor_size_past_shmem(ctx: Ctx) -> None:
    msg = messages.encode_request("buffer_get_tensor", buffer=ctx.buffer, tensor=_rpc(ctx), res_id=ctx.shmem,
                                  offset=0, size=64 << 20)
    _send(ctx, "buffer_get_tensor", msg, "64 MiB out of a 4 KiB buffer into 4 KiB of shared memory")


def p_tensor_without_buffer_points_anywhere(ctx: Ctx) -> None:
    # The tensor names no buffer, so its `data` is taken as a raw host address: aim it at the
    # buffer's base (which buffer_get_base told us) + 8 and write through another path.
    ctx.proc.shmem_write(ctx.shmem, b"\x11" * 8)
    t = _rpc(ctx, buffer=0, data=ctx.base + 8)
    ret, _, _ = ctx.proc.dispatch_raw(table.by_name("buffer_set_tensor").index, _set(ctx, t, ctx.shmem, 0, 8))
    probe = messages.encode_request("buffer_get_tensor", buffer=ctx.buffer, tensor=_rpc(ctx), res_id=ctx.shmem,
                                    offset=0, size=16)
    ctx.proc.dispatch_raw(table.by_name("buffer_get_tensor").index, probe)
    got = ctx.proc.shmem_read(ctx.shmem, 16)
    raise Sent(ret, "wrote at a host address the guest chose" if got[8:16] == b"\x11" * 8 else "no write seen")


def p_tensor_unknown_buffer(ctx: Ctx) -> None:
    t = _rpc(ctx, buffer=0xDEADBEEF000, data=0x10)
    _send(ctx, "buffer_set_tensor", _set(ctx, t, ctx.shmem, 0, 8), "data 0x10 taken as an address")


def p_buffer_from_ptr_oversized(ctx: Ctx) -> None:
    msg = messages.encode_request("device_buffer_from_ptr", res_id=ctx.shmem, size=1 << 30, max_tensor_size=1 << 30)
    ret, reply, _ = ctx.proc.dispatch_raw(table.by_name("device_buffer_from_ptr").index, msg)
    big = messages.decode_reply("device_buffer_from_ptr", reply)["buffer"] if ret == 0 else 0
    if not big:
        raise Sent(ret, "refused")
    t = tensor.RpcTensor(id=2, buffer=big, ne=[16, 1, 1, 1], nb=[4, 64, 64, 64], data=(1 << 29), name=b"far")
    _send(ctx, "buffer_set_tensor", _set(ctx, t, ctx.shmem, 0, 64, buffer=big),
          "1 GiB buffer over 4 KiB of shared memory, then a write at 512 MiB")


def p_graph_size_zero(ctx: Ctx) -> None:
    _send(ctx, "backend_graph_compute", messages.encode_request("backend_graph_compute", res_id=ctx.shmem,
                                                                 graph_size=0))


def p_graph_size_past_shmem(ctx: Ctx) -> None:
    g = bytearray(_graph(ctx))
    g[12:16] = (1000).to_bytes(4, "little")  # n_tensors: 1000 records of 304 bytes, in a 4 KiB resource
    ctx.proc.shmem_write(ctx.shmem, bytes(g))
    _send(ctx, "backend_graph_compute", messages.encode_request(
        "backend_graph_compute", res_id=ctx.shmem, graph_size=64 << 20), "graph_size 64 MiB, 1000 tensors")


def p_graph_truncated(ctx: Ctx) -> None:
    g = _graph(ctx)
    ctx.proc.shmem_write(ctx.shmem, g)
    _send(ctx, "backend_graph_compute", messages.encode_request(
        "backend_graph_compute", res_id=ctx.shmem, graph_size=len(g) - 100))


def p_graph_dangling_node(ctx: Ctx) -> None:
    g = bytearray(_graph(ctx))
    g[4:12] = (0x777777).to_bytes(8, "little")  # the node id names no tensor
    ctx.proc.shmem_write(ctx.shmem, bytes(g))
    _send(ctx, "backend_graph_compute", messages.encode_request(
        "backend_graph_compute", res_id=ctx.shmem, graph_size=len(g)))


def p_graph_unknown_op(ctx: Ctx) -> None:
    a = tensor.Tensor((4,), name="a", buffer=ctx.buffer, offset=0)
    n = tensor.Tensor((4,), op=100_000, src=[a, a], name="bad", buffer=ctx.buffer, offset=64)
    g = tensor.Graph([n]).serialize()
    ctx.proc.shmem_write(ctx.shmem, g)
    _send(ctx, "backend_graph_compute", messages.encode_request(
        "backend_graph_compute", res_id=ctx.shmem, graph_size=len(g)))


def p_read_host_address(ctx: Ctx) -> None:
    # An arbitrary read: a tensor without a buffer whose data is an address, copied into shared memory.
    t = _rpc(ctx, buffer=0, data=ctx.base + 8)
    msg = messages.encode_request("buffer_get_tensor", buffer=ctx.buffer, tensor=t, res_id=ctx.shmem, offset=0,
                                  size=8)
    _send(ctx, "buffer_get_tensor", msg, f"data {ctx.base + 8:#x} as an address")


def p_forged_interface_free(ctx: Ctx) -> None:
    # Upstream's buffer handle was the address of the host's buffer object, whose first member is its
    # interface: overwrite it through a tensor without a buffer, then have the host call through it.
    ctx.proc.shmem_write(ctx.shmem, (0x4141414141414141).to_bytes(8, "little"))
    t = _rpc(ctx, buffer=0, data=ctx.buffer)
    ret, _, _ = ctx.proc.dispatch_raw(table.by_name("buffer_set_tensor").index, _set(ctx, t, ctx.shmem, 0, 8))
    free = messages.encode_request("buffer_free_buffer", buffer=ctx.buffer)
    freed, _, _ = ctx.proc.dispatch_raw(table.by_name("buffer_free_buffer").index, free)
    raise Sent(ret, f"the buffer was then freed normally (answer {freed})")


def p_fake_buffer_type_in_shmem(ctx: Ctx) -> None:
    # A fake buffer-type interface in the guest's own shared memory, named by the address the host
    # gave for that memory: upstream's host casts a buffer-type handle and calls through it.
    ctx.proc.shmem_write(ctx.shmem, (0x4242424242424242).to_bytes(8, "little") * 16)
    _send(ctx, "buffer_type_get_name", messages.encode_request("buffer_type_get_name", buft=ctx.base),
          f"handle {ctx.base:#x}")


def p_graph_shape_mismatch(ctx: Ctx) -> None:
    # A matrix product whose operands do not fit: backends assert on it rather than check it.
    a = tensor.Tensor((4, 2), name="a", buffer=ctx.buffer, offset=0)
    b = tensor.Tensor((3, 2), name="b", buffer=ctx.buffer, offset=64)
    n = tensor.Tensor((2, 2), op=tensor.OP_MUL_MAT, src=[a, b], name="ab", buffer=ctx.buffer, offset=128)
    g = tensor.Graph([n]).serialize()
    ctx.proc.shmem_write(ctx.shmem, g)
    _send(ctx, "backend_graph_compute", messages.encode_request(
        "backend_graph_compute", res_id=ctx.shmem, graph_size=len(g)), "mul_mat of 4 x 2 by 3 x 2")


def _graph(ctx: Ctx) -> bytes:
    a = tensor.Tensor((4,), name="a", buffer=ctx.buffer, offset=0)
    b = tensor.Tensor((4,), name="b", buffer=ctx.buffer, offset=64)
    n = tensor.Tensor((4,), op=tensor.OP_ADD, src=[a, b], name="sum", buffer=ctx.buffer, offset=128)
    return tensor.Graph([n]).serialize()


@dataclass(frozen=True)
class Probe:
    name: str
    what: str
    run: Callable[[Ctx], None]
    expected: Outcome
    init: bool = True
    success: int = 0  # the answer that means "accepted"


PROBES: tuple[Probe, ...] = (
    Probe("before-init", "a forwarded call before apir_backend_initialize", p_before_init, "rejected", init=False),
    Probe("index-past-table", "command index 23 (one past the table)", p_index_past_table, "rejected"),
    Probe("index-max", "command index 0xffffffff", p_index_max, "rejected"),
    Probe("double-init", "apir_backend_initialize twice", p_double_init, "rejected",
          success=6),
    Probe("get-base-unknown-buffer", "buffer_get_base with a handle never given out", p_get_base_unknown_handle,
          "rejected"),
    Probe("free-twice", "buffer_free_buffer twice on one (device) buffer", p_free_twice, "rejected"),
    Probe("free-shared-buffer", "buffer_free_buffer on a buffer made by device_buffer_from_ptr",
          p_free_shared, "accepted"),
    Probe("get-base-empty", "buffer_get_base with an empty request", p_get_base_empty, "rejected"),
    Probe("reply-too-small", "device_get_description answered into a 4-byte reply area", p_reply_too_small,
          "rejected"),
    Probe("buffer-type-unknown-handle", "buffer_type_get_name with a handle never given out",
          p_buft_unknown_handle, "rejected"),
    Probe("buffer-type-empty", "buffer_type_get_alignment with an empty request (handle reads as 0)",
          p_buft_empty, "rejected"),
    Probe("supports-op-empty", "device_supports_op with an empty request", p_supports_op_empty, "rejected"),
    Probe("supports-op-source-pointer", "device_supports_op whose source tensor carries a foreign buffer pointer",
          p_supports_op_source_pointer, "accepted"),
    Probe("set-tensor-truncated", "buffer_set_tensor cut inside the tensor", p_set_tensor_truncated, "rejected"),
    Probe("set-tensor-unknown-resource", "buffer_set_tensor naming a shared resource that does not exist",
          p_set_tensor_unknown_res, "rejected"),
    Probe("tensor-data-past-buffer", "a tensor whose data offset lies past its buffer's end",
          p_set_tensor_data_past_buffer, "rejected"),
    Probe("set-tensor-past-tensor", "buffer_set_tensor writing 3 KiB into a 64-byte tensor",
          p_set_tensor_size_past_tensor, "rejected"),
    Probe("set-tensor-past-buffer", "buffer_set_tensor writing 64 MiB into a 4 KiB buffer",
          p_set_tensor_size_past_buffer, "rejected"),
    Probe("get-tensor-past-shmem", "buffer_get_tensor reading 64 MiB into 4 KiB of shared memory",
          p_get_tensor_size_past_shmem, "rejected"),
    Probe("tensor-without-buffer", "a tensor naming no buffer: its data offset is used as a host address",
          p_tensor_without_buffer_points_anywhere, "rejected"),
    Probe("tensor-unknown-buffer", "a tensor naming a buffer never given out, data 0x10",
          p_tensor_unknown_buffer, "rejected"),
    Probe("buffer-from-ptr-oversized", "device_buffer_from_ptr of 1 GiB over a 4 KiB resource, then a write",
          p_buffer_from_ptr_oversized, "rejected"),
    Probe("graph-size-zero", "backend_graph_compute with graph_size 0", p_graph_size_zero, "rejected"),
    Probe("graph-size-past-shmem", "backend_graph_compute whose graph_size exceeds the resource",
          p_graph_size_past_shmem, "rejected"),
    Probe("graph-truncated", "backend_graph_compute with the graph cut short", p_graph_truncated, "rejected"),
    Probe("graph-dangling-node", "a graph whose node id names no tensor", p_graph_dangling_node, "rejected"),
    Probe("graph-unknown-op", "a graph node with op 100000", p_graph_unknown_op, "rejected"),
    Probe("read-host-address", "buffer_get_tensor of a tensor without a buffer whose data is an address",
          p_read_host_address, "rejected"),
    Probe("forged-interface-free", "8 bytes written over a buffer object's interface, then buffer_free_buffer",
          p_forged_interface_free, "rejected"),
    Probe("fake-buffer-type-in-shmem", "a buffer-type handle naming a fake interface table in shared memory",
          p_fake_buffer_type_in_shmem, "rejected"),
    Probe("graph-shape-mismatch", "a graph whose matrix product has operands that do not fit",
          p_graph_shape_mismatch, "rejected"),
)

_LIBS: tuple[Path, Path, str] = (Path(), Path(), "")


def run_probe(probe: Probe, library: Path, ggml_library: Path, reg: str) -> ProbeResult:
    """Run one probe in a fresh child process."""
    global _LIBS
    _LIBS = (library, ggml_library, reg)
    outcome: str
    stderr = ""
    with BackendProcess(timeout=60) as proc:
        ctx = Ctx(proc)
        try:
            if probe.init:
                _setup(ctx)
            probe.run(ctx)
            outcome, detail = "accepted", "no command sent"
        except Sent as sent:
            outcome = "accepted" if sent.ret == probe.success else "rejected"
            detail = f"returned {sent.ret}" + (f"; {sent.detail}" if sent.detail else "")
        except Skip as skip:
            outcome, detail = "skipped", str(skip)
        except (HostError, CallFailed, SetupFailed) as exc:
            outcome, detail = "error", f"could not set the probe up: {exc}"
        except BackendCrashed as exc:
            outcome = "crashed"
            detail, stderr = f"{describe_exit(exc.returncode)} during {exc.call}", exc.stderr
    return ProbeResult(name=probe.name, what=probe.what, expected=probe.expected, outcome=outcome, detail=detail,
                       as_expected=outcome in (probe.expected, "skipped"), stderr=stderr)


def _setup(ctx: Ctx) -> None:
    code = ctx.proc.initialize(*_LIBS)
    if code != 6:
        raise SetupFailed(f"the backend did not initialize (code {code})")
    ctx.buft = ctx.proc.call("device_get_buffer_type")[0]["buft"]
    ctx.shmem = ctx.proc.shmem(ctx.shmem_size)
    props = ctx.proc.call("device_get_props")[0]
    ctx.shared = bool(props["buffer_from_host_ptr"])
    if ctx.shared:
        ctx.buffer = ctx.proc.call("device_buffer_from_ptr", res_id=ctx.proc.shmem(ctx.shmem_size),
                                   size=ctx.shmem_size, max_tensor_size=ctx.shmem_size)[0]["buffer"]
    else:
        ctx.buffer = ctx.proc.call("buffer_type_alloc_buffer", buft=ctx.buft, size=ctx.shmem_size)[0]["buffer"]
    ctx.base = ctx.proc.call("buffer_get_base", buffer=ctx.buffer)[0]["base"]


def run_all(library: Path, ggml_library: Path, reg: str, names: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> list[ProbeResult]:
    out = []
    for probe in PROBES:
        if names and probe.name not in names:
            continue
        if progress:
            progress(probe.name)
        out.append(run_probe(probe, library, ggml_library, reg))
    return out
