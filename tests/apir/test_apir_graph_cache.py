"""The host library keeps the graphs a client computes, keyed on their whole serialization.

The same bytes again are the same graph: the library computes its kept nodes (so ggml-cuda replays the
CUDA graph it captured), never a stale or foreign one. These drive the real backend library on the CPU
through apirctl's ctypes host, and check every answer against numpy.
"""

from __future__ import annotations

import struct

import numpy as np

from apirctl.apir import tensor
from apirctl.apir.graph_check import MatmulAddCase, matmul_add_case
from apirctl.apir.session import BackendProcess

Libs = tuple  # (backend library, GGML library, registration symbol)


def _upload(proc: BackendProcess, case: MatmulAddCase) -> None:
    for t, data in case.inputs():
        raw = np.ascontiguousarray(data, dtype=np.float32).tobytes()
        res = proc.shmem(len(raw))
        proc.shmem_write(res, raw)
        proc.call("buffer_set_tensor", buffer=t.buffer, tensor=t.to_rpc(), res_id=res, offset=0, size=len(raw))


def _compute(proc: BackendProcess, graph: bytes) -> int:
    res = proc.shmem(len(graph))
    proc.shmem_write(res, graph)
    ret, _reply, _ = proc.dispatch_raw(22, struct.pack("<IQ", res, len(graph)))
    return ret


def _output(proc: BackendProcess, case: MatmulAddCase) -> bytes:
    res = proc.shmem(case.out.nbytes)
    proc.call("buffer_get_tensor", buffer=case.out.buffer, tensor=case.out.to_rpc(), res_id=res, offset=0,
              size=case.out.nbytes)
    return proc.shmem_read(res, case.out.nbytes)


def _result(proc: BackendProcess, case: MatmulAddCase) -> float:
    return case.relative_error(_output(proc, case))


def _case(proc: BackendProcess, buft: int) -> MatmulAddCase:
    case = matmul_add_case(16, 8, 4)
    case.place(proc.call("buffer_type_alloc_buffer", buft=buft, size=case.buffer_size)[0]["buffer"])
    return case


def test_a_kept_graph_computes_new_inputs(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        case = _case(proc, buft)
        graph = case.graph.serialize()
        for _ in range(3):  # the same bytes each time, new values in the tensors each time
            case.a_data, case.b_data, case.c_data = (np.random.default_rng().standard_normal(
                x.shape, dtype=np.float32) for x in (case.a_data, case.b_data, case.c_data))
            _upload(proc, case)
            assert _compute(proc, graph) == 0
            assert _result(proc, case) < 1e-5


def test_a_graph_that_differs_in_one_node_is_not_taken_for_a_kept_one(backend_libs: Libs) -> None:
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        case = _case(proc, buft)
        _upload(proc, case)
        assert _compute(proc, case.graph.serialize()) == 0
        assert _result(proc, case) < 1e-5
        # the same graph but for the last node's op: MUL instead of ADD
        case.out.op = tensor.OP_MUL
        assert _compute(proc, case.graph.serialize()) == 0
        got = np.frombuffer(_output(proc, case), dtype=np.float32).reshape(case.n, case.m)
        product = case.b_data.astype(np.float64) @ case.a_data.astype(np.float64).T
        assert np.allclose(got, product * case.c_data, rtol=1e-4, atol=1e-4)


def test_a_freed_buffer_never_reaches_a_kept_graph(backend_libs: Libs) -> None:
    # a kept graph holds the buffer: freeing it empties the cache, and the same bytes again name an id
    # that no longer exists; the next buffer gets a new id, so it cannot be mistaken for the old one
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        case = _case(proc, buft)
        _upload(proc, case)
        graph = case.graph.serialize()
        assert _compute(proc, graph) == 0
        old = case.out.buffer
        proc.call("buffer_free_buffer", buffer=old)
        new = proc.call("buffer_type_alloc_buffer", buft=buft, size=case.buffer_size)[0]["buffer"]
        assert new != old
        assert _compute(proc, graph) == 1  # refused: not computed from a stale graph
        case.place(new)
        _upload(proc, case)
        assert _compute(proc, case.graph.serialize()) == 0
        assert _result(proc, case) < 1e-5


def test_more_graphs_than_are_kept_all_compute_right(backend_libs: Libs) -> None:
    # more distinct graphs than the cache holds (4), computed in turn: each answer is its own
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        cases = [_case(proc, buft) for _ in range(6)]
        for case in cases:
            _upload(proc, case)
        for _ in range(2):
            for case in cases:
                assert _compute(proc, case.graph.serialize()) == 0
                assert _result(proc, case) < 1e-5


def test_two_clients_with_identical_graphs_share_nothing(backend_libs: Libs) -> None:
    # each client has its own child, table and cache: the second's identical bytes name its own ids
    with BackendProcess() as first, BackendProcess() as second:
        graphs = []
        for proc in (first, second):
            assert proc.initialize(*backend_libs) == 6
            buft = proc.call("device_get_buffer_type")[0]["buft"]
            case = _case(proc, buft)
            _upload(proc, case)
            graphs.append((proc, case))
        for proc, case in graphs:
            assert _compute(proc, case.graph.serialize()) == 0
            assert _result(proc, case) < 1e-5
