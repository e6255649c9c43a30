"""A kept graph updated by a delta under llama-server load (llama_patches 0021).

Each time a request joins or leaves the batch, llama.cpp's graph has the same nodes in other shapes.
Without APIR_FEATURE_GRAPH_DELTA the host's kept graphs, keyed on the whole serialization, missed and
the whole graph was sent again; with it the frontend sends the changed records only. The real
llama-server with 8 streams that join and leave at different steps, through the real apir-host on the
CPU: every request's greedy tokens are native's with the delta on and off, and apir-host's own trace,
read by `apirctl apir trace --summary`, shows the deltas and fewer graph bytes per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apirctl.apir import extensions
from apirctl.apir import trace as apir_trace
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import apir_host, workdir  # noqa: F401 (workdir: a fixture)
from tests.remoting.test_apir_op_classes import plan, run_load
from tests.support import build_servers
from tests.support.bench_helpers import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STREAMS = 8


def test_eight_streams_that_join_and_leave_take_deltas_and_keep_native_tokens(
        llama_build: llamacpp.Build, demo_model: Path, workdir: Path) -> None:  # noqa: F811
    flags = ["-np", str(STREAMS), "-c", str(128 * STREAMS)]
    requests = plan(STREAMS)
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", *flags]) as (_, url, _log):
        native = run_load(url, requests)

    summaries = {}
    for mode, env in (("whole", {"GGML_VIRTGPU_GRAPH_DELTA": "0"}), ("delta", {})):
        trace = workdir / f"trace-{mode}.bin"
        with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, _host_log):
            remote_env = {"GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0", **env}
            with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "99", *flags],
                                            remote_env) as (_, url, _log):
                assert run_load(url, requests) == native, mode
        records = apir_trace.read(trace.read_bytes())
        granted = [g for r in records if (g := r.features_granted()) is not None]
        assert granted and all(bool(g & extensions.FEATURE_GRAPH_DELTA) == (mode == "delta") for g in granted)
        done = run_cli("apir", "trace", str(trace), "--summary", "--json")
        assert done.returncode == 0, done.stderr
        summaries[mode] = json.loads(done.stdout)["summary"]
        text = run_cli("apir", "trace", str(trace), "--summary")
        assert "KB per compute" in text.stdout and "forwarded calls per compute" in text.stdout

    whole, delta = summaries["whole"], summaries["delta"]
    assert whole["graph_cache"]["delta"] == 0 and whole["graph_cache"]["sent"] >= 4, whole
    # the batch changed shape many times, and the host took those changes as deltas
    assert delta["graph_cache"]["delta"] >= 4, delta
    assert delta["graph_cache"]["delta_refused"] == 0, delta
    assert delta["graph_cache"]["sent"] < whole["graph_cache"]["sent"], (whole, delta)
    # a change is 112 bytes, a whole record 328, and the weights' records never change: under half
    # (0.44 on the demo model)
    assert delta["graph_bytes_per_compute"] < 0.7 * whole["graph_bytes_per_compute"], (whole, delta)
    # a delta rides in the step's one call: no more synchronous calls per step than without it
    assert delta["calls_per_compute"] <= whole["calls_per_compute"] * 1.05, (whole, delta)
