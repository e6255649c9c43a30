"""`apirctl perplexity`: the same perplexity natively, in the real image and through both remoting paths.

The integration test runs the CLI as a user does, on the demo model and the text shipped with apirctl
(two chunks: seconds per mode); the comparison must find the modes identical, and must flag a mode
given another context size. The unit tests read llama-perplexity's output as it prints it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from apirctl.bench import modes as bench_modes
from apirctl.bench import perplexity as ppl
from apirctl.bench import report
from apirctl.bench.results import Run
from apirctl.errors import ApirctlError
from tests.support.bench_helpers import run_cli

# What llama-perplexity b11434 prints with --ppl-output-type 1 (stdout and stderr, interleaved).
OUTPUT = """\
0.03.593.213 I perplexity: calculating perplexity over 3 chunks, n_ctx=128, batch_size=2048, n_seq=16
0.22 minutes
       0  19.3266  2.961482  0.319346
       0  32.5559  3.482957  0.248680
       0  27.6025  3.317906  0.200424

0.23.892.083 I Final estimate: PPL = 27.6025 +/- 5.53300
"""


def one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("apirctl: error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], proc.stderr
    return errors[0]


def test_parse_reads_the_last_chunk_mean_nll_and_the_final_estimate() -> None:
    est = ppl.parse(OUTPUT)
    assert est.chunks == 3 and est.ctx_size == 128
    assert est.nll == 3.317906 and est.ppl_printed == 27.6025 and est.uncertainty == 5.533
    assert est.ppl == pytest.approx(math.exp(3.317906)) and abs(est.ppl - 27.6025) < 5e-5


def test_parse_finds_a_chunk_line_glued_to_a_partial_log_line() -> None:
    """A container's log may end stderr's `ETA ` (no newline) with stdout's next line."""
    glued = OUTPUT.replace("0.22 minutes\n       0  19.3266", "0.22 minutes\n")
    glued = glued.replace("       0  27.6025", "perplexity: 1.89 seconds per pass - ETA        0  27.6025")
    est = ppl.parse(glued)
    assert est.nll == 3.317906 and est.chunks == 3


def test_parse_explains_a_text_too_short_and_an_output_without_numbers() -> None:
    short = ("perplexity: you need at least 256 tokens to evaluate perplexity with a context of 128\n"
             "perplexity: the data file you provided tokenizes to only 40 tokens\n")
    with pytest.raises(ApirctlError, match="too short for a context of 128: it needs 256 tokens, it has 40") as exc:
        ppl.parse(short)
    assert exc.value.hint and "--ctx-size" in exc.value.hint
    with pytest.raises(ApirctlError, match="printed no perplexity: main: error: failed to load model"):
        ppl.parse("loading\nmain: error: failed to load model 'x'\nbye\n")


def test_chunk_reader_reports_each_chunk_of_the_announced_total() -> None:
    seen: list[tuple[str, int, int]] = []
    reader = ppl.ChunkReader(lambda what, done, total: seen.append((what, done, total)))
    for line in OUTPUT.splitlines():
        reader.feed(line)
    assert seen == [("chunk", 1, 3), ("chunk", 2, 3), ("chunk", 3, 3)]
    assert "Final estimate" in reader.tail_text()


def outcome(mode: str, nll: float | None, skipped: str | None = None) -> bench_modes.ModeOutcome[ppl.Estimate]:
    results = [] if nll is None else [ppl.Estimate(nll=nll, ppl_printed=0.0, uncertainty=None, chunks=2,
                                                   ctx_size=128)]
    return bench_modes.ModeOutcome(mode, results, skipped=skipped)


def test_rows_flag_a_mode_over_the_tolerance_and_only_that_one() -> None:
    rows = ppl.rows_from([outcome("native", 3.0), outcome("container", 3.0 + 5e-5), outcome("remoting", 3.0 + 2e-4),
                          outcome("apir", None, skipped="no apir-host")], ppl.Params(ctx_for={"remoting": 64}))
    by_mode = {r.mode: r for r in rows}
    assert by_mode["native"].ppl_rel_diff == 0.0 and by_mode["native"].matches_native is True
    assert by_mode["container"].matches_native is True
    assert by_mode["remoting"].matches_native is False
    assert by_mode["remoting"].ppl_rel_diff == pytest.approx(math.expm1(2e-4))
    assert by_mode["remoting"].ctx_size == 64 and by_mode["container"].ctx_size == 128
    assert by_mode["apir"].ppl is None and by_mode["apir"].matches_native is None
    assert by_mode["apir"].skipped_reason == "no apir-host"


def test_arguments_per_mode_and_place() -> None:
    program = ppl.LlamaPerplexity(ppl.Params(ctx_size=96, chunks=2, threads=2, ctx_for={"container": 64}),
                                  ppl.DEFAULT_TEXT)
    host = program.arguments("/m.gguf", "native", False, extra=["--rpc", "unix:/s"])
    assert host[:6] == ["-m", "/m.gguf", "-f", str(ppl.DEFAULT_TEXT), "-c", "96"]
    assert host[-2:] == ["--rpc", "unix:/s"] and "--ppl-output-type" in host and "--chunks" in host
    inside = program.arguments("/models/m.gguf", "container", True)
    assert inside[2:6] == ["-f", ppl.CONTAINER_TEXT, "-c", "64"]
    assert [(m.target, m.read_only) for m in program.mounts()] == [(ppl.CONTAINER_TEXT, True)]


def test_the_shipped_text_is_a_few_kilobytes_of_prose() -> None:
    text = ppl.DEFAULT_TEXT.read_text(encoding="utf-8")
    assert 2000 < len(text.encode()) < 8000
    assert text.count(".") > 30


@pytest.mark.parametrize(("args", "needle"), [
    (["--modes", "container,remoting"], "include it in --modes"),
    (["--modes", "native,gpu"], "unknown bench mode 'gpu'"),
    (["--ctx-size", "4"], "--ctx-size must be at least 8"),
    (["--ctx-size-for", "container"], "expected MODE=N"),
    (["--ctx-size-for", "nowhere=64"], "unknown mode 'nowhere'"),
    (["--file", "/nonexistent/text.txt"], "text file /nonexistent/text.txt does not exist"),
    (["--format", "yaml"], "unknown format 'yaml'"),
])
def test_bad_input_is_one_line_with_no_traceback(args: list[str], needle: str) -> None:
    one_line_error(run_cli("perplexity", "smollm2", *args), needle)


def test_a_text_too_short_is_one_error_line_with_a_hint(llama_build: Any, demo_model: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.\n")
    proc = run_cli("perplexity", str(demo_model), "--modes", "native", "--file", str(short), "-t", "2")
    line = one_line_error(proc, "native: the text is too short for a context of 128")
    assert "native" in line


def test_table_says_which_mode_differs() -> None:
    rows = ppl.rows_from([outcome("native", 3.0), outcome("remoting", 3.1)], ppl.Params())
    run = Run(id="x", created="now", kind="perplexity", model="m", params={"tolerance": ppl.TOLERANCE},
                  system=bench_modes.system.collect(None), rows=rows)
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(report.table(run))
    text = console.export_text()
    assert "differs" in text and "same" in text and "+1.1e-01" in text
    assert "differs from native: remoting" in run.summary()
    assert report.as_csv(run).splitlines()[0].startswith("mode,backend,client,transport,ctx_size")


def rows_of(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {r["mode"]: r for r in json.loads(proc.stdout)["rows"]}


@pytest.mark.integration
def test_native_container_rpc_and_apir_give_the_same_perplexity_and_a_wrong_context_is_flagged(
    llama_build: Any, demo_model: Path, llama_image: str, podman: str
) -> None:
    started = run_cli("machine", "restart", "--remoting", "--threads", "2")
    assert started.returncode == 0, started.stderr
    try:
        same = run_cli("perplexity", str(demo_model), "--modes", "native,container,remoting,apir", "--chunks", "2",
                       "-t", "2", "--json")
        wrong = run_cli("perplexity", str(demo_model), "--modes", "native,container", "--chunks", "2", "-t", "2",
                        "--json", "--ctx-size-for", "container=64")
    finally:
        run_cli("machine", "stop")

    assert same.returncode == 0, same.stderr
    data = json.loads(same.stdout)
    assert data["kind"] == "perplexity" and data["system"]["image"] == llama_image
    rows = rows_of(same)
    assert list(rows) == ["native", "container", "remoting", "apir"]
    assert [(rows[m]["client"], rows[m]["transport"]) for m in rows] == [
        ("host", None), ("container", None), ("container", "rpc-shm"), ("container", "virtgpu-socket")]
    native = rows["native"]
    assert native["chunks"] == 2 and native["ctx_size"] == 128 and 1 < native["ppl"] < 1000
    for mode, row in rows.items():
        assert row["skipped_reason"] is None, (mode, row["skipped_reason"])
        assert row["nll"] == native["nll"], mode  # identical to the printed digit, not merely close
        assert row["ppl_rel_diff"] == 0.0 and row["matches_native"] is True, mode

    assert wrong.returncode == 1
    flagged = rows_of(wrong)
    assert flagged["container"]["ctx_size"] == 64 and flagged["container"]["matches_native"] is False
    assert abs(flagged["container"]["ppl_rel_diff"]) > ppl.TOLERANCE
    assert flagged["native"]["nll"] == native["nll"]  # the reference itself did not move
    one_line_error(wrong, "container's perplexity differs from native's by")

    history = json.loads(run_cli("bench", "history", "--json").stdout)
    assert [r["id"] for r in history] == [json.loads(wrong.stdout)["id"], data["id"]]
    assert os.path.basename(history[0]["params"]["text"]) == "perplexity.txt"
