"""benchmarks/gpu_remoting.py's `batched` part (benchmarks/gpu_batched.py), run here end to end on the
CPU: the build's llama-batched-bench natively and as a client with no network over ggml-rpc's shared
memory and through apir-host (answering ahead, and waiting for each compute), several sequences'
prompts at once, with the rows, ratios, the APIR host's calls in each pass's windows, the profiled RPC
pair and the greedy-token agreement that the GPU machine's results files hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.support.build_servers import batched_bench

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.integration


def test_the_batched_part_measures_prompts_of_several_sequences_on_each_path(
        llama_build: llamacpp.Build, demo_model: Path, tmp_path: Path) -> None:
    batched_bench(llama_build)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_remoting.py"), "--sdist", str(tmp_path / "unused.tar.gz"),
         "--prebuilt", str(llama_build.bin_dir.parent), "--model", str(demo_model), "--shapes", "demo",
         "--work", str(tmp_path / "work"), "--out", str(out), "--parts", "batched", "--device", "CPU",
         "--server-threads", "1", "--batched-npl", "1", "2", "--batched-reps", "1",
         "--batched-paths", "rpc", "apir", "apir-wait", "--batched-rpc-profile", "--deadline", "500"],
        capture_output=True, text=True, timeout=600, check=False)
    results = json.loads((out / "results.json").read_text())
    entry = results.get("batched", {}).get("demo", {})
    assert "agreement" in entry, f"{results['steps']}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert [row["row"] for row in entry["sequence"]] == ["native", "rpc", "apir", "apir-wait", "native"]
    for row in entry["sequence"]:
        assert [p["pl"] for p in row["passes"]] == [1, 2], row
        assert all(p["speed_pp"] > 0 and p["speed_tg"] > 0 for p in row["passes"]), row
        # the log at -lv 4 says how llama.cpp placed the graph: one split natively, two remotely (the
        # token embeddings stay on the client's CPU)
        splits = [line for line in row["resolved"] if "splits =" in line]
        assert splits and ("splits = 1" in splits[-1]) == (row["row"] == "native"), row["resolved"]
    for key in ("rpc", "apir", "apir-wait"):
        for pl in ("1", "2"):
            cell = entry["ratios"][key][pl]
            assert len(cell["speed_pp"]) == 1 and cell["speed_pp"][0] > 0 and cell["speed_tg"][0] > 0, cell
    # the APIR rows' host calls, cut by each pass's windows (placed by when its line arrived: a loaded
    # machine may shift them by a step or two): the prompt's computes and most of the generation's 32
    for row in entry["sequence"]:
        if row["row"].startswith("apir"):
            for found in row["passes"]:
                assert found["host_pp"]["computes"] >= 1, found["host_pp"]
                assert 16 <= found["host_tg"]["computes"] <= 34, found["host_tg"]
    server = entry["rpc_profiled"]["connections"]["server"]["entries"]
    assert sum(server.get(c, {}).get("calls", 0) for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE")) >= 64, server
    agreement = entry["agreement"]
    assert agreement["equal"] and agreement["tokens"] == 48 and agreement["first_difference"] is None, agreement
