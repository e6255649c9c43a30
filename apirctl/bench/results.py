"""Benchmark results: the row and run shapes, saving as JSON lines, history and compare.

One run is one JSON line in `paths.dirs().bench_results`, appended whole (one write of
one line), so an interrupted run never leaves half a record, and a damaged line is
skipped when reading instead of hiding the others.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from apirctl.errors import ApirctlError
from apirctl.paths import dirs, ensure


class Row(BaseModel):
    """One mode x test: t/s and its ratio to native (bench), or perplexity and its difference from
    native's (`apirctl perplexity`), or why it was skipped."""

    mode: str
    backend: str | None = None
    client: str | None = None  # where llama-bench ran: "host" or "container" (remoting has either)
    transport: str | None = None  # remoting: what ran (rpc-shm, rpc-unix, rpc-tcp, virtgpu)
    test: str
    tps_mean: float | None = None
    tps_std: float | None = None
    ratio_to_native: float | None = None
    skipped_reason: str | None = None
    samples_ts: list[float] = Field(default_factory=list)
    n_gpu_layers: int | None = None
    n_threads: int | None = None
    ctx_size: int | None = None
    chunks: int | None = None
    ppl: float | None = None
    ppl_error: float | None = None
    nll: float | None = None
    ppl_rel_diff: float | None = None  # ppl / native's ppl - 1
    matches_native: bool | None = None  # |ppl_rel_diff| within apirctl.bench.perplexity.TOLERANCE


class LevelResult(BaseModel):
    """Serving metrics at one concurrency level; latencies in milliseconds."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    error_sample: str | None = None
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    output_tps_per_request: float | None = None
    output_tps_total: float | None = None
    request_throughput: float | None = None
    output_tokens: int = 0
    #: the completed requests' prompt tokens, and those the server took from its cache (where it says)
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False
    #: `bench MODEL --serving`: which server the row loaded (native or remoting), over what, and a
    #: remoting row's output tokens/s over the mean of the native rows on either side of it
    mode: str | None = None
    transport: str | None = None
    ratio_to_native: float | None = None


class SystemInfo(BaseModel):
    """What a bug report or a comparison needs to know about where the numbers came from."""

    host: str
    os: str
    arch: str
    cpu: str | None = None
    gpu: str | None = None
    python: str
    apirctl: str
    llama_cpp: str | None = None
    host_backend: str | None = None
    transport: str | None = None
    image: str | None = None
    bundle: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class Run(BaseModel):
    """One `apirctl bench` invocation."""

    id: str
    created: str
    kind: Literal["llama-bench", "serving", "perplexity"]
    model: str
    model_file: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    system: SystemInfo
    rows: list[Row] = Field(default_factory=list)
    levels: list[LevelResult] = Field(default_factory=list)

    def summary(self) -> str:
        """One line for `bench history`."""
        if self.kind == "serving" and any(lv.ratio_to_native is not None for lv in self.levels):
            return "remoting vs native, " + ", ".join(f"c{lv.concurrency}: {lv.ratio_to_native:.2f}x"
                                                      for lv in self.levels if lv.ratio_to_native is not None)
        if self.kind == "serving":
            parts = [f"c{lv.concurrency}: {lv.output_tps_total or 0:.1f} tok/s"
                     + (f" ({lv.errors} errors)" if lv.errors else "") for lv in self.levels]
            return ", ".join(parts)
        if self.kind == "perplexity":
            values = ", ".join(f"{r.mode} {r.ppl:.4f}" for r in self.rows if r.ppl is not None)
            differ = [r.mode for r in self.rows if r.matches_native is False]
            skipped = sorted(r.mode for r in self.rows if r.skipped_reason)
            return ("PPL: " + values + (f" (differs from native: {', '.join(differ)})" if differ else "")
                    + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
        tests = list(dict.fromkeys(r.test for r in self.rows))
        modes = list(dict.fromkeys(r.mode for r in self.rows if r.tps_mean is not None))
        tps = {(r.mode, r.test): r.tps_mean for r in self.rows}
        parts = [f"{m} " + "/".join(f"{v:.1f}" if (v := tps.get((m, t))) is not None else "-" for t in tests)
                 for m in modes]
        skipped = sorted({r.mode for r in self.rows if r.skipped_reason})
        text = "/".join(tests) + " t/s: " + ", ".join(parts)
        if skipped:
            text += f" (skipped: {', '.join(skipped)})"
        return text


def new_id() -> str:
    """Sortable and short: UTC time to the second plus 4 random hex digits."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def save(run: Run) -> None:
    """Append the run as one JSON line."""
    path = dirs().bench_results
    ensure(path.parent)
    line = run.model_dump_json() + "\n"
    try:
        with path.open("a", encoding="utf-8") as fh:
            fh.write(line)
    except OSError as exc:
        raise ApirctlError(f"cannot save benchmark results to {path}: {exc}") from None


def load_all() -> list[Run]:
    """Every saved run, oldest first; unreadable lines are skipped."""
    path = dirs().bench_results
    if not path.exists():
        return []
    runs = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            runs.append(Run.model_validate(json.loads(line)))
        except (ValueError, ValidationError):
            continue
    return runs


def history(model: str | None = None, limit: int | None = None) -> list[Run]:
    """Saved runs, newest first, optionally only those whose model reference or file matches."""
    runs = load_all()
    if model:
        needle = model.lower()
        runs = [r for r in runs if needle in r.model.lower() or needle in (r.model_file or "").lower()]
    runs.reverse()
    return runs[:limit] if limit else runs


def find(run_id: str) -> Run:
    """A saved run by id or unique id prefix."""
    runs = load_all()
    exact = [r for r in runs if r.id == run_id]
    if exact:
        return exact[0]
    matches = [r for r in runs if r.id.startswith(run_id)] if run_id else []
    if not matches:
        raise ApirctlError(f"no saved benchmark with id {run_id!r}", hint="`apirctl bench history` lists them")
    if len(matches) > 1:
        raise ApirctlError(f"benchmark id {run_id!r} is ambiguous ({len(matches)} runs start with it)")
    return matches[0]


class Change(BaseModel):
    """One metric in two runs, with the relative change (b / a - 1)."""

    key: str
    metric: str
    a: float | None
    b: float | None
    change: float | None
    better: bool | None = None


_LOWER_IS_BETTER = {"ppl", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "errors"}
_LEVEL_METRICS = ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "output_tps_per_request",
                  "output_tps_total", "request_throughput", "errors")


def _change(key: str, metric: str, a: float | None, b: float | None) -> Change:
    rel = (b / a - 1.0) if (a and b is not None) else None
    better = None
    if rel is not None and rel != 0:
        better = (rel < 0) if metric in _LOWER_IS_BETTER else (rel > 0)
    return Change(key=key, metric=metric, a=a, b=b, change=rel, better=better)


def compare(a: Run, b: Run) -> list[Change]:
    """Match rows by (mode, test) and levels by concurrency; what only one run has shows with a gap."""
    if a.kind != b.kind:
        raise ApirctlError(f"cannot compare a {a.kind} run ({a.id}) with a {b.kind} run ({b.id})")
    changes: list[Change] = []
    if a.kind in ("llama-bench", "perplexity"):
        metric = "tps_mean" if a.kind == "llama-bench" else "ppl"
        rows_a = {(r.mode, r.test): r for r in a.rows}
        rows_b = {(r.mode, r.test): r for r in b.rows}
        for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
            ra, rb = rows_a.get(key), rows_b.get(key)
            changes.append(_change(f"{key[0]} {key[1]}", metric,
                                   getattr(ra, metric) if ra else None, getattr(rb, metric) if rb else None))
        return changes
    levels_a = {lv.concurrency: lv for lv in a.levels}
    levels_b = {lv.concurrency: lv for lv in b.levels}
    for conc in sorted(set(levels_a) | set(levels_b)):
        la, lb = levels_a.get(conc), levels_b.get(conc)
        for metric in _LEVEL_METRICS:
            va = getattr(la, metric) if la else None
            vb = getattr(lb, metric) if lb else None
            changes.append(_change(f"c{conc}", metric, None if va is None else float(va),
                                   None if vb is None else float(vb)))
    return changes
