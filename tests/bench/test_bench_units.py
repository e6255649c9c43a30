"""The parts of bench that need no build: parsing, rows, history, compare, formats, load math.

llama-bench output here is generated from llama-bench's documented field names with values
chosen by hypothesis, so the parser is checked against every shape, not one sample.
"""

from __future__ import annotations

import csv
import io
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apirctl.bench import load, modes, report, results
from apirctl.bench.llamabench import Params, ProgressReader, Result, arguments, label_for, parse, parse_mixed
from apirctl.bench.modes import ModeOutcome, rows_from
from apirctl.bench.results import LevelResult, Row, Run, SystemInfo
from apirctl.errors import ApirctlError

tps = st.floats(min_value=0.01, max_value=1e6, allow_nan=False, allow_infinity=False)


def bench_entry(n_prompt: int, n_gen: int, avg: float, std: float, samples: list[float]) -> dict[str, object]:
    return {"build_commit": "abc", "build_number": 1, "cpu_info": "cpu", "gpu_info": "", "backends": "CPU",
            "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0, "n_gpu_layers": 99, "n_threads": 2,
            "avg_ts": avg, "stddev_ts": std, "samples_ts": samples}


@given(pp=st.integers(1, 4096), tg=st.integers(1, 1024), a=tps, b=tps, sa=tps, sb=tps)
def test_parse_json_and_jsonl_agree(pp: int, tg: int, a: float, b: float, sa: float, sb: float) -> None:
    entries = [bench_entry(pp, 0, a, sa, [a, a]), bench_entry(0, tg, b, sb, [b])]
    as_array = parse(json.dumps(entries, indent=2))
    as_lines = parse("\n".join(json.dumps(e) for e in entries))
    mixed = parse_mixed("llama-bench: benchmark 1/2: starting\n" + json.dumps(entries[0])
                        + "\nsome log line\n" + json.dumps(entries[1]) + "\n")
    for parsed in (as_array, as_lines, mixed):
        assert [r.test for r in parsed] == [f"pp{pp}", f"tg{tg}"]
        assert [r.tps_mean for r in parsed] == [a, b]
        assert [r.tps_std for r in parsed] == [sa, sb]
        assert parsed[0].samples_ts == [a, a]


def test_labels_follow_llama_bench() -> None:
    assert label_for(512, 0) == "pp512"
    assert label_for(0, 128) == "tg128"
    assert label_for(512, 128) == "pp512+tg128"
    assert label_for(0, 128, 4096) == "tg128 @ d4096"


@pytest.mark.parametrize("text", ["", "not json", "[{\"n_prompt\": 1}]"])
def test_parse_rejects_output_without_results(text: str) -> None:
    with pytest.raises(ApirctlError):
        parse(text)


def test_arguments_carry_every_parameter() -> None:
    params = Params(pp=64, tg=16, reps=3, ngl=7, threads=2)
    args = arguments("/m.gguf", params, ["--rpc", "h:1"], output="jsonl")
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["-m"] == "/m.gguf" and pairs["-p"] == "64" and pairs["-n"] == "16"
    assert pairs["-r"] == "3" and pairs["-ngl"] == "7" and pairs["-o"] == "jsonl"
    assert args[-4:] == ["-t", "2", "--rpc", "h:1"]


def test_progress_reader_reports_test_and_repetition() -> None:
    seen: list[tuple[str, int, int]] = []
    reader = ProgressReader(Params(pp=32, tg=8, reps=3), lambda *e: seen.append(e))
    for line in ("llama-bench: benchmark 1/2: starting", "llama-bench: benchmark 1/2: warmup prompt run",
                 "llama-bench: benchmark 1/2: prompt run 2/3", "llama-bench: benchmark 2/2: generation run 3/3",
                 "main: error: failed to load model"):
        reader.feed(line)
    assert seen == [("pp32", 0, 3), ("pp32", 2, 3), ("tg8", 3, 3)]
    assert "failed to load model" in reader.tail_text()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pp": -1}, "--pp"), ({"pp": 0, "tg": 0}, "nothing to measure"), ({"reps": 0}, "--reps"),
    ({"ngl": -2}, "--ngl"), ({"threads": 0}, "--threads"),
])
def test_params_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ApirctlError, match=message):
        Params(**kwargs).validate()


def test_parse_modes() -> None:
    assert modes.parse_modes("native, container,native") == ["native", "container"]
    with pytest.raises(ApirctlError, match="unknown bench mode 'gpu'"):
        modes.parse_modes("native,gpu")
    with pytest.raises(ApirctlError, match="no bench mode"):
        modes.parse_modes(" , ")


def test_missing_model_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ApirctlError, match="absent.gguf"):
        modes.model_file(str(tmp_path / "absent.gguf"))


@given(native=st.lists(tps, min_size=2, max_size=2), other=st.lists(tps, min_size=2, max_size=2))
def test_rows_ratio_to_native(native: list[float], other: list[float]) -> None:
    from apirctl.bench.llamabench import Result

    params = Params(pp=64, tg=16)

    def outcome(mode: str, values: list[float]) -> ModeOutcome:
        res = [Result(test=t, tps_mean=v, tps_std=0.0, samples_ts=[v], backends="CPU", n_prompt=0, n_gen=0,
                      n_gpu_layers=None, n_threads=None, raw={}) for t, v in zip(params.tests(), values, strict=True)]
        return ModeOutcome(mode, res, backend="CPU")

    rows = rows_from([outcome("native", native), outcome("container", other),
                      ModeOutcome("remoting", skipped="no backend")], params)
    by = {(r.mode, r.test): r for r in rows}
    for i, test in enumerate(params.tests()):
        assert by[("native", test)].ratio_to_native == pytest.approx(1.0)
        assert by[("container", test)].ratio_to_native == pytest.approx(other[i] / native[i])
        assert by[("remoting", test)].tps_mean is None
        assert by[("remoting", test)].skipped_reason == "no backend"


def system() -> SystemInfo:
    return SystemInfo(host="h", os="linux", arch="x86_64", python="3", apirctl="0")


def bench_run(run_id: str, model: str, values: dict[tuple[str, str], float | None]) -> Run:
    rows = [Row(mode=m, test=t, tps_mean=v, skipped_reason=None if v is not None else "skipped")
            for (m, t), v in values.items()]
    return Run(id=run_id, created="2026-01-01T00:00:00+00:00", kind="llama-bench", model=model,
               system=system(), rows=rows)


def test_history_saves_filters_and_survives_a_damaged_line() -> None:
    first = bench_run("20260101-000000-aaaa", "smollm2", {("native", "pp512"): 100.0})
    second = bench_run("20260101-000001-bbbb", "other", {("native", "pp512"): 50.0})
    results.save(first)
    with results.dirs().bench_results.open("a") as fh:
        fh.write("{not json\n")
    results.save(second)
    assert [r.id for r in results.history()] == [second.id, first.id]
    assert [r.id for r in results.history("smol")] == [first.id]
    assert results.find("20260101-000001").id == second.id
    with pytest.raises(ApirctlError, match="ambiguous"):
        results.find("20260101")
    with pytest.raises(ApirctlError, match="no saved benchmark"):
        results.find("nope")


@given(a=tps, b=tps)
def test_compare_reports_relative_change(a: float, b: float) -> None:
    run_a = bench_run("a", "m", {("native", "tg128"): a, ("remoting", "tg128"): None})
    run_b = bench_run("b", "m", {("native", "tg128"): b, ("container", "tg128"): b})
    changes = {c.key: c for c in results.compare(run_a, run_b)}
    assert changes["native tg128"].change == pytest.approx(b / a - 1)
    assert changes["native tg128"].better == ((b > a) if a != b else None)
    assert changes["remoting tg128"].change is None
    assert changes["container tg128"].a is None and changes["container tg128"].b == b


def test_compare_refuses_different_kinds() -> None:
    serving = Run(id="s", created="x", kind="serving", model="m", system=system(),
                  levels=[LevelResult(concurrency=1, requests=1, completed=1, errors=0)])
    with pytest.raises(ApirctlError, match="cannot compare"):
        results.compare(bench_run("a", "m", {}), serving)


def test_formats_carry_every_row() -> None:
    run = bench_run("x", "m", {("native", "pp64"): 80.0, ("container", "pp64"): 40.0, ("remoting", "pp64"): None})
    run = run.model_copy(update={"rows": rows_from_values(run)})
    data = report.as_json(run)
    assert set(data) >= {"system", "rows"}
    assert [r["mode"] for r in data["rows"]] == ["native", "container", "remoting"]
    for row in data["rows"]:
        assert set(report.ROW_FIELDS) <= set(row)
    parsed = list(csv.DictReader(io.StringIO(report.as_csv(run))))
    assert [r["mode"] for r in parsed] == ["native", "container", "remoting"]
    assert float(parsed[1]["ratio_to_native"]) == pytest.approx(0.5)
    md = report.as_markdown(run).splitlines()
    assert md[0].startswith("| mode |") and len(md) == 2 + len(run.rows)
    bars = report.bars(run.rows, width=20)
    native_bar = next(line for line in bars if "native" in line)
    container_bar = next(line for line in bars if "container" in line)
    assert native_bar.count("█") == 20 and container_bar.count("█") == 10
    assert any("remoting" in line and "skipped" in line for line in bars)


def rows_from_values(run: Run) -> list[Row]:
    native = {r.test: r.tps_mean for r in run.rows if r.mode == "native"}
    return [r.model_copy(update={"ratio_to_native": (r.tps_mean / native[r.test]) if r.tps_mean else None})
            for r in run.rows]


def test_unknown_format() -> None:
    with pytest.raises(ApirctlError, match="unknown format"):
        report.check_format("xml")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = bench_run("x", "m", {("native", "pp64"): 80.0, ("native", "tg16"): 20.0,
                               ("container", "pp64"): 40.0, ("container", "tg16"): None})
    out = report.plot(run, tmp_path / "chart.png")
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 300 and height > 200
    with pytest.raises(ApirctlError, match="PNG"):
        report.plot(run, tmp_path / "chart.svg")


@pytest.mark.parametrize(("url", "base"), [
    ("http://127.0.0.1:1234", "http://127.0.0.1:1234"), ("http://h:1/", "http://h:1"),
    ("http://h:1/v1", "http://h:1"), ("https://h/v1/chat/completions", "https://h"),
])
def test_base_url(url: str, base: str) -> None:
    assert load.base_url(url) == base


def test_bad_load_inputs() -> None:
    with pytest.raises(ApirctlError, match="http"):
        load.base_url("127.0.0.1:8080")
    for text in ("", "1,x", "0,4", "-1"):
        with pytest.raises(ApirctlError, match="--concurrency"):
            load.parse_concurrency(text)
    with pytest.raises(ApirctlError, match="--requests"):
        load.LoadParams(requests=0).validate()


@settings(max_examples=50)
@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1, max_size=50))
def test_percentiles_are_ordered_and_bounded(values: list[float]) -> None:
    p50, p95 = load.percentile(values, 50), load.percentile(values, 95)
    assert p50 is not None and p95 is not None
    assert min(values) <= p50 <= p95 <= max(values) + 1e-9


def test_prompt_grows_with_the_requested_length() -> None:
    assert len(load.prompt_text(400).split()) > len(load.prompt_text(100).split()) > 50


def test_remoting_keeps_one_gpu_layers_flag() -> None:
    """llama-bench runs one test per value of a repeated flag, so the plan's copy must go."""
    from apirctl.remoting import transport

    plan = transport.rpc_plan(50052, 999)
    kept = modes.without_flag(plan.llama_args, ("-ngl", "--n-gpu-layers"))
    assert "--n-gpu-layers" not in kept and "-ngl" not in kept
    assert kept[kept.index("--rpc") + 1].endswith(":50052")
    assert modes.without_flag(["-ngl=5", "-x", "1"], ("-ngl",)) == ["-x", "1"]


def test_compare_serving_levels_knows_lower_is_better() -> None:
    def serving(run_id: str, ttft: float, tps: float) -> Run:
        level = LevelResult(concurrency=4, requests=8, completed=8, errors=0, ttft_p50_ms=ttft, output_tps_total=tps)
        return Run(id=run_id, created="x", kind="serving", model="m", system=system(), levels=[level])

    changes = {c.metric: c for c in results.compare(serving("a", 100.0, 50.0), serving("b", 50.0, 100.0))}
    assert changes["ttft_p50_ms"].change == pytest.approx(-0.5) and changes["ttft_p50_ms"].better is True
    assert changes["output_tps_total"].change == pytest.approx(1.0) and changes["output_tps_total"].better is True
    assert changes["errors"].change is None  # 0 -> 0: no relative change to speak of


def test_the_idle_virtgpu_frontend_is_not_a_modes_backend() -> None:
    """llama-bench lists the ggml-virtgpu frontend among its backends even with no socket (no device):
    only the apir mode's rows name it."""
    def ran(backends: str) -> list[Result]:
        return [Result(test="tg4", tps_mean=1.0, tps_std=0.0, samples_ts=[1.0], backends=backends, n_prompt=0,
                       n_gen=4, n_gpu_layers=99, n_threads=1, raw={})]

    assert modes._backend_label(ran("ggml-virtgpu,RPC"), "rpc") == "RPC"
    assert modes._backend_label(ran("ggml-virtgpu"), "cpu") == "cpu"
    assert modes._backend_label(ran("CUDA"), "cuda") == "CUDA"
    assert modes._backend_label(ran("ggml-virtgpu"), "virtgpu", apir=True) == "ggml-virtgpu"


def test_a_vm_mode_skips_a_program_that_needs_files_besides_the_model(tmp_path: Path) -> None:
    """A VM gets the model as its only file: llama-perplexity's text would be missing there, so the VM
    modes are skipped for it with the reason, before any VM is booted."""
    from apirctl.bench.perplexity import LlamaPerplexity
    from apirctl.bench.perplexity import Params as PerplexityParams

    text = tmp_path / "text.txt"
    text.write_text("words\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    program = LlamaPerplexity(PerplexityParams(), text)
    ctx = modes.Context(model_path=model, program=program)
    outcomes = modes.run_modes(ctx, ["vm-cpu", "vm-remoting"])
    assert [o.mode for o in outcomes] == ["vm-cpu", "vm-remoting"]
    assert all(o.skipped and "needs more" in o.skipped and not o.results for o in outcomes)
