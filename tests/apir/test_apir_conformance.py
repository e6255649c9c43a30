"""Byte-for-byte conformance with upstream's C codec, compiled from the pinned headers.

The harness (tests/apir/harness.cpp) encodes with upstream's `apir_encode_*` and decodes with its
`apir_decode_*`; the backend library's own checked decoder (`apir_graph_from_wire`) rebuilds our
graphs. Values come from hypothesis, edge values included.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from apirctl.apir import extensions, protocol, table, tensor
from apirctl.apir.graph_check import matmul_add_case
from apirctl.apir.wire import Decoder, Encoder

pytestmark = pytest.mark.integration
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


def _enc(fn: str, *args: object) -> str:
    enc = Encoder()
    getattr(enc, fn)(*args)
    return enc.getvalue().hex()


def test_struct_layouts_match_the_compiler(harness) -> None:  # type: ignore[no-untyped-def]
    got = json.loads(harness.ask("layout"))
    for name, struct in (("apir_rpc_tensor", tensor.RpcTensorC), ("apir_rpc_tensor_wide", tensor.RpcTensorWideC),
                         ("ggml_tensor", tensor.GgmlTensorC)):
        c_layout = got[name]
        assert c_layout.pop("size") == __import__("ctypes").sizeof(struct)
        assert {k: tuple(v) for k, v in c_layout.items()} == tensor.layout(struct)
    assert got["apir_graph_run_write"]["size"] == extensions.WRITE_SIZE == 336
    assert got["apir_graph_run_write_wide"]["size"] == extensions.WRITE_SIZE_WIDE == 360


def test_constants_match_the_headers(harness) -> None:  # type: ignore[no-untyped-def]
    c = json.loads(harness.ask("constants"))
    assert (c["PROTOCOL_MAJOR"], c["PROTOCOL_MINOR"], c["HANDSHAKE_MAGIC"]) == (
        protocol.PROTOCOL_MAJOR, protocol.PROTOCOL_MINOR, protocol.HANDSHAKE_MAGIC)
    assert {m.name: m.value for m in protocol.CommandType} == {k: c[k] for k in ("HANDSHAKE", "LOADLIBRARY", "FORWARD")}

    def prefixed(prefix: str) -> dict[str, int]:
        return {k[len(prefix):]: v for k, v in c.items() if k.startswith(prefix) and k != "FORWARD_INDEX_INVALID"}

    assert {m.name: m.value for m in protocol.LoadLibraryCode} == prefixed("LOAD_")
    assert {m.name: m.value for m in protocol.ForwardCode} == prefixed("FORWARD_")
    assert {m.name: m.value for m in protocol.BackendInitCode} == prefixed("INIT_")
    assert {m.name: m.value for m in protocol.GgmlStatus} == prefixed("STATUS_")
    assert c["FORWARD_INDEX_INVALID"] == protocol.FORWARD_INDEX_INVALID
    assert c["DISPATCH_TABLE_COUNT"] == table.dispatch_table_count()
    assert (c["TYPE_F32"], c["OP_NONE"], c["OP_ADD"], c["OP_MUL"], c["OP_MUL_MAT"]) == (
        tensor.TYPE_F32, tensor.OP_NONE, tensor.OP_ADD, tensor.OP_MUL, tensor.OP_MUL_MAT)
    assert (c["FLAG_INPUT"], c["FLAG_OUTPUT"], c["FLAG_COMPUTE"]) == (
        tensor.FLAG_INPUT, tensor.FLAG_OUTPUT, tensor.FLAG_COMPUTE)
    assert (c["MAX_DIMS"], c["MAX_SRC"], c["MAX_OP_PARAMS"], c["MAX_NAME"]) == (
        tensor.MAX_DIMS, tensor.MAX_SRC, tensor.MAX_OP_PARAMS, tensor.MAX_NAME)


SCALARS = [("u8", "u8", st.integers(0, 255)), ("bool", "bool", st.booleans()), ("u32", "u32", U32),
           ("i32", "i32", I32), ("u64", "u64", U64), ("size", "size", U64), ("uintptr", "handle", U64),
           ("buft_handle", "handle", U64), ("buf_handle", "handle", U64), ("array_size", "array_size", U64),
           ("res_id", "u32", U32), ("status", "i32", st.sampled_from([-2, -1, 0, 1]))]


@pytest.mark.parametrize(("c_kind", "py_fn", "values"), SCALARS, ids=[s[0] for s in SCALARS])
@SETTINGS
@given(data=st.data())
def test_scalars_encode_identically(harness, c_kind: str, py_fn: str, values, data) -> None:  # type: ignore[no-untyped-def]
    value = data.draw(values)
    assert harness.ask(f"enc {c_kind} {int(value)}") == _enc(py_fn, value)


@pytest.mark.parametrize("kind", ["u8", "bool", "u32", "i32", "u64", "size"])
@SETTINGS
@given(data=st.data())
def test_scalars_decode_identically_also_when_truncated(harness, kind: str, data) -> None:  # type: ignore[no-untyped-def]
    raw = data.draw(st.binary(min_size=0, max_size=10))
    c_value, fatal = harness.ask(f"dec {kind} {raw.hex() or '-'}").rsplit(" fatal=", 1)
    dec = Decoder(raw, strict=False)
    py_value = getattr(dec, kind)()
    if kind == "bool":  # C copies the byte into a bool: 2 stays 2 (undefined behaviour); we say True
        assert bool(int(c_value)) == py_value
    else:
        assert int(c_value) == int(py_value)
    assert bool(int(fatal)) == dec.fatal


@SETTINGS
@given(st.binary(max_size=300))
@example(b"")
@example(b"x" * 4000)
def test_blobs_encode_identically(harness, blob: bytes) -> None:  # type: ignore[no-untyped-def]
    assert harness.ask(f"enc blob {blob.hex() or '-'}") == _enc("blob", blob)


TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=200)


@SETTINGS
@given(TEXT)
@example("")
@example("x" * 5000)
def test_strings_encode_and_decode_identically(harness, text: str) -> None:  # type: ignore[no-untyped-def]
    raw = text.encode()
    c_bytes = harness.ask(f"enc string {raw.hex() or '-'}")
    assert c_bytes == _enc("string", text)
    c_text, fatal = harness.ask(f"dec string {c_bytes}").rsplit(" fatal=", 1)
    assert fatal == "0"
    assert (bytes.fromhex(c_text) if c_text != "-" else b"") == raw
    assert Decoder(bytes.fromhex(c_bytes)).string() == text


@pytest.mark.parametrize("kind", ["u64_array"])  # the one array kind the protocol's messages use
@SETTINGS
@given(data=st.data())
def test_arrays_encode_identically(harness, kind: str, data) -> None:  # type: ignore[no-untyped-def]
    values = data.draw(st.lists(U64, max_size=40))
    wire = [v & 0xFFFFFFFFFFFFFFFF for v in values]
    assert harness.ask(f"enc {kind} {len(values)} {' '.join(map(str, wire))}".rstrip()) == _enc(kind, values)


def rpc_tensors() -> st.SearchStrategy[tensor.RpcTensor]:
    return st.builds(
        tensor.RpcTensor, id=U64, type=U32, buffer=U64, ne=st.lists(U32, min_size=4, max_size=4),
        nb=st.lists(U32, min_size=4, max_size=4), op=U32, op_params=st.lists(I32, min_size=16, max_size=16),
        flags=I32, src=st.lists(U64, min_size=10, max_size=10), view_src=U64, view_offs=U64, data=U64,
        name=st.binary(min_size=0, max_size=63).map(lambda b: b.replace(b"\x00", b"_")))


def _fields(t: tensor.RpcTensor) -> str:
    nums = [t.id, t.type, t.buffer, *t.ne, *t.nb, t.op, *t.op_params, t.flags, *t.src, t.view_src, t.view_offs, t.data]
    return " ".join(map(str, nums)) + " " + (t.name.hex() or "-")


@SETTINGS
@given(rpc_tensors())
@example(tensor.RpcTensor(id=0, name=b"n" * 63, ne=[2**32 - 1] * 4, op_params=[-(2**31)] * 16))
def test_rpc_tensor_encodes_and_decodes_identically(harness, t: tensor.RpcTensor) -> None:  # type: ignore[no-untyped-def]
    c_hex = harness.ask(f"enc rpc_tensor {_fields(t)}")
    assert c_hex == t.to_bytes().hex()
    c_back, fatal = harness.ask(f"dec rpc_tensor {c_hex}").rsplit(" fatal=", 1)
    assert fatal == "0" and c_back == _fields(t)
    assert tensor.RpcTensor.from_bytes(bytes.fromhex(c_hex)) == t


def wide_rpc_tensors() -> st.SearchStrategy[tensor.RpcTensor]:
    return rpc_tensors().flatmap(lambda t: st.builds(
        lambda ne, nb: tensor.RpcTensor(**{**t.__dict__, "ne": ne, "nb": nb}),
        st.lists(I64, min_size=4, max_size=4), st.lists(U64, min_size=4, max_size=4)))


@SETTINGS
@given(wide_rpc_tensors())
@example(tensor.RpcTensor(id=1, ne=[2**63 - 1, -1, 2**32, 0], nb=[2**64 - 1, 2**32, 0, 1], name=b"w" * 63))
def test_wide_rpc_tensor_encodes_and_decodes_identically(harness, t: tensor.RpcTensor) -> None:  # type: ignore[no-untyped-def]
    c_hex = harness.ask(f"enc rpc_tensor_wide {_fields(t)}")
    assert c_hex == t.to_bytes(wide=True).hex()
    assert len(c_hex) == 2 * tensor.RPC_TENSOR_WIDE_SIZE
    c_back, fatal = harness.ask(f"dec rpc_tensor_wide {c_hex}").rsplit(" fatal=", 1)
    assert fatal == "0" and c_back == _fields(t)
    assert tensor.RpcTensor.from_bytes(bytes.fromhex(c_hex), wide=True) == t


@SETTINGS
@given(rpc_tensors())
def test_narrow_records_are_widened_as_the_host_reads_them(harness, t: tensor.RpcTensor) -> None:  # type: ignore[no-untyped-def]
    # the C frontend writes a narrow record from its wide one; the host widens it back: same values
    c_hex = harness.ask(f"enc rpc_tensor {_fields(t)}")
    assert c_hex == t.to_bytes().hex()
    assert harness.ask(f"dec rpc_tensor {c_hex}") == _fields(t) + " fatal=0"


def test_truncated_rpc_tensor_sets_the_flag_in_both(harness) -> None:  # type: ignore[no-untyped-def]
    data = tensor.RpcTensor(id=5).to_bytes()[:-1]
    assert harness.ask(f"dec rpc_tensor {data.hex()}") == "null fatal=1"
    dec = Decoder(data, strict=False)
    tensor.decode_rpc_tensor(dec)
    assert dec.fatal
    wide = tensor.RpcTensor(id=5).to_bytes(wide=True)
    assert harness.ask(f"dec rpc_tensor_wide {wide[:-1].hex()}") == "null fatal=1"
    # a narrow record is cut short for a client that reads wide ones
    assert harness.ask(f"dec rpc_tensor_wide {tensor.RpcTensor(id=5).to_bytes().hex()}") == "null fatal=1"


SHAPES = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@SETTINGS
@given(k=st.integers(1, 8), m=st.integers(1, 8), n=st.integers(2, 8), name=st.text("abcxyz_", max_size=63),
       params=st.lists(I32, max_size=16))
def test_backend_rebuilds_our_graphs(harness, k: int, m: int, n: int, name: str,  # type: ignore[no-untyped-def]
                                     params: list[int]) -> None:
    # the backend library's decoder (patch 0009) takes tensors in a buffer its client owns: the
    # harness's one buffer, by the id the library gave it
    buffer = int(harness.ask("buffer"))
    if len(params) > 1:  # a MUL_MAT's op parameter 1 is ggml's hint, and 0015 refuses one ggml lacks
        params = [params[0], 0, *params[2:]]
    a = tensor.Tensor((k, m), name="a", buffer=buffer, offset=0)
    b = tensor.Tensor((k, n), name="b", buffer=buffer, offset=256)
    mm = tensor.Tensor((m, n), op=tensor.OP_MUL_MAT, src=[a, b], name=name, op_params=params, buffer=buffer,
                       offset=512)
    c = tensor.Tensor((m, n), name="c", buffer=buffer, offset=768)
    v = tensor.Tensor((m, n - 1), view_src=c, view_offs=4 * m, name="v", strides=(4, 4 * m), buffer=buffer,
                      offset=768 + 4 * m)
    out = tensor.Tensor((m, n), op=tensor.OP_ADD, src=[mm, c], name="out", buffer=buffer, offset=1024)
    graph = json.loads(harness.ask(f"graph {tensor.Graph([mm, out, v]).serialize().hex()}"))
    assert graph["fatal"] == 0
    got = graph["nodes"]
    assert [g["op"] for g in got] == [tensor.OP_MUL_MAT, tensor.OP_ADD, tensor.OP_NONE]
    assert bytes.fromhex(got[2]["view_src"]) == b"c" and got[2]["view_offs"] == 4 * m
    assert got[2]["nb"][:2] == [4, 4 * m]
    assert bytes.fromhex(got[0]["name"]).decode() == name
    assert got[0]["ne"] == mm.ne and got[0]["nb"] == mm.nb
    assert got[0]["op_params"] == params + [0] * (16 - len(params))
    assert [bytes.fromhex(s["name"]) for s in got[0]["src"]] == [b"a", b"b"]
    assert [bytes.fromhex(s["name"]) for s in got[1]["src"]] == [name.encode(), b"c"]
    assert got[1]["src"][0]["op"] == tensor.OP_MUL_MAT  # the same node, shared, not a copy
    assert all(g["flags"] & tensor.FLAG_COMPUTE for g in got)


def _wide_graph(buffer: int) -> tuple[tensor.Graph, tensor.Tensor]:
    """Rows taken by index from a table whose last stride, over a dimension of one, is 2^40: no narrow
    record holds it, and the node checks take it (a stride of 0 over more than one element, as a view
    of 2^33 rows over 16 bytes has, is refused since the checks are shared with ggml-rpc's server)."""
    x = tensor.Tensor((4, 8), name="x", buffer=buffer, offset=0, strides=(4, 16, 128, 1 << 40))
    ids = tensor.Tensor((2,), type=26, name="ids", buffer=buffer, offset=192, flags=tensor.FLAG_INPUT)  # I32
    rows = tensor.Tensor((4, 2), op=40, src=[x, ids], name="rows", buffer=buffer, offset=256)  # GET_ROWS
    return tensor.Graph([rows]), x


def test_backend_rebuilds_wide_graphs_intact(harness) -> None:  # type: ignore[no-untyped-def]
    buffer = int(harness.ask("buffer"))
    graph, x = _wide_graph(buffer)
    with pytest.raises(ValueError, match="wide record"):
        graph.serialize()
    data = graph.serialize(wide=True)
    assert len(data) == 4 + 8 + 4 + 3 * tensor.RPC_TENSOR_WIDE_SIZE
    try:
        assert harness.ask("wide 1") == "ok"
        got = json.loads(harness.ask(f"graph {data.hex()}"))
        assert got["fatal"] == 0 and bytes.fromhex(got["nodes"][0]["src"][0]["name"]) == b"x"
        # the source as the backend got it: read back through a node that is the source itself
        leaf = json.loads(harness.ask(f"graph {tensor.Graph([x]).serialize(wide=True).hex()}"))
        assert leaf["fatal"] == 0
        assert leaf["nodes"][0]["ne"] == [4, 8, 1, 1] and leaf["nodes"][0]["nb"] == [4, 16, 128, 1 << 40]
        # the same bytes read as narrow records are refused, not misread
        assert harness.ask("wide 0") == "ok"
        assert json.loads(harness.ask(f"graph {data.hex()}"))["fatal"] == 1
    finally:
        harness.ask("wide 0")


@pytest.mark.parametrize("ne, nb", [
    ([1 << 62, 4, 1, 1], [4, 16, 64, 64]),              # 2^64 elements: the count wraps
    ([1, 1 << 61, 1, 1], [4, 1 << 4, 0, 0]),             # (ne1 - 1) * nb1 wraps 64 bits
    ([4, 2, 1, 1], [4, (1 << 64) - 4, 0, 0]),            # a stride that wraps the extent
    ([4, 2, 2, 1], [4, 1 << 63, 1 << 63, 0]),            # two steps whose sum wraps
    ([-1, 1, 1, 1], [4, 4, 4, 4]),                       # a negative dimension
    ([4, 1 << 33, 1, 1], [4, 16, 0, 0]),                 # fine, but 128 GiB: not in a 1 MiB buffer
])
def test_backend_refuses_wide_records_that_wrap_or_overflow(harness, ne: list[int],  # type: ignore[no-untyped-def]
                                                            nb: list[int]) -> None:
    buffer = int(harness.ask("buffer"))
    x = tensor.Tensor((4,), name="x", buffer=buffer, offset=0)
    bad = tensor.RpcTensor(id=x.id + 1, buffer=buffer, ne=ne, nb=nb, op=tensor.OP_ADD, src=[x.id, x.id],
                           flags=tensor.FLAG_COMPUTE, data=64, name=b"bad")
    enc = Encoder()
    enc.u32(1)
    enc.u64_array([bad.id])
    enc.u32(2)
    tensor.encode_rpc_tensor(enc, x.to_rpc(), wide=True)
    tensor.encode_rpc_tensor(enc, bad, wide=True)
    try:
        assert harness.ask("wide 1") == "ok"
        assert json.loads(harness.ask(f"graph {enc.getvalue().hex()}"))["fatal"] == 1
        good, _ = _wide_graph(buffer)
        assert json.loads(harness.ask(f"graph {good.serialize(wide=True).hex()}"))["fatal"] == 0  # still serving
    finally:
        harness.ask("wide 0")


def test_inline_buffer_handle_is_the_handle(harness) -> None:  # type: ignore[no-untyped-def]
    # Finding (docs/apir.md): upstream's apir_encode_ggml_buffer_handle wrote the address of its pointer
    # parameter, not the handle; the patch series makes it write the handle, as ours does.
    handle = 0x1234_5678_9ABC
    c_bytes = bytes.fromhex(harness.ask(f"enc inline_buf_handle {handle}"))
    assert c_bytes == handle.to_bytes(8, "little")
    assert _enc("handle", handle) == c_bytes.hex()


def _normalized(data: bytes, wide: bool = False) -> bytes:
    """Ids renumbered by first appearance; bytes upstream leaves uninitialised (struct padding, the
    name after its NUL) zeroed. What remains must be identical."""
    g = tensor.deserialize_graph(data, wide=wide)
    order: dict[int, int] = {}

    def renum(i: int) -> int:
        return 0 if i == 0 else order.setdefault(i, len(order) + 1)

    for t in g.tensors:
        t.id = renum(t.id)
        t.src = [renum(s) for s in t.src]
        t.view_src = renum(t.view_src)
        t.name = t.name.split(b"\x00", 1)[0]
    nodes = [renum(n) for n in g.nodes]
    enc = Encoder()
    enc.u32(len(nodes))
    enc.u64_array(nodes)
    enc.u32(len(g.tensors))
    for t in g.tensors:
        tensor.encode_rpc_tensor(enc, t, wide)
    return enc.getvalue()


@SETTINGS
@given(k=st.integers(1, 40), m=st.integers(1, 40), n=st.integers(1, 40))
def test_graph_bytes_match_upstreams_frontend_serializer(harness, k: int, m: int, n: int) -> None:  # type: ignore[no-untyped-def]
    upstream = bytes.fromhex(harness.ask(f"frontgraph {k} {m} {n}"))
    case = matmul_add_case(k, m, n, align=32)
    ours_tensors = [case.a, case.b, case.c, case.mm, case.out]
    offset = 0
    for t in ours_tensors:  # ggml-alloc places a context's tensors in creation order, aligned
        t.offset = offset
        offset += (t.nbytes + 31) // 32 * 32
    case.place(0xABCDEF000)  # the shim's host handle
    case.out.flags = 0  # the harness does not mark its output (ggml_set_output)
    ours = tensor.Graph([case.mm, case.out]).serialize()
    assert len(ours) == len(upstream)
    assert _normalized(ours) == _normalized(upstream)
    # and the wide records the frontend writes once the host granted them
    frontend_wide = bytes.fromhex(harness.ask(f"frontgraph {k} {m} {n} 1"))
    ours_wide = tensor.Graph([case.mm, case.out]).serialize(wide=True)
    assert len(ours_wide) == len(frontend_wide)
    assert _normalized(ours_wide, wide=True) == _normalized(frontend_wide, wide=True)
