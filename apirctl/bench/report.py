"""Rendering benchmark results: rich tables, compact bars, CSV, Markdown, JSON and a PNG chart.

The JSON shape is the contract scripts read (`{"system": ..., "rows": [...]}` for
llama-bench and perplexity runs, `{"system": ..., "levels": [...]}` for serving runs); the
other formats are for people.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apirctl.bench.results import Change, LevelResult, Row, Run
from apirctl.errors import ApirctlError

if TYPE_CHECKING:
    from rich.console import RenderableType

FORMATS = ("table", "json", "csv", "md")
ROW_FIELDS = ("mode", "backend", "client", "transport", "test", "tps_mean", "tps_std", "ratio_to_native",
              "skipped_reason")
PPL_FIELDS = ("mode", "backend", "client", "transport", "ctx_size", "chunks", "ppl", "ppl_error", "nll",
              "ppl_rel_diff", "matches_native", "skipped_reason")
LEVEL_FIELDS = ("concurrency", "requests", "completed", "errors", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
                "itl_p95_ms", "output_tps_per_request", "output_tps_total", "request_throughput", "error_sample",
                "mode", "transport", "ratio_to_native")
_BAR = "█"
_PARTIAL = " ▏▎▍▌▋▊▉"


def check_format(fmt: str) -> str:
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise ApirctlError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    return fmt


def as_json(run: Run) -> dict[str, Any]:
    """The documented machine-readable object (extra keys may grow; these stay)."""
    data: dict[str, Any] = {
        "id": run.id, "created": run.created, "kind": run.kind, "model": run.model,
        "model_file": run.model_file, "params": run.params, "system": run.system.model_dump(),
    }
    if run.kind == "serving":
        data["levels"] = [lv.model_dump() for lv in run.levels]
    else:
        data["rows"] = [r.model_dump() for r in run.rows]
    return data


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _cells(run: Run) -> tuple[tuple[str, ...], list[list[str]]]:
    if run.kind == "serving":
        return LEVEL_FIELDS, [[_cell(getattr(lv, f)) for f in LEVEL_FIELDS] for lv in run.levels]
    if run.kind == "perplexity":
        return PPL_FIELDS, [[_ppl_cell(f, getattr(r, f)) for f in PPL_FIELDS] for r in run.rows]
    return ROW_FIELDS, [[_cell(getattr(r, f)) for f in ROW_FIELDS] for r in run.rows]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def _ppl_cell(name: str, value: Any) -> str:
    """Perplexity columns keep the digits a 1e-4 comparison needs."""
    if value is None:
        return ""
    if name in ("ppl", "nll"):
        return f"{value:.6f}"
    if name == "ppl_rel_diff":
        return f"{value:.2e}"
    return _cell(value)


def as_csv(run: Run) -> str:
    header, rows = _cells(run)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def as_markdown(run: Run) -> str:
    header, rows = _cells(run)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines) + "\n"


def _bar(value: float, top: float, width: int) -> str:
    if top <= 0 or value <= 0:
        return ""
    cells = value / top * width
    full = int(cells)
    part = int((cells - full) * (len(_PARTIAL) - 1))
    return _BAR * full + (_PARTIAL[part].strip() if full < width else "")


def bars(rows: list[Row], width: int = 24) -> list[str]:
    """Compact bars per test, scaled to that test's fastest mode, with the ratio to native."""
    lines: list[str] = []
    tests = list(dict.fromkeys(r.test for r in rows))
    mode_width = max((len(r.mode) for r in rows), default=6)
    for test in tests:
        group = [r for r in rows if r.test == test]
        top = max((r.tps_mean or 0.0) for r in group)
        lines.append(test)
        for r in group:
            if r.tps_mean is None:
                what = "failed" if (r.skipped_reason or "").startswith("failed") else "skipped"
                lines.append(f"  {r.mode:<{mode_width}} {what:<{width}}")
                continue
            ratio = f" {r.ratio_to_native:.2f}x" if r.ratio_to_native is not None else ""
            lines.append(f"  {r.mode:<{mode_width}} {_bar(r.tps_mean, top, width):<{width}} "
                         f"{r.tps_mean:>9.1f} t/s{ratio}")
    return lines


def table(run: Run) -> RenderableType:
    """The rich view: the llama-bench table with bars beside it, or the serving table."""
    from rich.columns import Columns
    from rich.table import Table
    from rich.text import Text

    if run.kind == "serving":
        return serving_table(run.levels, title=f"serving load: {run.model}")
    if run.kind == "perplexity":
        return perplexity_table(run)
    t = Table(title=f"llama-bench: {run.model}", title_justify="left")
    for name, justify in (("mode", "left"), ("backend", "left"), ("client", "left"), ("transport", "left"),
                          ("test", "left"),
                          ("t/s", "right"), ("± std", "right"), ("vs native", "right")):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in run.rows:
        if r.tps_mean is None:
            failed = (r.skipped_reason or "").startswith("failed")
            t.add_row(r.mode, r.backend or "", r.client or "", r.transport or "", r.test,
                      Text("failed", style="red") if failed else Text("skipped", style="yellow"), "", "")
            continue
        ratio = f"{r.ratio_to_native:.2f}x" if r.ratio_to_native is not None else ""
        t.add_row(r.mode, r.backend or "", r.client or "", r.transport or "", r.test, f"{r.tps_mean:.2f}",
                  _fmt(r.tps_std), ratio)
    bar_text = Text("\n".join(bars(run.rows)))
    return Columns([t, bar_text], padding=(1, 4))


def perplexity_table(run: Run) -> RenderableType:
    """Perplexity per mode, its difference from native's, and a flag where it is over the tolerance."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    tolerance = run.params.get("tolerance")
    title = f"perplexity: {run.model}" + (f" (tolerance {tolerance:g})" if tolerance else "")
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in (("mode", "left"), ("backend", "left"), ("via", "left"), ("ctx", "right"),
                          ("chunks", "right"), ("PPL", "right"), ("vs native", "right"), ("", "left")):
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in run.rows:
        via = r.transport or r.client or ""
        ctx, chunks = _cell(r.ctx_size), _cell(r.chunks)
        if r.ppl is None:
            failed = (r.skipped_reason or "").startswith("failed")
            t.add_row(r.mode, r.backend or "", via, ctx, chunks,
                      Text("failed", style="red") if failed else Text("skipped", style="yellow"), "", "")
            continue
        diff = "" if r.ppl_rel_diff is None else f"{r.ppl_rel_diff:+.1e}"
        flag = (Text("differs", style="bold red") if r.matches_native is False
                else Text("same", style="green") if r.matches_native else Text(""))
        t.add_row(r.mode, r.backend or "", via, ctx, chunks, f"{r.ppl:.4f}", diff, flag)
    return t


def skipped_notes(run: Run) -> list[str]:
    """One line per mode that did not run (failures are reported as the error instead)."""
    seen: dict[str, str] = {}
    for r in run.rows:
        if r.skipped_reason and r.mode not in seen and not r.skipped_reason.startswith("failed"):
            seen[r.mode] = r.skipped_reason
    return [f"{mode}: {reason}" for mode, reason in seen.items()]


def mode_notes(run: Run) -> list[str]:
    """What a row's number means on this host, where it is not what the mode's name promises (a
    remoting backend on the CPU measures the transport, not a speed-up)."""
    return [f"{mode}: {run.system.extra[mode]}" for mode in ("remoting",) if run.system.extra.get(mode)]


def serving_table(levels: list[LevelResult], title: str = "serving load") -> RenderableType:
    from rich import box
    from rich.table import Table

    t = Table(title=f"{title} (latencies in ms)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    compared = any(lv.mode for lv in levels)  # `bench MODEL --serving`: native and remoting rows in turn
    if compared:
        t.add_column("mode", no_wrap=True)
    for name in ("conc", "ok", "err", "TTFT\np50", "TTFT\np95", "ITL\np50", "ITL\np95", "tok/s\n/req",
                 "tok/s\ntotal", "req/s"):
        t.add_column(name, justify="right", no_wrap=True)
    if compared:
        t.add_column("vs\nnative", justify="right", no_wrap=True)
    for lv in levels:
        cells = [str(lv.concurrency), f"{lv.completed}/{lv.requests}",
                 f"[red]{lv.errors}[/]" if lv.errors else "0",
                 _fmt(lv.ttft_p50_ms, 1), _fmt(lv.ttft_p95_ms, 1), _fmt(lv.itl_p50_ms, 1),
                 _fmt(lv.itl_p95_ms, 1), _fmt(lv.output_tps_per_request, 1), _fmt(lv.output_tps_total, 1),
                 _fmt(lv.request_throughput, 2)]
        if compared:
            mode = f"{lv.mode} ({lv.transport})" if lv.mode != "native" and lv.transport else (lv.mode or "")
            ratio = f"{lv.ratio_to_native:.2f}x" if lv.ratio_to_native is not None else ""
            cells = [mode, *cells, ratio]
        t.add_row(*cells)
    return t


def history_table(runs: list[Run]) -> RenderableType:
    from rich.table import Table

    t = Table(title="saved benchmarks (newest first)", title_justify="left")
    t.add_column("id", no_wrap=True)
    t.add_column("UTC", no_wrap=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("model", overflow="ellipsis", max_width=20)
    t.add_column("summary", overflow="fold", ratio=1)
    for run in runs:
        kind = "bench" if run.kind == "llama-bench" else run.kind
        t.add_row(run.id, run.created.replace("T", " ")[5:16], kind, run.model, run.summary())
    return t


def compare_table(a: Run, b: Run, changes: list[Change]) -> RenderableType:
    from rich.table import Table

    t = Table(title=f"{a.id} → {b.id}", title_justify="left")
    for name, justify in (("what", "left"), ("metric", "left"), (a.id, "right"), (b.id, "right"),
                          ("change", "right")):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in changes:
        change = ""
        if c.change is not None:
            style = "green" if c.better else ("red" if c.better is False else "")
            text = f"{c.change * 100:+.1f}%"
            change = f"[{style}]{text}[/]" if style else text
        t.add_row(c.key, c.metric, _fmt(c.a), _fmt(c.b), change)
    return t


# --- the chart ------------------------------------------------------------------------------------


def require_matplotlib() -> None:
    """Fail before benchmarking when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ApirctlError("--plot needs matplotlib, which is not installed",
                           hint="install the plot extra: pip install 'apirctl[plot]'") from None


def plot(run: Run, path: Path) -> Path:
    """Bar chart like the seeds' figures: t/s per mode for each test, error bars, ratio labels."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if path.suffix.lower() != ".png":
        raise ApirctlError(f"--plot {path}: the chart is written as PNG; name the file *.png")
    tests = list(dict.fromkeys(r.test for r in run.rows))
    if not tests:
        raise ApirctlError("nothing to plot: the run has no rows")
    fig, axes = plt.subplots(1, len(tests), figsize=(4.5 * len(tests), 4.2), squeeze=False)
    colours = {"native": "#4c72b0", "remoting": "#55a868", "container": "#c44e52"}
    for ax, test in zip(axes[0], tests, strict=True):
        group = [r for r in run.rows if r.test == test]
        names = [r.mode for r in group]
        values = [r.tps_mean or 0.0 for r in group]
        errors = [r.tps_std or 0.0 for r in group]
        bars_ = ax.bar(names, values, yerr=errors, capsize=4,
                       color=[colours.get(n, "#8172b2") for n in names])
        top = max((v + e for v, e in zip(values, errors, strict=True)), default=0.0) or 1.0
        for bar, r, err in zip(bars_, group, errors, strict=True):
            label = "n/a" if r.tps_mean is None else (
                f"{r.ratio_to_native:.0%}" if r.ratio_to_native is not None else f"{r.tps_mean:.1f}")
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + err + top * 0.02, label,
                    ha="center", va="bottom", fontsize=9)
        ax.set_title(test)
        ax.set_ylabel("tokens/s")
        ax.set_ylim(0, top * 1.15)
    fig.suptitle(f"{run.model} ({run.system.host_backend or 'host'} native)", fontsize=11)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ApirctlError(f"cannot write {path}: {exc}") from None
    finally:
        plt.close(fig)
    return path
