"""The encoder/decoder: wire rules, both error models, message codecs, and fuzzing of the decoder."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apirctl.apir import extensions, messages, protocol, table, tensor
from apirctl.apir.table import Kind
from apirctl.apir.wire import ApirDecodeError, Decoder, Encoder, padded

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=300)


def test_small_integers_are_padded_to_four_bytes() -> None:
    enc = Encoder()
    enc.u8(0xAB)
    enc.bool(True)
    enc.u32(1)
    enc.u64(2)
    assert enc.getvalue() == bytes.fromhex("ab000000" "01000000" "01000000" "0200000000000000")


def test_string_counts_its_nul_and_pads() -> None:
    enc = Encoder()
    enc.string("CPU")
    assert enc.getvalue() == bytes.fromhex("0400000000000000" "43505500")
    enc = Encoder()
    enc.string("ABCD")
    assert enc.getvalue() == bytes.fromhex("0500000000000000" "4142434400000000")


def test_strict_decoder_raises_with_offset() -> None:
    dec = Decoder(bytes(6))
    assert dec.u32() == 0
    with pytest.raises(ApirDecodeError) as info:
        dec.u32()
    assert info.value.offset == 4
    assert dec.pos == 4  # nothing consumed by the failed read


def test_flag_mode_yields_zeros_and_stays_put_like_upstream() -> None:
    dec = Decoder(bytes.fromhex("0100000002000000"), strict=False)
    assert dec.u32() == 1
    assert dec.u64() == 0 and dec.fatal
    assert dec.pos == 4
    assert dec.u8() == 2  # upstream keeps reading after a failure; so do we in flag mode
    assert dec.fatal


def test_array_size_mismatch_is_an_error() -> None:
    enc = Encoder()
    enc.array_size(3)
    with pytest.raises(ApirDecodeError):
        Decoder(enc.getvalue()).array_size(expected=4)
    lax = Decoder(enc.getvalue(), strict=False)
    assert lax.array_size(expected=4) == 0 and lax.fatal


def test_zero_length_string_is_rejected() -> None:
    with pytest.raises(ApirDecodeError):
        Decoder(bytes(8)).string()


def test_raw_is_a_zero_copy_view() -> None:
    data = bytearray(b"abcdefgh")
    view = Decoder(data).raw(4)
    data[0] = ord("z")
    assert bytes(view) == b"zbcd"


def test_encoder_rejects_out_of_range_values() -> None:
    with pytest.raises(ValueError):
        Encoder().u8(256)
    with pytest.raises(ValueError):
        Encoder().u64(-1)
    with pytest.raises(ValueError):
        Encoder().string("a\x00b")


@given(st.lists(st.tuples(st.sampled_from(["u8", "bool", "u32", "i32", "u64"]), U64), max_size=30))
def test_scalar_sequences_round_trip(items: list[tuple[str, int]]) -> None:
    enc = Encoder()
    expected = []
    for kind, raw in items:
        value: int | bool = {"u8": raw & 0xFF, "bool": bool(raw & 1), "u32": raw & 0xFFFFFFFF,
                             "i32": (raw & 0xFFFFFFFF) - 2**31, "u64": raw}[kind]
        getattr(enc, kind)(value)
        expected.append(value)
    data = enc.getvalue()
    assert len(data) % 4 == 0
    dec = Decoder(data)
    assert [getattr(dec, kind)() for kind, _ in items] == expected
    assert dec.remaining == 0


@given(TEXT)
def test_strings_round_trip(text: str) -> None:
    enc = Encoder()
    enc.string(text)
    assert len(enc) == 8 + padded(len(text.encode()) + 1)
    assert Decoder(enc.getvalue()).string() == text


def rpc_tensors() -> st.SearchStrategy[tensor.RpcTensor]:
    return st.builds(
        tensor.RpcTensor, id=U64, type=U32, buffer=U64, ne=st.lists(U32, min_size=4, max_size=4),
        nb=st.lists(U32, min_size=4, max_size=4), op=U32, op_params=st.lists(I32, min_size=16, max_size=16),
        flags=I32, src=st.lists(U64, min_size=10, max_size=10), view_src=U64, view_offs=U64, data=U64,
        name=st.binary(max_size=63).map(lambda b: b.replace(b"\x00", b"x")))


@given(rpc_tensors())
def test_rpc_tensor_round_trips(t: tensor.RpcTensor) -> None:
    data = t.to_bytes()
    assert len(data) == tensor.RPC_TENSOR_SIZE == 304
    assert tensor.RpcTensor.from_bytes(data) == t


def test_wide_rpc_tensor_round_trips_what_a_narrow_one_cannot_hold() -> None:
    t = tensor.RpcTensor(id=7, ne=[4, 1 << 33, 1, -1], nb=[4, 0, 1 << 40, (1 << 64) - 1], name=b"w")
    assert not t.fits_narrow()
    with pytest.raises(ValueError, match="wide record"):
        t.to_bytes()
    data = t.to_bytes(wide=True)
    assert len(data) == tensor.RPC_TENSOR_WIDE_SIZE == 328
    assert tensor.RpcTensor.from_bytes(data, wide=True) == t
    with pytest.raises(ApirDecodeError):
        tensor.RpcTensor.from_bytes(data)  # 328 bytes are not a narrow record
    # the fields keep their order and the narrow record's offsets up to `buffer`
    assert tensor.layout(tensor.RpcTensorWideC)["buffer"] == tensor.layout(tensor.RpcTensorC)["buffer"]


def test_wide_graphs_and_writes_have_the_wide_sizes() -> None:
    a = tensor.Tensor((4, 3), name="a")
    n = tensor.Tensor((4, 3), op=tensor.OP_ADD, src=[a, a], name="n")
    data = tensor.Graph([n]).serialize(wide=True)
    assert len(data) == 4 + 8 + 4 + 2 * tensor.RPC_TENSOR_WIDE_SIZE
    g = tensor.deserialize_graph(data, wide=True)
    g.check()
    assert [t.name for t in g.tensors] == [b"a", b"n"]
    with pytest.raises(ApirDecodeError):
        tensor.deserialize_graph(data[:-1], wide=True)
    write = extensions.Write(1, a.to_rpc(), 0, 48, 0)
    assert len(extensions.encode_writes([write])) == extensions.WRITE_SIZE
    assert len(extensions.encode_writes([write], wide=True)) == extensions.WRITE_SIZE_WIDE
    request = messages.encode_request("buffer_get_tensor", wide=True, buffer=1, tensor=a.to_rpc(), res_id=3,
                                      offset=0, size=48)
    assert len(request) == 8 + tensor.RPC_TENSOR_WIDE_SIZE + 4 + 16
    assert messages.decode_request("buffer_get_tensor", request, exact=True, wide=True)["tensor"] == a.to_rpc()


def test_features_negotiation_model() -> None:
    assert extensions.decode_features_request(b"") is None  # a frontend from before the request carried them
    wanted = extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_WIDE_TENSORS
    assert extensions.decode_features_request(extensions.encode_features_request(wanted)) == wanted
    # an older host ignores the request and answers all it has: the frontend keeps what it asked for
    assert extensions.granted(extensions.FEATURE_GRAPH_RUN, extensions.FEATURES) == extensions.FEATURE_GRAPH_RUN
    assert extensions.granted(wanted, extensions.FEATURE_GRAPH_RUN) == extensions.FEATURE_GRAPH_RUN


def values_for(fields: tuple[table.Field, ...]) -> st.SearchStrategy[dict[str, object]]:
    by_kind: dict[Kind, st.SearchStrategy[object]] = {
        Kind.I32: I32, Kind.STATUS: I32, Kind.U32: U32, Kind.RES_ID: U32, Kind.U8: st.integers(0, 255),
        Kind.BOOL: st.booleans(), Kind.SIZE: U64, Kind.HANDLE: U64, Kind.STRING: TEXT, Kind.RPC_TENSOR: rpc_tensors(),
    }
    return st.fixed_dictionaries({f.name: by_kind[f.kind] for f in fields})


REQUESTS = [f for f in table.functions() if all(x.kind is not Kind.INLINE_TENSOR for x in f.request)]


@pytest.mark.parametrize("fn", REQUESTS, ids=lambda f: f.qualname)
# no deadline: what is checked is the bytes, and a loaded machine (CI's parallel run) is slow at times
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_request_and_reply_round_trips(fn: table.Function, data: st.DataObject) -> None:
    req = data.draw(values_for(fn.request))
    assert messages.decode_request(fn, messages.encode_request(fn, **req), exact=True) == req
    rep = data.draw(values_for(fn.reply))
    assert messages.decode_reply(fn, messages.encode_reply(fn, **rep), exact=True) == rep


def test_inline_tensor_carries_its_sources() -> None:
    a, b = tensor.Tensor((4, 3), name="a"), tensor.Tensor((4, 2), name="b")
    mm = tensor.Tensor((3, 2), op=tensor.OP_MUL_MAT, src=[a, b], buffer=0xBEEF, name="mm")
    data = messages.encode_request("device_supports_op", op=mm)
    assert len(data) == 3 * tensor.GGML_TENSOR_SIZE + 8
    got = messages.decode_request("device_supports_op", data, exact=True)["op"]
    assert got.buffer == 0xBEEF and [s.name for s in got.src] == [b"a", b"b"]
    assert list(got.tensor.ne) == [3, 2, 1, 1] and got.tensor.op == tensor.OP_MUL_MAT


def test_forward_command_header() -> None:
    data = messages.encode_forward("buffer_clear", reply_res_id=9, buffer=1, value=7)
    ctype, flags, res, rest = messages.decode_command(data)
    assert (ctype, flags, res) == (protocol.CommandType.FORWARD, 20, 9)
    assert messages.decode_request("buffer_clear", rest, exact=True) == {"buffer": 1, "value": 7}
    shifted = messages.encode_forward("buffer_clear", reply_res_id=9, venus_shift=True, buffer=1, value=7)
    assert int.from_bytes(shifted[:4], "little") == 2 + protocol.VENUS_COMMAND_TYPE_LENGTH
    assert messages.decode_command(shifted)[0] == protocol.CommandType.FORWARD


def test_graph_serialization_frames_and_orders_like_upstream() -> None:
    a, b, c = tensor.Tensor((4, 3), name="a"), tensor.Tensor((4, 2), name="b"), tensor.Tensor((3, 2), name="c")
    mm = tensor.Tensor((3, 2), op=tensor.OP_MUL_MAT, src=[a, b], name="mm")
    out = tensor.Tensor((3, 2), op=tensor.OP_ADD, src=[mm, c], name="out")
    data = tensor.Graph([mm, out]).serialize()
    assert len(data) == 4 + 2 * 8 + 4 + 5 * tensor.RPC_TENSOR_SIZE
    g = tensor.deserialize_graph(data)
    g.check()
    assert g.nodes == [mm.id, out.id]
    assert [t.name for t in g.tensors] == [b"a", b"b", b"mm", b"c", b"out"]  # sources first, once each
    assert all(t.flags & tensor.FLAG_COMPUTE for t in g.tensors if t.id in g.nodes)


def test_tensor_strides_and_size() -> None:
    t = tensor.Tensor((3, 2))
    assert t.nb == [4, 12, 24, 24] and t.nbytes == 24
    row = tensor.Tensor((3, 2), strides=(4, 16))  # rows padded to 16 bytes
    assert row.nb == [4, 16, 32, 32] and row.nbytes == 4 + 2 * 4 + 16
    assert row.to_rpc().nb == [4, 16, 32, 32]


def test_graph_with_dangling_reference_fails_check() -> None:
    a = tensor.Tensor((2,), name="a")
    n = tensor.Tensor((2,), op=tensor.OP_ADD, src=[a, a])
    g = tensor.deserialize_graph(tensor.Graph([n]).serialize())
    g.tensors = [t for t in g.tensors if t.id != a.id]
    with pytest.raises(ApirDecodeError):
        g.check()


# ---- fuzzing: the decoder never raises anything else, never reads outside its buffer ----

ALL_FUNCTIONS = list(table.functions())


def _decode_everything(data: bytes) -> None:
    for fn in ALL_FUNCTIONS:
        for decode in (messages.decode_request, messages.decode_reply):
            try:
                decode(fn, data)
            except ApirDecodeError as exc:
                assert 0 <= exc.offset <= len(data)
    try:
        tensor.deserialize_graph(data).check()
    except ApirDecodeError as exc:
        assert 0 <= exc.offset <= len(data)
    with contextlib.suppress(ApirDecodeError):
        messages.decode_command(data)


@settings(max_examples=300)
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _decode_everything(data)


@given(st.binary(max_size=400))
def test_fuzz_flag_mode_never_raises(data: bytes) -> None:
    for fn in ALL_FUNCTIONS:
        for decode in (messages.decode_request, messages.decode_reply):
            dec_values = decode(fn, data, strict=False)
            assert set(dec_values) == {f.name for f in (fn.request if decode is messages.decode_request
                                                         else fn.reply)}


def _valid_messages() -> list[bytes]:
    a, b = tensor.Tensor((4, 3), name="a"), tensor.Tensor((4, 2), name="b")
    mm = tensor.Tensor((3, 2), op=tensor.OP_MUL_MAT, src=[a, b], buffer=7, name="mm")
    return [
        messages.encode_request("buffer_set_tensor", buffer=1, tensor=mm.to_rpc(), res_id=3, offset=0, size=24),
        messages.encode_request("device_supports_op", op=mm),
        messages.encode_reply("device_get_name", name="CPU"),
        messages.encode_reply("device_get_props", **{k: True for k in
                              ("async", "host_buffer", "buffer_from_host_ptr", "events", "mmap_support")}),
        tensor.Graph([mm]).serialize(),
    ]


@settings(max_examples=300)
@given(st.sampled_from(_valid_messages()), st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)),
                                                     max_size=8), st.integers(0, 4000))
def test_fuzz_mutated_valid_messages(msg: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(msg)
    for pos, val in flips:
        if data:
            data[pos % len(data)] = val
    _decode_everything(bytes(data[: cut % (len(data) + 1)]))


def test_handshake_round_trip() -> None:
    data = messages.encode_handshake(reply_res_id=4)
    assert messages.describe(data) == {"reply_res_id": 4, "command": "HANDSHAKE", "guest_version": "0.2"}
    reply = Encoder()
    reply.u32(0)
    reply.u32(3)
    assert messages.decode_handshake_reply(protocol.HANDSHAKE_MAGIC, reply.getvalue()) == (0, 3)
    with pytest.raises(ApirDecodeError):
        messages.decode_handshake_reply(7, reply.getvalue())


def test_describe_a_forward_command() -> None:
    t = tensor.RpcTensor(id=3, name=b"w")
    data = messages.encode_forward("buffer_get_tensor", reply_res_id=1, buffer=2, tensor=t, res_id=5, offset=0,
                                   size=16)
    got = messages.describe(data)
    assert got["function"] == "buffer_get_tensor"
    assert got["request"]["tensor"]["name"] == "w" and got["request"]["size"] == 16
    assert messages.describe(messages.encode_command(protocol.CommandType.FORWARD, 99, 1))["function"] == (
        "unknown index 99")


def test_cli_decode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from typer.testing import CliRunner

    from apirctl.cli import app

    data = messages.encode_forward("buffer_clear", reply_res_id=9, buffer=1, value=7)
    result = CliRunner().invoke(app, ["apir", "decode", data.hex(), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["request"] == {"buffer": 1, "value": 7}
    (tmp_path / "cmd.bin").write_bytes(data[:-2])
    result = CliRunner().invoke(app, ["apir", "decode", f"@{tmp_path / 'cmd.bin'}"])
    assert result.exit_code != 0 and "cannot decode" in str(result.exception)


def test_largest_inline_request_still_fits_the_command_buffer() -> None:
    # get_alloc_size with a view source and all 10 sources: header + handle + 12 structs + buffer handle.
    srcs = [tensor.Tensor((2,), name=f"s{i}") for i in range(tensor.MAX_SRC)]
    op = tensor.Tensor((2,), op=tensor.OP_ADD, src=srcs, view_src=srcs[0], buffer=1, name="big")
    enc = Encoder()
    enc.raw(messages.encode_forward("buffer_type_get_alloc_size", reply_res_id=1, buft=2, op=op))
    assert len(enc) == protocol.COMMAND_HEADER_SIZE + 8 + 12 * tensor.GGML_TENSOR_SIZE + 8 == 4060
    assert enc.fits(protocol.COMMAND_BUFFER_SIZE)
    enc.raw(bytes(40))
    assert not enc.fits(protocol.COMMAND_BUFFER_SIZE)
