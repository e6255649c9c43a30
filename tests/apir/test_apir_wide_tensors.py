"""64-bit shapes and strides on the wire (llama_patches 0014), against the real backend library.

A client that asks EXT_GET_FEATURES for FEATURE_WIDE_TENSORS and is granted it sends every tensor as
`apir_rpc_tensor_wide`: a shape or stride past 32 bits reaches the host's backend as it was, and the
host checks it as it checks every tensor (sums and products that would wrap are refused, the client
answered an error, the library still serving). A client that does not ask, as upstream's frontend
and apirctl's from before, keeps the narrow records.
"""

from __future__ import annotations

import struct

import pytest

from apirctl.apir import extensions, tensor
from apirctl.apir.session import BackendProcess, CallFailed
from apirctl.apir.tensor import FLAG_INPUT, FLAG_OUTPUT, OP_ADD, Graph, RpcTensor, Tensor

TYPE_I32 = 26  # ggml.h
OP_GET_ROWS = 40

pytestmark = pytest.mark.integration

Libs = tuple  # (backend library, GGML library, registration symbol)
ROWS = 1 << 33  # rows of a stride-0 view: 2^33 in ne[1], 16 bytes of memory


def _session(proc: BackendProcess, libs: Libs, wanted: int | None) -> int:
    """Load the library, negotiate, allocate a 4 KiB buffer of its device; the buffer's id."""
    assert proc.initialize(*libs) == 6
    proc.negotiate(wanted)
    buft = proc.call("device_get_buffer_type")[0]["buft"]
    return int(proc.call("buffer_type_alloc_buffer", buft=buft, size=4096)[0]["buffer"])


def _transfer(proc: BackendProcess, fn: str, buffer: int, t: RpcTensor, size: int, data: bytes = b"") -> bytes:
    res = proc.shmem(max(size, 1))
    if data:
        proc.shmem_write(res, data)
    proc.call(fn, buffer=buffer, tensor=t, res_id=res, offset=0, size=size)
    return proc.shmem_read(res, size)


@pytest.mark.parametrize("wanted, expected", [
    (None, extensions.FEATURE_GRAPH_RUN),  # a frontend from before the request carried them
    (0, 0),
    (extensions.FEATURE_GRAPH_RUN, extensions.FEATURE_GRAPH_RUN),
    (extensions.FEATURE_WIDE_TENSORS, extensions.FEATURE_WIDE_TENSORS),
    ((1 << 64) - 1, extensions.FEATURES),  # bits the library does not know are not granted
    # the delta updates EXT_GRAPH_RUN's graphs: granted with it, not alone (0021)
    (extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_GRAPH_DELTA,
     extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_GRAPH_DELTA),
    (extensions.FEATURE_GRAPH_DELTA, 0),
    (extensions.FEATURES & ~extensions.FEATURE_GRAPH_DELTA, extensions.FEATURES & ~extensions.FEATURE_GRAPH_DELTA),
    # a state save's reads in one call (0028): granted when asked, and only then
    (extensions.FEATURE_TENSORS_GET, extensions.FEATURE_TENSORS_GET),
    (extensions.FEATURES & ~extensions.FEATURE_TENSORS_GET, extensions.FEATURES & ~extensions.FEATURE_TENSORS_GET),
])
def test_features_are_granted_as_asked(backend_libs: Libs, wanted: int | None, expected: int) -> None:
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        request = b"" if wanted is None else extensions.encode_features_request(wanted)
        ret, reply, _ = proc.dispatch_raw(extensions.GET_FEATURES, request)
        assert ret == 0 and extensions.decode_features(reply) == expected


def test_a_cut_features_request_is_refused(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        assert proc.dispatch_raw(extensions.GET_FEATURES, b"\x02\x00\x00\x00")[0] == 1
        assert proc.negotiate(extensions.FEATURES) == extensions.FEATURES  # and the library goes on


def test_a_wide_tensor_crosses_intact_once_negotiated(backend_libs: Libs) -> None:
    """A view of 2^33 rows of stride 0 over 16 bytes: set, get and copy through the library. A narrow
    record would have cut ne[1] to 0 and the transfers been refused as too large. A graph that takes
    rows of it by index is refused since the node checks are shared with ggml-rpc's server (0015: a
    computing node's tensors have distinct elements, so no stride of 0), and the library serves on."""
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, extensions.FEATURES)
        assert proc.wide_tensors
        x = Tensor((4, ROWS), name="x", buffer=buffer, offset=0, strides=(4, 0, 0, 0))
        assert not x.to_rpc().fits_narrow() and x.nbytes == 16
        xs = struct.pack("<4f", 1, 2, 3, 4)
        _transfer(proc, "buffer_set_tensor", buffer, x.to_rpc(), 16, xs)
        assert _transfer(proc, "buffer_get_tensor", buffer, x.to_rpc(), 16) == xs
        copy = Tensor((4, ROWS), name="copy", buffer=buffer, offset=64, strides=(4, 0, 0, 0))
        assert proc.call("buffer_cpy_tensor", buffer=buffer, src=x.to_rpc(), dst=copy.to_rpc())[0]["copied"]
        assert _transfer(proc, "buffer_get_tensor", buffer, copy.to_rpc(), 16) == xs

        ids = Tensor((2,), type=TYPE_I32, name="ids", buffer=buffer, offset=128, flags=FLAG_INPUT)
        rows = Tensor((4, 2), op=OP_GET_ROWS, src=[x, ids], name="rows", buffer=buffer, offset=256,
                      flags=FLAG_OUTPUT)
        _transfer(proc, "buffer_set_tensor", buffer, ids.to_rpc(), 8, struct.pack("<2i", 7, (1 << 31) - 1))
        graph = Graph([rows]).serialize(wide=True)
        res = proc.shmem(len(graph))
        proc.shmem_write(res, graph)
        ret, reply, _ = proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))
        assert ret != 0 or struct.unpack_from("<i", reply)[0] != 0  # not GGML_STATUS_SUCCESS
        assert _transfer(proc, "buffer_get_tensor", buffer, x.to_rpc(), 16) == xs


def test_a_wide_write_of_graph_run_crosses_intact(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, extensions.FEATURES)
        x = Tensor((4, ROWS), name="x", buffer=buffer, offset=512, strides=(4, 0, 0, 0))
        res = proc.shmem(4096)
        records = extensions.encode_writes([extensions.Write(buffer, x.to_rpc(), 0, 16, 1024)], wide=True)
        assert len(records) == extensions.WRITE_SIZE_WIDE
        proc.shmem_write(res, records, 0)
        proc.shmem_write(res, struct.pack("<4f", 5, 6, 7, 8), 1024)
        run = extensions.GraphRun(0, res, writes_offset=0, n_writes=1)
        ret, reply, _ = proc.dispatch_raw(extensions.GRAPH_RUN, run.encode())
        assert ret == 0 and extensions.decode_graph_run_reply(reply) == (extensions.RESULT_DONE, 0)
        assert _transfer(proc, "buffer_get_tensor", buffer, x.to_rpc(), 16) == struct.pack("<4f", 5, 6, 7, 8)


def test_a_client_that_did_not_ask_keeps_the_narrow_records(backend_libs: Libs) -> None:
    """Upstream's frontend never asks; apirctl's from before asks with an empty request."""
    for wanted in (None, extensions.FEATURE_GRAPH_RUN):
        with BackendProcess() as proc:
            buffer = _session(proc, backend_libs, wanted)
            assert not proc.wide_tensors
            t = Tensor((4,), name="t", buffer=buffer, offset=0)
            data = struct.pack("<4f", 1, 2, 3, 4)
            _transfer(proc, "buffer_set_tensor", buffer, t.to_rpc(), 16, data)
            assert _transfer(proc, "buffer_get_tensor", buffer, t.to_rpc(), 16) == data
            # a wide record is not what this client's requests hold: cut short, refused
            proc.wide_tensors = True
            with pytest.raises(CallFailed):
                _transfer(proc, "buffer_get_tensor", buffer, t.to_rpc(), 16)


HOSTILE = [
    ([1 << 62, 4, 1, 1], [4, 16, 64, 64]),     # 2^64 elements: the count wraps
    ([1, 1 << 61, 1, 1], [4, 1 << 4, 0, 0]),   # (ne1 - 1) * nb1 wraps 64 bits
    ([4, 2, 1, 1], [4, (1 << 64) - 4, 0, 0]),  # a stride that wraps the extent
    ([4, 2, 2, 1], [4, 1 << 63, 1 << 63, 0]),  # two steps whose sum wraps
    ([-1, 1, 1, 1], [4, 4, 4, 4]),             # a negative dimension
    ([4, 1 << 33, 1, 1], [4, 16, 0, 0]),       # 128 GiB, in a 4 KiB buffer
]


@pytest.mark.parametrize("ne, nb", HOSTILE)
def test_hostile_wide_records_are_refused_and_the_library_goes_on(backend_libs: Libs, ne: list[int],
                                                                  nb: list[int]) -> None:
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, extensions.FEATURES)
        bad = RpcTensor(id=1, buffer=buffer, ne=ne, nb=nb, data=64, name=b"bad")
        with pytest.raises(CallFailed):
            _transfer(proc, "buffer_set_tensor", buffer, bad, 16, bytes(16))
        good = Tensor((4,), name="good", buffer=buffer, offset=0)
        with pytest.raises(CallFailed):
            proc.call("buffer_cpy_tensor", buffer=buffer, src=bad, dst=good.to_rpc())
        # in a graph, and in a write of EXT_GRAPH_RUN
        node = RpcTensor(id=2, buffer=buffer, ne=[4, 1, 1, 1], nb=[4, 16, 16, 16], op=OP_ADD, src=[1, 1],
                         flags=tensor.FLAG_COMPUTE, data=128, name=b"node")
        graph = struct.pack("<IQI", 1, 2, 2) + bad.to_bytes(wide=True) + node.to_bytes(wide=True)
        res = proc.shmem(4096)
        proc.shmem_write(res, graph)
        assert proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))[0] == 1
        proc.shmem_write(res, extensions.encode_writes([extensions.Write(buffer, bad, 0, 16, 2048)], wide=True))
        assert proc.dispatch_raw(extensions.GRAPH_RUN, extensions.GraphRun(0, res, n_writes=1).encode())[0] == 1
        # the library still serves the client
        data = struct.pack("<4f", 1, 2, 3, 4)
        _transfer(proc, "buffer_set_tensor", buffer, good.to_rpc(), 16, data)
        assert _transfer(proc, "buffer_get_tensor", buffer, good.to_rpc(), 16) == data


def test_hostile_wide_view_offsets_are_refused(backend_libs: Libs) -> None:
    """A view whose offset plus size would wrap: refused like any view outside its source."""
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, extensions.FEATURES)
        src = RpcTensor(id=1, buffer=buffer, ne=[4, 1, 1, 1], nb=[4, 16, 16, 16], data=0, name=b"src")
        view = RpcTensor(id=2, buffer=buffer, ne=[4, 1, 1, 1], nb=[4, 16, 16, 16], view_src=1,
                         view_offs=(1 << 64) - 8, data=0, name=b"view")
        node = RpcTensor(id=3, buffer=buffer, ne=[4, 1, 1, 1], nb=[4, 16, 16, 16], op=OP_ADD, src=[2, 1],
                         flags=tensor.FLAG_COMPUTE, data=64, name=b"node")
        graph = struct.pack("<IQI", 1, 3, 3) + b"".join(t.to_bytes(wide=True) for t in (src, view, node))
        res = proc.shmem(4096)
        proc.shmem_write(res, graph)
        assert proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))[0] == 1
        view.view_offs = 0
        graph = struct.pack("<IQI", 1, 3, 3) + b"".join(t.to_bytes(wide=True) for t in (src, view, node))
        proc.shmem_write(res, graph)
        assert proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))[0] == 0


def test_a_change_of_width_drops_the_kept_graphs(backend_libs: Libs) -> None:
    """The same bytes read in the other width are other tensors: a graph kept from before is not reused."""
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, extensions.FEATURES)
        x = Tensor((4,), name="x", buffer=buffer, offset=0)
        out = Tensor((4,), op=OP_ADD, src=[x, x], name="out", buffer=buffer, offset=64)
        graph = Graph([out]).serialize(wide=True)
        res = proc.shmem(len(graph))
        proc.shmem_write(res, graph)
        assert proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))[0] == 0
        assert proc.negotiate(extensions.FEATURE_GRAPH_RUN) == extensions.FEATURE_GRAPH_RUN
        # the wide bytes again, now read as narrow records: refused, not answered from the cache
        assert proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))[0] == 1
