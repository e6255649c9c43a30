"""`apirctl backend`: drive the host remoting backend library directly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Test the host API-remoting backend library (libggml-virtgpu-backend).", no_args_is_help=True)


@app.command(
    help="Load the backend library in a child process and drive it through the APIR protocol.\n\n"
    "It stands in for virglrenderer: device and buffer queries, a buffer in shared memory, tensor upload and "
    "download, a matrix product plus add checked against numpy, and the latency (median, p99) of a cheap call and "
    "of the graph compute. If the library crashes, the report names the call that crashed it. Exits 1 when "
    "anything failed.\n\n"
    "On a GPU host: `apirctl backend selftest --ggml-library .../libggml-cuda.so --reg ggml_backend_cuda_reg --json`."
)
def selftest(
    library: Annotated[
        Path | None, typer.Option("--library", help="The backend library (default: the one `apirctl setup` built).")
    ] = None,
    ggml_library: Annotated[
        Path | None,
        typer.Option(
            "--ggml-library",
            help="The GGML backend library it wraps, e.g. libggml-cuda.so (default: the host build's GPU or CPU one).",
        ),
    ] = None,
    reg: Annotated[
        str | None,
        typer.Option(
            "--reg", help="Its registration symbol, e.g. ggml_backend_cuda_reg (default: matches the library)."
        ),
    ] = None,
    calls: Annotated[int, typer.Option("--calls", min=1, help="How many cheap calls to time.")] = 1000,
    graph_calls: Annotated[int, typer.Option("--graph-calls", min=1, help="How many graph computes to time.")] = 100,
    free_shared: Annotated[
        bool,
        typer.Option(
            "--free-shared-buffer",
            help="Also free the shared-memory buffer and deinit (crashed upstream on CPU before patch 0008).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
) -> None:
    """Load the backend library in a child process and drive it through the APIR protocol."""
    from apirctl.apir import selftest as st
    from apirctl.cli.output import console, err_console, print_json
    from apirctl.macos import bundle

    library, ggml_library, reg = bundle.backend_libraries(library, ggml_library, reg)
    if json_out:
        report = st.run(library, ggml_library, reg, cheap_calls=calls, graph_calls=graph_calls, free_shared=free_shared)
        print_json(report.model_dump())
    else:
        with err_console().status("selftest") as status:
            report = st.run(
                library,
                ggml_library,
                reg,
                cheap_calls=calls,
                graph_calls=graph_calls,
                free_shared=free_shared,
                progress=lambda msg: status.update(msg),
            )
        _print(report, console())
    if not report.ok:
        raise typer.Exit(1)


def _print(report: object, out: object) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from apirctl.apir.selftest import SelftestReport
    from apirctl.errors import tail

    assert isinstance(report, SelftestReport) and isinstance(out, Console)
    out.print(f"library      {escape(report.library)}")
    out.print(f"GGML library {escape(report.ggml_library)} ({report.reg})")
    if report.device:
        d = report.device
        out.print(
            f"device       {escape(d.name)} ({d.type}): {escape(d.description)}, "
            f"{d.memory_total >> 20} MiB, buffer type {escape(d.buffer_type)}, {report.buffer_kind} buffer"
        )
    for c in report.checks:
        mark = "[green]ok[/]  " if c.ok else "[red]FAIL[/]"
        out.print(f"  {mark} {escape(c.name)}" + (f" [dim]{escape(c.detail)}[/]" if c.detail else ""))
    if report.latencies:
        t = Table("call", "calls", "median µs", "p99 µs", "min µs", "max µs")
        for lat in report.latencies:
            t.add_row(
                lat.call,
                str(lat.calls),
                f"{lat.median_us:.1f}",
                f"{lat.p99_us:.1f}",
                f"{lat.min_us:.1f}",
                f"{lat.max_us:.1f}",
            )
        out.print(t)
    for note in report.notes:
        out.print(f"[dim]note: {escape(note)}[/]")
    if report.crashed_in:
        out.print(f"[red]{escape(report.crash or '')}[/]")
        if report.stderr:
            out.print(f"[dim]{escape(tail(report.stderr, 20))}[/]")
    out.print("[green]selftest passed[/]" if report.ok else "[red]selftest failed[/]")


@app.command(
    help="Send malformed commands to the backend library and record which it rejects and which crash it.\n\n"
    "Each probe runs in its own child process, so crashes are results, not failures: the command exits 0 when "
    "every outcome matches what the pinned upstream version does on CPU (see docs/apir.md), 1 otherwise."
)
def probe(
    library: Annotated[
        Path | None, typer.Option("--library", help="The backend library (default: the host build's).")
    ] = None,
    ggml_library: Annotated[Path | None, typer.Option("--ggml-library", help="The GGML library it wraps.")] = None,
    reg: Annotated[str | None, typer.Option("--reg", help="Its registration symbol.")] = None,
    only: Annotated[list[str] | None, typer.Option("--only", help="Run only this probe (repeatable).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Send malformed commands to the backend library and record which it rejects and which crash it."""
    from apirctl.apir import probes
    from apirctl.apir.session import CRASH_WORDS
    from apirctl.cli.output import console, err_console, print_json
    from apirctl.errors import ApirctlError, tail
    from apirctl.macos import bundle

    known = {p.name for p in probes.PROBES}
    unknown = [n for n in only or [] if n not in known]
    if unknown:
        raise ApirctlError(f"unknown probe {', '.join(unknown)}", hint="known: " + ", ".join(sorted(known)))
    lib, ggml, symbol = bundle.backend_libraries(library, ggml_library, reg)
    if json_out:
        results = probes.run_all(lib, ggml, symbol, only or None)
        print_json([r.model_dump() for r in results])
    else:
        from rich.markup import escape
        from rich.table import Table

        with err_console().status("probing") as status:
            results = probes.run_all(lib, ggml, symbol, only or None, progress=lambda n: status.update(n))
        t = Table("probe", "outcome", "upstream", "detail")
        for r in results:
            colour = {"crashed": "red", "rejected": "green", "accepted": "yellow"}.get(r.outcome, "white")
            last = tail(r.stderr, telling=CRASH_WORDS)[:160]
            t.add_row(r.name, f"[{colour}]{r.outcome}[/]", r.expected, escape(r.detail + (f": {last}" if last else "")))
        console().print(t)
    if not all(r.as_expected for r in results):
        raise typer.Exit(1)
