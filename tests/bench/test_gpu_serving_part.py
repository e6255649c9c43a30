"""benchmarks/gpu_remoting.py's `serving` part (benchmarks/gpu_serving.py), run here end to end on the
CPU: the build's real llama-server natively, and as a client in a network namespace over ggml-rpc's
shared memory and over apir-host, each loaded by real streaming HTTP requests, with the rows, ratios,
step counts and the APIR host's trace the GPU machine's results files hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl.build import llamacpp

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.integration


def test_the_serving_part_measures_native_rpc_and_apir_side_by_side(llama_build: llamacpp.Build,
                                                                     demo_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_remoting.py"), "--sdist", str(tmp_path / "unused.tar.gz"),
         "--prebuilt", str(llama_build.bin_dir.parent), "--model", str(demo_model), "--shapes", "demo",
         "--work", str(tmp_path / "work"), "--out", str(out), "--parts", "serving", "--device", "CPU",
         "--server-threads", "1", "--concurrency", "2", "--serving-seconds", "4", "--serving-rounds", "1",
         "--serving-paths", "rpc", "apir", "--serving-rpc-profile", "--serving-lead-in", "2", "--deadline", "500"],
        capture_output=True, text=True, timeout=600, check=False)
    results = json.loads((out / "results.json").read_text())
    level = results["serving"]["demo"]["levels"].get("2")
    assert level is not None, f"{results['steps']}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert [row["row"] for row in level["sequence"]] == ["native", "rpc", "apir", "native"]
    assert results["serving"]["demo"]["setup"]["lead_in_s"] == 2
    for row in level["sequence"]:
        assert row["errors"] == 0 and row["tokens_per_s"] > 0, row
        # the two streams started one after the other over the lead-in, before the window opened
        first, second = row["stream_starts_s"]
        assert -2.1 <= first < second < 0 and second - first >= 0.8, row["stream_starts_s"]
        assert row["steps"]["steps"] > 0 and row["steps"]["ms_per_step"] > 0, row
        # every request's prompt was new to its server: evaluated whole, never answered from a slot's cache
        # (the last native row's requests would repeat the first's if the rows numbered them alike)
        assert row["requests_sent"] >= 2 and row["steps"]["prompt_tokens_per_request"] > 64, row
    for key in ("rpc", "apir"):
        assert level[key]["ratio"] > 0 and level[f"{key}_ratio_range"] == [level[key]["ratio"]] * 2
    trace = level["apir"]["host_trace"]
    assert trace["computes"] > 0 and trace["host_ms_per_compute"] > 0, trace
    # the profiled rpc row: a pair of its own, both ends' whole connections, the steps' graph computes
    profiled = level["rpc_profiled"]
    assert profiled["row"] == "rpc_profiled" and profiled["errors"] == 0 and profiled["tokens_per_s"] > 0
    server, client = profiled["connections"]["server"], profiled["connections"]["client"]
    computes = sum(server["entries"].get(c, {}).get("calls", 0) for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))
    assert computes >= profiled["steps"]["steps"] > 0, profiled
    assert server["waiting_ms"] > 0 and client["entries"]["reply wait"]["calls"] >= computes, profiled
