"""A kept graph updated by a delta (llama_patches 0021, EXT_GRAPH_DELTA), against the real backend library.

llama.cpp's graph for a batch that gained or lost a request has the same nodes, ops and sources in
other shapes. A client granted FEATURE_GRAPH_DELTA sends only the records that changed, by their index
in the serialization the host keeps; the host updates its graph in place and checks what changed as it
checks a new graph. Every delta it does not take (an index it does not have, another tensor, op or view
source, a shape past 32 bits without the wide records, a freed buffer, a node its checks refuse) is answered
RESULT_DELTA_REFUSED with nothing computed, and the graph is no longer kept: a later delta or run of the
id is answered unknown, and the graph sent whole computes right. Answers are checked against numpy.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from apirctl.apir import extensions
from apirctl.apir.session import BackendProcess
from apirctl.apir.tensor import FLAG_OUTPUT, OP_ADD, OP_MUL, OP_MUL_MAT, Graph, Tensor

OP_VIEW = 37  # ggml.h

pytestmark = pytest.mark.integration

Libs = tuple  # (backend library, GGML library, registration symbol)
K, M, N_MAX = 16, 8, 6
GRAPH_ID = 7
DELTA = extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_GRAPH_DELTA


class Batch:
    """out = A*B + C with N rows of B and C: the batch dimension, placed for N_MAX rows in one buffer."""

    def __init__(self, buffer: int, n: int) -> None:
        self.a = Tensor((K, M), name="A", buffer=buffer)
        self.b = Tensor((K, n), name="B", buffer=buffer)
        # C is the last n rows of a cache of N_MAX, as llama.cpp views its KV cache
        self.cache = Tensor((M, N_MAX), name="cache", buffer=buffer)
        self.c = Tensor((M, n), op=OP_VIEW, src=[self.cache], view_src=self.cache, name="C", buffer=buffer)
        self.mm = Tensor((M, n), op=OP_MUL_MAT, src=[self.a, self.b], name="A*B", buffer=buffer)
        self.out = Tensor((M, n), op=OP_ADD, src=[self.mm, self.c], name="A*B+C", flags=FLAG_OUTPUT, buffer=buffer)
        offset = 0
        for t, rows in ((self.a, M), (self.b, N_MAX), (self.cache, N_MAX), (self.mm, N_MAX), (self.out, N_MAX)):
            t.offset = offset
            offset += (rows * (K if t in (self.a, self.b) else M) * 4 + 63) // 64 * 64
        self.size = offset
        self.place_view()
        self.graph = Graph([self.mm, self.out])

    def place_view(self) -> None:
        assert self.cache.offset is not None
        self.c.view_offs = (N_MAX - self.n) * M * 4
        self.c.offset = self.cache.offset + self.c.view_offs

    @property
    def n(self) -> int:
        return self.b.shape[1]

    def resize(self, n: int) -> None:
        for t in (self.b, self.c, self.mm, self.out):
            t.shape = (t.shape[0], n)
        self.place_view()

    def records(self) -> list[bytes]:
        return [t.to_rpc().to_bytes(wide=True) for t in self.graph.tensors()]


def _session(proc: BackendProcess, libs: Libs, wanted: int) -> tuple[int, int]:
    assert proc.initialize(*libs) == 6
    proc.negotiate(wanted)
    buft = int(proc.call("device_get_buffer_type")[0]["buft"])
    return buft, int(proc.call("buffer_type_alloc_buffer", buft=buft, size=4096)[0]["buffer"])


def _upload(proc: BackendProcess, batch: Batch) -> np.ndarray:
    """Fresh inputs for the batch's rows; numpy's answer."""
    rng = np.random.default_rng()
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((batch.n, K), dtype=np.float32)
    c = rng.standard_normal((batch.n, M), dtype=np.float32)
    for t, data in ((batch.a, a), (batch.b, b), (batch.c, c)):
        raw = data.tobytes()
        res = proc.shmem(len(raw))
        proc.shmem_write(res, raw)
        proc.call("buffer_set_tensor", buffer=t.buffer, tensor=t.to_rpc(), res_id=res, offset=0, size=len(raw))
    return b.astype(np.float64) @ a.astype(np.float64).T + c


def _result(proc: BackendProcess, batch: Batch) -> np.ndarray:
    size = batch.n * M * 4
    res = proc.shmem(size)
    proc.call("buffer_get_tensor", buffer=batch.out.buffer, tensor=batch.out.to_rpc(), res_id=res, offset=0,
              size=size)
    return np.frombuffer(proc.shmem_read(res, size), dtype=np.float32).reshape(batch.n, M)


def _run(proc: BackendProcess, batch: Batch | None = None) -> int:
    """EXT_GRAPH_RUN of GRAPH_ID: the batch's graph sent whole, or (None) the kept one named."""
    graph = batch.graph.serialize(wide=proc.wide_tensors) if batch else b""
    res = proc.shmem(max(len(graph), 1))
    if graph:
        proc.shmem_write(res, graph)
    ret, reply, _ = proc.dispatch_raw(extensions.GRAPH_RUN, extensions.GraphRun(GRAPH_ID, res, len(graph)).encode())
    assert ret == 0
    return extensions.decode_graph_run_reply(reply)[0]


def _delta(proc: BackendProcess, changes: list[extensions.Change]) -> int:
    """EXT_GRAPH_DELTA of GRAPH_ID with `changes`: the result, or the dispatcher's code plus 100 when the
    call itself was refused."""
    data = extensions.encode_changes(changes)
    res = proc.shmem(max(len(data), 1))
    proc.shmem_write(res, data)
    ret, reply, _ = proc.dispatch_raw(extensions.GRAPH_DELTA,
                                      extensions.GraphRun(GRAPH_ID, res, n_changes=len(changes)).encode())
    return extensions.decode_graph_run_reply(reply)[0] if ret == 0 else 100 + ret


def _changes(batch: Batch, before: list[bytes]) -> list[extensions.Change]:
    """What changed since `before`, as the frontend sends it."""
    return [extensions.Change(i, t.to_rpc()) for i, (t, was) in enumerate(zip(batch.graph.tensors(), before,
                                                                               strict=True))
            if t.to_rpc().to_bytes(wide=True) != was]


def _kept(proc: BackendProcess, libs: Libs, wanted: int = extensions.FEATURES, n: int = 4) -> Batch:
    """A session whose host keeps the batch's graph (computed right) under GRAPH_ID."""
    _buft, buffer = _session(proc, libs, wanted)
    batch = Batch(buffer, n)
    expected = _upload(proc, batch)
    assert _run(proc, batch) == extensions.RESULT_DONE
    assert np.allclose(_result(proc, batch), expected, rtol=1e-4, atol=1e-4)
    return batch


def _dropped(proc: BackendProcess, batch: Batch) -> None:
    """The refused graph is no longer kept; sent whole, it computes right."""
    assert _run(proc) == extensions.RESULT_UNKNOWN_GRAPH
    expected = _upload(proc, batch)
    assert _run(proc, batch) == extensions.RESULT_DONE
    assert np.allclose(_result(proc, batch), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wanted", [extensions.FEATURES, DELTA])  # wide records, and narrow ones
def test_a_batch_that_grows_and_shrinks_is_computed_from_deltas(backend_libs: Libs, wanted: int) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs, wanted)
        for n in (2, 6, 1, 5, 4):
            before = batch.records()
            batch.resize(n)
            changes = _changes(batch, before)
            assert 0 < len(changes) < len(before)  # A keeps its record
            expected = _upload(proc, batch)
            assert _delta(proc, changes) == extensions.RESULT_DONE
            assert np.allclose(_result(proc, batch), expected, rtol=1e-4, atol=1e-4), n
            # the updated graph is the one kept: named again, it computes this batch
            expected = _upload(proc, batch)
            assert _run(proc) == extensions.RESULT_DONE
            assert np.allclose(_result(proc, batch), expected, rtol=1e-4, atol=1e-4), n


def test_a_delta_of_data_placement_moves_the_result(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs)
        before = batch.records()
        batch.out.offset = batch.size  # the result lands past the other tensors, in the same buffer
        expected = _upload(proc, batch)
        assert _delta(proc, _changes(batch, before)) == extensions.RESULT_DONE
        assert np.allclose(_result(proc, batch), expected, rtol=1e-4, atol=1e-4)


def _refused(proc: BackendProcess, batch: Batch, change: extensions.Change) -> None:
    """`change` (of a graph that otherwise took the new batch) is refused, the graph dropped."""
    assert _delta(proc, [change]) == extensions.RESULT_DELTA_REFUSED
    _dropped(proc, batch)


def test_a_delta_naming_a_tensor_the_graph_does_not_have_is_refused(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs)
        n_tensors = len(batch.graph.tensors())
        _refused(proc, batch, extensions.Change(n_tensors, batch.out.to_rpc()))
        _refused(proc, batch, extensions.Change(0xFFFFFFFF, batch.out.to_rpc()))
        # an index named twice
        out = len(batch.graph.tensors()) - 1
        assert _delta(proc, [extensions.Change(out, batch.out.to_rpc())] * 2) == extensions.RESULT_DELTA_REFUSED
        _dropped(proc, batch)


def _change_of(batch: Batch, t: Tensor, **fields: object) -> extensions.Change:
    """The change of tensor `t` with `fields` set; `t` itself is left as it was."""
    was = {name: getattr(t, name) for name in fields}
    for name, value in fields.items():
        setattr(t, name, value)
    change = extensions.Change(batch.graph.tensors().index(t), t.to_rpc())
    for name, value in was.items():
        setattr(t, name, value)
    return change


def test_a_delta_that_would_change_an_op_or_a_source_is_refused(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs)
        _refused(proc, batch, _change_of(batch, batch.out, op=OP_MUL))
        # C's source: the view of another tensor (what a change cannot say of other sources: it does
        # not carry them)
        _refused(proc, batch, _change_of(batch, batch.c, view_src=batch.b))
        # a change that claims another tensor's id at an index
        change = _change_of(batch, batch.out)
        _refused(proc, batch, extensions.Change(change.index, _change_of(batch, batch.mm).tensor))


@pytest.mark.parametrize("wanted", [DELTA, extensions.FEATURES])
def test_a_wide_stride_is_taken_only_from_a_client_with_wide_records(backend_libs: Libs, wanted: int) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs, wanted)
        # a 2^40 stride over a dimension of one: a valid tensor, which no narrow record holds
        change = _change_of(batch, batch.b, strides=(4, K * 4, batch.n * K * 4, 1 << 40))
        assert change.tensor.nb[3] == 1 << 40
        if not proc.wide_tensors:
            _refused(proc, batch, change)
            return
        expected = _upload(proc, batch)
        assert _delta(proc, [change]) == extensions.RESULT_DONE
        assert np.allclose(_result(proc, batch), expected, rtol=1e-4, atol=1e-4)


def test_a_delta_after_a_buffer_free_never_reaches_a_stale_graph(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs)
        buft = int(proc.call("device_get_buffer_type")[0]["buft"])
        before = batch.records()
        batch.resize(2)
        changes = _changes(batch, before)
        assert _delta(proc, changes) == extensions.RESULT_DONE
        old = batch.a.buffer
        proc.call("buffer_free_buffer", buffer=old)
        assert _delta(proc, changes) == extensions.RESULT_UNKNOWN_GRAPH  # the updated graph went with it
        new = int(proc.call("buffer_type_alloc_buffer", buft=buft, size=4096)[0]["buffer"])
        for t in batch.graph.tensors():
            t.buffer = new
        _dropped(proc, batch)
        # a change that names the freed buffer is not a tensor of the client
        _refused(proc, batch, _change_of(batch, batch.out, buffer=old))


def test_a_delta_that_leaves_a_node_the_checks_refuse_is_refused(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs)
        # the product's rows no longer those of its sources: MUL_MAT's shapes are checked again
        _refused(proc, batch, _change_of(batch, batch.mm, shape=(M, 3)))
        # a source past the end of its buffer
        _refused(proc, batch, _change_of(batch, batch.c, offset=4096 - 64))
        # a source whose rows overlap (a zero stride): the rules of every node that reads it
        _refused(proc, batch, _change_of(batch, batch.b, strides=(4, 0)))
        # a view past the end of its source, in the buffer
        _refused(proc, batch, _change_of(batch, batch.c, view_offs=N_MAX * M * 4, offset=batch.mm.offset))


def test_a_delta_is_refused_to_a_client_not_granted_it(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        batch = _kept(proc, backend_libs, extensions.FEATURES & ~extensions.FEATURE_GRAPH_DELTA)
        before = batch.records()
        batch.resize(2)
        assert _delta(proc, _changes(batch, before)) == 101  # the call refused: apir-host ends such a client


def test_a_cut_or_empty_delta_request_is_refused(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        _kept(proc, backend_libs)
        res = proc.shmem(64)
        cut = extensions.GraphRun(GRAPH_ID, res, n_changes=1).encode()[:22]
        assert proc.dispatch_raw(extensions.GRAPH_DELTA, cut)[0] == 1
        assert _delta(proc, []) == 101
        # more changes than the resource holds
        request = extensions.GraphRun(GRAPH_ID, res, n_changes=2).encode()
        assert proc.dispatch_raw(extensions.GRAPH_DELTA, request)[0] == 1
        # a delta with a serialization too
        request = extensions.GraphRun(GRAPH_ID, res, graph_size=struct.calcsize("<I"), n_changes=1).encode()
        assert proc.dispatch_raw(extensions.GRAPH_DELTA, request)[0] == 1
