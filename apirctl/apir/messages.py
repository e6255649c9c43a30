"""Requests and replies of the 23 forwarded functions, encoded and decoded from the table.

Both ends are here: `encode_request`/`decode_reply` are what a frontend does, `decode_request`/
`encode_reply` what a backend does, so tests can play either side against the other or against the
real library. Values are plain dicts keyed by the table's field names; tensors are `RpcTensor`, inline
tensors `Tensor` when encoding and `InlineTensor` when decoding. The FORWARD command header
(`encode_command`) is what virglrenderer receives before the function's own fields.
"""

from __future__ import annotations

from typing import Any

from apirctl.apir import protocol, table
from apirctl.apir.table import Field, Function, Kind
from apirctl.apir.tensor import (
    RpcTensor,
    Tensor,
    decode_inline_tensor,
    decode_rpc_tensor,
    encode_inline_tensor,
    encode_rpc_tensor,
)
from apirctl.apir.wire import ApirDecodeError, Decoder, Encoder

Values = dict[str, Any]


def _function(fn: Function | str) -> Function:
    return table.by_name(fn) if isinstance(fn, str) else fn


def encode_field(enc: Encoder, f: Field, value: Any, wide: bool = False) -> None:
    k = f.kind
    if k is Kind.I32 or k is Kind.STATUS:
        enc.i32(int(value))
    elif k is Kind.U32 or k is Kind.RES_ID:
        enc.u32(int(value))
    elif k is Kind.U8:
        enc.u8(int(value))
    elif k is Kind.BOOL:
        enc.bool(bool(value))
    elif k is Kind.SIZE or k is Kind.HANDLE:
        enc.u64(int(value))
    elif k is Kind.STRING:
        enc.string(value)
    elif k is Kind.RPC_TENSOR:
        if not isinstance(value, RpcTensor):
            value = value.to_rpc()
        encode_rpc_tensor(enc, value, wide)
    elif k is Kind.INLINE_TENSOR:
        if not isinstance(value, Tensor):
            raise TypeError(f"{f.name}: an inline tensor must be a tensor.Tensor")
        encode_inline_tensor(enc, value)
    else:  # pragma: no cover - every Kind is handled above
        raise AssertionError(k)


def decode_field(dec: Decoder, f: Field, wide: bool = False) -> Any:
    k = f.kind
    if k is Kind.I32 or k is Kind.STATUS:
        return dec.i32()
    if k is Kind.U32 or k is Kind.RES_ID:
        return dec.u32()
    if k is Kind.U8:
        return dec.u8()
    if k is Kind.BOOL:
        return dec.bool()
    if k is Kind.SIZE or k is Kind.HANDLE:
        return dec.u64()
    if k is Kind.STRING:
        return dec.string()
    if k is Kind.RPC_TENSOR:
        return decode_rpc_tensor(dec, wide)
    if k is Kind.INLINE_TENSOR:
        return decode_inline_tensor(dec)
    raise AssertionError(k)  # pragma: no cover


def _encode(fields: tuple[Field, ...], values: Values, wide: bool = False) -> bytes:
    missing = [f.name for f in fields if f.name not in values]
    extra = set(values) - {f.name for f in fields}
    if missing or extra:
        raise ValueError(f"fields missing: {missing}, unknown: {sorted(extra)}")
    enc = Encoder()
    for f in fields:
        encode_field(enc, f, values[f.name], wide)
    return enc.getvalue()


def _decode(fields: tuple[Field, ...], data: bytes | memoryview, strict: bool, exact: bool,
            wide: bool = False) -> Values:
    dec = Decoder(data, strict=strict)
    out = {f.name: decode_field(dec, f, wide) for f in fields}
    if exact and dec.remaining and strict:
        raise ApirDecodeError(f"{dec.remaining} bytes left after the last field", dec.pos)
    return out


def encode_request(fn: Function | str, *, wide: bool = False, **values: Any) -> bytes:
    """The function's own fields (what follows the command header); `wide`: its tensors as
    `apir_rpc_tensor_wide`, once the host granted `extensions.FEATURE_WIDE_TENSORS`."""
    return _encode(_function(fn).request, values, wide)


def decode_request(fn: Function | str, data: bytes | memoryview, strict: bool = True,
                   exact: bool = False, wide: bool = False) -> Values:
    return _decode(_function(fn).request, data, strict, exact, wide)


def encode_reply(fn: Function | str, **values: Any) -> bytes:
    return _encode(_function(fn).reply, values)


def decode_reply(fn: Function | str, data: bytes | memoryview, strict: bool = True,
                 exact: bool = False) -> Values:
    """Decode a reply; a reply buffer is usually larger than the reply, so `exact` is off by default."""
    return _decode(_function(fn).reply, data, strict, exact)


def encode_command(command: protocol.CommandType, flags: int, reply_res_id: int,
                   venus_shift: bool = False) -> bytes:
    """The 12-byte header of every command: type, flags, reply resource id."""
    enc = Encoder()
    ctype = int(command) + (protocol.VENUS_COMMAND_TYPE_LENGTH if venus_shift else 0)
    enc.i32(ctype)
    enc.i32(flags)
    enc.u32(reply_res_id)
    return enc.getvalue()


def encode_forward(fn: Function | str, reply_res_id: int, venus_shift: bool = False, *, wide: bool = False,
                   **values: Any) -> bytes:
    """A whole FORWARD command, as the frontend hands it to the execbuffer ioctl."""
    f = _function(fn)
    return encode_command(protocol.CommandType.FORWARD, f.index, reply_res_id, venus_shift) + \
        encode_request(f, wide=wide, **values)


def decode_command(data: bytes | memoryview) -> tuple[int, int, int, memoryview]:
    """(command type with any Venus shift removed, flags, reply res id, the rest)."""
    dec = Decoder(data)
    ctype, flags, res = dec.i32(), dec.i32(), dec.u32()
    if ctype >= protocol.VENUS_COMMAND_TYPE_LENGTH:
        ctype -= protocol.VENUS_COMMAND_TYPE_LENGTH
    return ctype, flags, res, dec.raw(dec.remaining)


def encode_handshake(reply_res_id: int, major: int = protocol.PROTOCOL_MAJOR, minor: int = protocol.PROTOCOL_MINOR,
                     venus_shift: bool = False) -> bytes:
    """HANDSHAKE: the guest's protocol version."""
    enc = Encoder()
    enc.u32(major)
    enc.u32(minor)
    return encode_command(protocol.CommandType.HANDSHAKE, 0, reply_res_id, venus_shift) + enc.getvalue()


def decode_handshake_reply(code: int, data: bytes | memoryview) -> tuple[int, int]:
    """The host's (major, minor); the return code must be the handshake magic."""
    if code != protocol.HANDSHAKE_MAGIC:
        raise ApirDecodeError(f"handshake answered {code:#x}, not the magic {protocol.HANDSHAKE_MAGIC:#x}", 0)
    dec = Decoder(data)
    return dec.u32(), dec.u32()


def describe(data: bytes | memoryview) -> dict[str, Any]:
    """A whole command as plain values, for people reading a capture."""
    ctype, flags, res, rest = decode_command(data)
    out: dict[str, Any] = {"reply_res_id": res}
    try:
        out["command"] = protocol.CommandType(ctype).name
    except ValueError:
        out["command"] = f"unknown ({ctype})"
        return out
    if ctype == protocol.CommandType.HANDSHAKE:
        dec = Decoder(rest)
        out["guest_version"] = f"{dec.u32()}.{dec.u32()}"
    elif ctype == protocol.CommandType.FORWARD:
        if not 0 <= flags < table.dispatch_table_count():
            out["function"] = f"unknown index {flags}"
            return out
        fn = table.by_index(flags)
        out["function"] = fn.qualname
        out["request"] = {k: plain(v) for k, v in decode_request(fn, rest, exact=True).items()}
    return out


def plain(value: Any) -> Any:
    """JSON-friendly form of a decoded value."""
    import dataclasses

    if isinstance(value, RpcTensor):
        d = dataclasses.asdict(value)
        d["name"] = value.name.decode(errors="replace")
        return d
    if hasattr(value, "tensor") and hasattr(value, "src"):  # InlineTensor
        t = value.tensor
        return {"type": t.type, "op": t.op, "ne": list(t.ne), "nb": list(t.nb), "name": t.name.decode(errors="replace"),
                "buffer": value.buffer, "sources": len(value.src), "view_src": value.view_src is not None}
    return value
