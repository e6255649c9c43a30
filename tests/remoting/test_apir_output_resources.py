"""A compute's outputs written where llama.cpp reads them (llama_patches 0029).

The frontend has a host buffer type whose buffers are shared resources (llama.cpp's output buffer is
one), and a compute's call waits for llama.cpp's reads of its outputs: an output read whole into such a
buffer is named there in the call (APIR_FEATURE_OUTPUT_RESOURCES), and the host writes it in place of
the frontend copying it out of the outputs' resource. The real llama-server with streams that join and
leave through the real apir-host on the CPU keeps native's greedy tokens with and without it, and
apir-host's own trace shows the outputs named in another resource only with it. The sanitized apir-host
writes outputs into the resources named and refuses, before anything is written or computed, an output
past its resource or in one the client does not have.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from apirctl.apir import extensions
from apirctl.apir import trace as apir_trace
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import (  # noqa: F401 (asan_host, workdir: fixtures)
    DATA_RES,
    FORWARD,
    FORWARD_BASE,
    OUT_RES,
    WRITES_AT,
    X_AT,
    Y_AT,
    GraphRunClient,
    apir_host,
    asan_host,
    workdir,
)
from tests.remoting.test_apir_op_classes import native_tokens_through_apir
from tests.support.bench_helpers import run_cli

pytestmark = pytest.mark.integration

PLACED_RES = 9


def placed_outputs(trace: Path) -> tuple[int, int]:
    """(computed graph runs with outputs, those with an output named in a resource other than the run's
    outputs' one)."""
    runs = placed = 0
    for record in apir_trace.read(trace.read_bytes()):
        found = record.graph_run()
        if found is None or found[1] != extensions.RESULT_DONE or not found[0].outputs:
            continue
        run = found[0]
        runs += 1
        placed += any(o.res_id not in (None, run.out_res_id) for o in run.outputs)
    return runs, placed


@pytest.mark.slow
def test_streams_that_join_and_leave_keep_native_tokens_with_outputs_written_in_place(
        llama_build: llamacpp.Build, demo_model: Path, workdir: Path) -> None:  # noqa: F811
    traces = native_tokens_through_apir(llama_build, demo_model, workdir, 4, 256,
                                        {"copied": {"GGML_VIRTGPU_OUTPUT_RESOURCES": "0"}, "in_place": {}},
                                        extensions.FEATURE_OUTPUT_RESOURCES, "in_place")
    runs, placed = placed_outputs(traces["copied"])
    assert runs >= 24 and placed == 0, (runs, placed)
    runs, placed = placed_outputs(traces["in_place"])
    # every step's logits go to llama.cpp's output buffer (the normed embeddings, also marked an output, are
    # not read and stay in the outputs' resource); a compute whose logits nobody reads keeps them there too
    assert runs >= 24 and placed >= runs - 4, (runs, placed)
    # and what a user sees of it
    for mode, trace in traces.items():
        done = run_cli("apir", "trace", str(trace), "--summary", "--json")
        assert done.returncode == 0, done.stderr
        cache = json.loads(done.stdout)["summary"]["graph_cache"]
        assert (cache["outputs_placed"] > 0) == (mode == "in_place"), (mode, cache)
    text = run_cli("apir", "trace", str(traces["in_place"]), "--summary").stdout
    assert "outputs written where the caller reads them" in text


def _run(c: GraphRunClient, outputs: tuple[extensions.Output, ...], x: list[float], y: list[float],
         graph: bytes = b"") -> int:
    """One EXT_GRAPH_RUN of graph 1 (sent when `graph` is given) with x and y written: the forward return."""
    data = c.maps[DATA_RES]
    data[0:len(graph)] = graph
    xs, ys, _ = c.graph()
    writes = c.inputs(xs, ys)
    block = extensions.encode_writes(writes)
    data[WRITES_AT:WRITES_AT + len(block)] = block
    data[X_AT:X_AT + 64] = struct.pack("<16f", *x)
    data[Y_AT:Y_AT + 64] = struct.pack("<16f", *y)
    request = extensions.GraphRun(1, DATA_RES, len(graph), WRITES_AT, len(writes), OUT_RES, outputs,
                                  output_resources=True)
    ret, reply = c.call(FORWARD, extensions.GRAPH_RUN, request.encode())
    assert ret != FORWARD_BASE or extensions.decode_graph_run_reply(reply)[0] == extensions.RESULT_DONE
    return ret


def test_apir_host_writes_outputs_where_they_are_named_and_refuses_what_it_must(
        asan_host: Path, llama_build: llamacpp.Build, workdir: Path) -> None:  # noqa: F811
    ones, tens = [1.0 + i for i in range(16)], [10.0 * i for i in range(16)]
    with apir_host(asan_host, llama_build, workdir) as (host, path, log):
        # not granted without EXT_GRAPH_RUN
        c = GraphRunClient(path)
        ret, reply = c.call(FORWARD, extensions.GET_FEATURES,
                            extensions.encode_features_request(extensions.FEATURE_OUTPUT_RESOURCES))
        assert ret == FORWARD_BASE and extensions.decode_features(reply) == 0
        c.close()

        for name, bad in (("past its resource", extensions.Output(0, 4096 - 32, PLACED_RES)),
                          ("a resource the client does not have", extensions.Output(0, 0, 77)),
                          ("an offset that wraps", extensions.Output(0, (1 << 64) - 32, PLACED_RES)),
                          (None, None)):
            c = GraphRunClient(path)
            c.shmem(PLACED_RES, 4096)
            wanted = extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_OUTPUT_RESOURCES
            ret, reply = c.call(FORWARD, extensions.GET_FEATURES, extensions.encode_features_request(wanted))
            assert ret == FORWARD_BASE and extensions.decode_features(reply) == wanted
            placed = c.maps[PLACED_RES]
            placed[0:4096] = b"\xee" * 4096
            graph = c.graph()[2]
            if bad is None:
                # the output in the named resource, at the offset named, and nowhere else
                assert _run(c, (extensions.Output(0, 1024, PLACED_RES),), ones, tens, graph) == FORWARD_BASE
                sums = [a + b for a, b in zip(ones, tens, strict=True)]
                assert list(struct.unpack_from("<16f", placed, 1024)) == sums
                assert bytes(placed[0:1024]) == b"\xee" * 1024 and bytes(placed[1088:4096]) == b"\xee" * 3008
                # and in the outputs' resource when it names that one
                assert _run(c, (extensions.Output(0, 0, OUT_RES),), tens, tens) == FORWARD_BASE
                assert list(struct.unpack_from("<16f", c.maps[OUT_RES], 0)) == [2 * b for b in tens]
                c.close()
                continue
            assert _run(c, (bad,), ones, tens, graph) == FORWARD_BASE + 1, name
            assert bytes(placed[0:4096]) == b"\xee" * 4096, name
            assert c.closed_by_host(), name
            c.close()
        assert host.poll() is None, log.read_text(errors="replace")[-3000:]
