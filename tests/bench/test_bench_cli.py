"""`apirctl bench` end to end: real llama-bench natively and in the real image, real llama-server load.

The integration tests run the CLI as a user does (`python -m apirctl bench ...`) with the demo
model; the bad-input tests check the one-line errors and exit codes, never a traceback.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.bench_helpers import REPO, Server, run_cli
from tests.support.ports import free_port


def one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("apirctl: error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], proc.stderr


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


@pytest.mark.integration
def test_native_and_container_rows_json_plot_history(
    llama_build: Any, demo_model: Path, llama_image: str, podman: str, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    chart = tmp_path / "bench.png"
    proc = run_cli("bench", str(demo_model), "--modes", "native,container", "--reps", "2", "--pp", "128",
                   "--tg", "32", "--threads", "2", "--format", "json", "--plot", str(chart))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["system"]["host"] and data["system"]["cpu"]
    assert data["system"]["image"] == llama_image
    rows = {(r["mode"], r["test"]): r for r in data["rows"]}
    assert set(rows) == {(m, t) for m in ("native", "container") for t in ("pp128", "tg32")}
    for (mode, _test), row in rows.items():
        assert row["skipped_reason"] is None
        assert row["tps_mean"] > 0 and row["tps_std"] >= 0
        assert row["backend"]
        assert len(row["samples_ts"]) == 2
        assert row["ratio_to_native"] > 0
        if mode == "native":
            assert row["ratio_to_native"] == pytest.approx(1.0)
        else:
            native = rows[("native", _test)]["tps_mean"]
            assert row["ratio_to_native"] == pytest.approx(row["tps_mean"] / native)
    width, height = png_size(chart)
    assert width >= 400 and height >= 300

    listed = run_cli("bench", "history", "--json")
    assert listed.returncode == 0, listed.stderr
    ids = [r["id"] for r in json.loads(listed.stdout)]
    assert ids == [data["id"]]
    compared = run_cli("bench", "compare", data["id"], data["id"][:15], "--json")
    assert compared.returncode == 0, compared.stderr
    changes = json.loads(compared.stdout)["changes"]
    assert len(changes) == len(rows) and all(c["change"] == pytest.approx(0.0) for c in changes)


@pytest.mark.integration
def test_remoting_skips_with_a_reason_when_no_backend_runs(llama_build: Any, demo_model: Path) -> None:
    env = dict(os.environ, APIRCTL_RPC_PORT=str(free_port()))  # nothing of anyone's listens there
    proc = run_cli("bench", str(demo_model), "--modes", "remoting,native", "--reps", "1", "--pp", "16",
                   "--tg", "4", "--threads", "2", "--json", "--no-save", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    remoting = [r for r in rows if r["mode"] == "remoting"]
    assert remoting and all(r["tps_mean"] is None and "remoting" in r["skipped_reason"] for r in remoting)
    assert all(r["tps_mean"] > 0 for r in rows if r["mode"] == "native")
    assert json.loads(run_cli("bench", "history", "--json").stdout) == []


@pytest.mark.integration
def test_serving_load_at_concurrency_1_and_4(llama_server: Server) -> None:
    proc = run_cli("bench", "--url", llama_server.url + "/v1", "--concurrency", "1,4", "--requests", "4",
                   "--prompt-tokens", "32", "--max-tokens", "8", "--time-limit", "600", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    levels = data["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["errors"] == 0, lv["error_sample"]
        assert lv["completed"] == lv["requests"] == 4
        assert 0 < lv["ttft_p50_ms"] <= lv["ttft_p95_ms"]
        assert 0 < lv["itl_p50_ms"] <= lv["itl_p95_ms"]
        assert lv["output_tps_per_request"] > 0 and lv["output_tps_total"] > 0
        assert lv["request_throughput"] > 0
        assert lv["output_tokens"] == 4 * 8
        # each request's prompt was new to the server: only the chat template's opening (the demo model's
        # system prompt, about half of these short prompts) came from its cache; with one prompt for all,
        # every request after a slot's first was answered from it (all but one token of each)
        assert lv["prompt_tokens"] > 4 * 24 and 0 <= lv["cached_prompt_tokens"] < lv["prompt_tokens"] / 2, lv
    table = run_cli("bench", "history")
    assert data["id"] in table.stdout


@pytest.mark.integration
def test_llama_bench_failure_shows_its_stderr_tail(llama_build: Any, tmp_path: Path) -> None:
    """A well-formed GGUF of an architecture llama.cpp does not know: llama-bench itself fails."""
    import gguf
    import numpy as np

    bad = tmp_path / "unknown-arch.gguf"
    writer = gguf.GGUFWriter(str(bad), "apirctl-no-such-arch")
    writer.add_block_count(1)
    writer.add_tensor("weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = run_cli("bench", str(bad), "--modes", "native", "--reps", "1", "--pp", "8", "--tg", "4")
    one_line_error(proc, "llama-bench failed")
    assert "apirctl-no-such-arch" in proc.stderr
    assert json.loads(run_cli("bench", "history", "--json").stdout) == []


def test_unknown_mode_is_one_line() -> None:
    one_line_error(run_cli("bench", "smollm2", "--modes", "native,warp"), "unknown bench mode 'warp'")


def test_missing_model_is_one_line(tmp_path: Path) -> None:
    one_line_error(run_cli("bench", str(tmp_path / "absent.gguf"), "--modes", "native"), "absent.gguf")


def test_bad_numbers_and_format_are_one_line() -> None:
    one_line_error(run_cli("bench", "smollm2", "--reps", "0"), "--reps")
    one_line_error(run_cli("bench", "smollm2", "--format", "xml"), "unknown format 'xml'")
    one_line_error(run_cli("bench", "--url", "http://127.0.0.1:1", "--concurrency", "1,zero"), "--concurrency")


def test_endpoint_down_is_one_line() -> None:
    port = free_port()  # nothing listens there
    one_line_error(run_cli("bench", "--url", f"http://127.0.0.1:{port}", "--requests", "1"), "cannot reach")


def test_plot_without_matplotlib_fails_before_benchmarking(tmp_path: Path) -> None:
    """matplotlib blocked at import, as in an install without the `plot` extra (in this process: the
    resident process, which has matplotlib, is kept out of it)."""
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv = ['apirctl'] + sys.argv[1:]; "
            "from apirctl.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "bench", str(tmp_path / "absent.gguf"), "--plot",
                           str(tmp_path / "x.png")], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "APIRCTL_RESIDENT": "0"})
    one_line_error(proc, "--plot needs matplotlib")
    assert "apirctl[plot]" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_history_and_compare_on_an_empty_history() -> None:
    proc = run_cli("bench", "history", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == []
    one_line_error(run_cli("bench", "compare", "20260101", "20260102"), "no saved benchmark")


@pytest.mark.integration
def test_native_and_remoting_through_the_rpc_backend(
    llama_build: Any, demo_model: Path, llama_image: str, podman: str
) -> None:
    """`machine restart --remoting` starts ggml-rpc-server on 127.0.0.1; bench's remoting rows go through it.

    The backend computes on this machine's CPU: `auto` would not serve with it (the container's own
    CPU is faster), but bench still measures it, and says that the row measures the transport."""
    from apirctl import gpu
    from apirctl.remoting import transport

    port = free_port()
    started = run_cli("machine", "restart", "--remoting", "--port", str(port), "--threads", "2")
    assert started.returncode == 0, started.stderr
    try:
        auto = transport.plan("auto", offer=gpu.Blocked(reason="no GPU device on this host"))
        proc = run_cli("bench", str(demo_model), "--modes", "native,remoting", "--reps", "1", "--pp", "32",
                       "--tg", "8", "--threads", "2", "--json")
    finally:
        run_cli("machine", "stop")
    assert auto.transport == "none" and auto.notice and "computes on the CPU too (CPU: " in auto.notice
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["system"]["transport"] == "rpc"
    assert "measures the transport, not a speed-up" in data["system"]["extra"]["remoting"]
    remoting = [r for r in data["rows"] if r["mode"] == "remoting"]
    assert [r["test"] for r in remoting] == ["pp32", "tg8"]  # one row per test: a single -ngl reached llama-bench
    for row in remoting:
        assert row["backend"] == "RPC" and row["tps_mean"] > 0 and row["ratio_to_native"] > 0


@pytest.mark.integration
def test_serving_load_against_an_apirctl_server(
    podman: str, llama_image: str, demo_model: Path, tmp_path: Path
) -> None:
    """`apirctl serve` then `apirctl bench --server NAME`: the served container, found by its labels."""
    import uuid

    name = f"apirctl-bench-{uuid.uuid4().hex[:8]}"
    port = free_port()
    served = run_cli("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name, "--json",
                     timeout=600)
    try:
        assert served.returncode == 0, served.stderr
        proc = run_cli("bench", "--server", name, "--concurrency", "1,4", "--requests", "4", "--prompt-tokens",
                       "32", "--max-tokens", "8", "--json", "--no-save")
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["params"]["url"] == f"http://127.0.0.1:{port}"
        for lv in data["levels"]:
            assert lv["errors"] == 0, lv["error_sample"]
            assert lv["completed"] == 4 and lv["ttft_p50_ms"] > 0 and lv["output_tps_total"] > 0
    finally:
        run_cli("stop", name)
    one_line_error(run_cli("bench", "--server", name, "--requests", "1"), name)


def test_a_server_that_is_not_openai_compatible_is_one_line(tmp_path: Path) -> None:
    """A real HTTP server on the loopback that answers 404 to /v1/models."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        one_line_error(run_cli("bench", "--url", url, "--requests", "1"), "HTTP 404")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
def test_serving_time_limit_cancels_and_counts_errors(llama_server: Server) -> None:
    """Loops are bounded in time: requests still running at the limit are cancelled and counted."""
    proc = run_cli("bench", "--url", llama_server.url, "--concurrency", "2", "--requests", "4", "--max-tokens",
                   "512", "--time-limit", "0.05", "--json", "--no-save")
    assert proc.returncode == 0, proc.stderr
    level = json.loads(proc.stdout)["levels"][0]
    assert level["timed_out"] is True
    assert level["errors"] == level["requests"] - level["completed"] >= 1
    assert "time limit" in level["error_sample"]


@pytest.mark.integration
def test_serving_native_and_remoting_side_by_side(
    llama_build: Any, demo_model: Path, llama_image: str, podman: str
) -> None:
    """`apirctl bench MODEL --serving`: the host's llama-server and `apirctl serve` of the same model (over the
    machine's RPC backend) loaded in turn, native around each remoting row; both servers gone after it."""
    port = free_port()
    started = run_cli("machine", "restart", "--remoting", "--port", str(port), "--threads", "2")
    assert started.returncode == 0, started.stderr
    try:
        proc = run_cli("bench", str(demo_model), "--serving", "--transport", "rpc", "--concurrency", "1,2",
                       "--requests", "2", "--prompt-tokens", "16", "--max-tokens", "8", "--json", "--no-save",
                       timeout=900)
        left = run_cli("ps", "-a", "--json")
    finally:
        run_cli("machine", "stop")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [(lv["mode"], lv["concurrency"]) for lv in data["levels"]] == [
        ("native", 1), ("remoting", 1), ("native", 1), ("native", 2), ("remoting", 2), ("native", 2)]
    for lv in data["levels"]:
        assert lv["errors"] == 0 and lv["completed"] == 2 and lv["output_tps_total"] > 0, lv
        if lv["mode"] == "remoting":
            assert lv["transport"].startswith("rpc") and lv["ratio_to_native"] > 0, lv
        else:
            assert lv["ratio_to_native"] is None and lv["transport"].startswith("host"), lv
    assert left.returncode == 0 and not [s for s in json.loads(left.stdout) if "bench-serving" in s["name"]]
    import tempfile

    assert list(Path(tempfile.gettempdir()).glob("apirctl-bench-serving-*")) == [], "the run's folder is removed"


def test_serving_modes_are_checked_before_anything_starts(tmp_path: Path) -> None:
    """A served mode that does not exist, or native alone, is one line, before a model or server is touched."""
    for modes in ("native,apir", "native", "remoting,remoting"):
        proc = run_cli("bench", str(tmp_path / "absent.gguf"), "--serving", "--modes", modes)
        one_line_error(proc, "for serving: name each of remoting, container, vm-cpu, vm-remoting, vm-apir at most once")
