"""`apirctl apir`: the APIR protocol library's tools (headers, function table)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    help="The APIR protocol the ggml-virtgpu frontend (guest) and backend (host) speak: its function "
    "table, and the C headers generated from it.",
    no_args_is_help=True,
)


@app.command(
    help="Write apir_backend.gen.h, virtgpu-forward.gen.h and backend-dispatched.gen.h from apirctl's table.\n\n"
    "These are the headers upstream generates from its YAML; `apirctl apir check` compares them with the pinned "
    "llama.cpp source."
)
def generate(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the three headers to (created if missing).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the written paths as JSON.")] = False,
) -> None:
    """Write apir_backend.gen.h, virtgpu-forward.gen.h and backend-dispatched.gen.h from apirctl's table."""
    from apirctl.apir import headers
    from apirctl.cli.output import console, print_json
    from apirctl.errors import ApirctlError

    if out.exists() and not out.is_dir():
        raise ApirctlError(f"{out} exists and is not a directory")
    try:
        paths = headers.write(out)
    except OSError as exc:
        raise ApirctlError(f"cannot write headers to {out}: {exc.strerror}") from None
    if json_out:
        print_json({"written": [str(p) for p in paths]})
    else:
        for p in paths:
            console().print(f"wrote {p}")


@app.command(
    help="Compare our generated headers with a llama.cpp tree's: enum values, command names, prototypes.\n\n"
    "Exits 1 when they differ, so a newer upstream that changed the protocol is caught."
)
def check(
    source: Annotated[
        Path | None, typer.Option("--source", help="A llama.cpp tree (default: the pinned source apirctl builds).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the differences as JSON.")] = False,
) -> None:
    """Compare our generated headers with a llama.cpp tree's: enum values, command names, prototypes."""
    from apirctl.apir import headers
    from apirctl.cli.output import console, print_json
    from apirctl.errors import ApirctlError

    if source is None:
        from apirctl.build import llamacpp

        source = llamacpp.source_dir()
    vdir = source / "ggml" / "src" / "ggml-virtgpu"
    if not vdir.is_dir():
        raise ApirctlError(f"{source} has no ggml/src/ggml-virtgpu", hint="pass a llama.cpp source tree")
    try:
        diffs = headers.compare_with_source(vdir)
    except OSError as exc:
        raise ApirctlError(f"cannot read upstream headers: {exc}") from None
    same = not any(diffs.values())
    if json_out:
        print_json({"same": same, "differences": diffs})
    else:
        for name, lines in diffs.items():
            console().print(f"{name}: " + ("same declarations" if not lines else f"{len(lines)} difference(s)"))
            for line in lines:
                console().print(f"  {line}")
    if not same:
        raise typer.Exit(1)


@app.command("table")
def show_table(
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the function reference of docs/apir.md.")] = False,
) -> None:
    """List the forwarded functions: command index, request fields and reply fields."""
    from apirctl.apir import table
    from apirctl.cli.output import console, print_json

    if markdown:
        from apirctl.apir import reference

        print(reference.markdown())
        return

    rows: list[dict[str, Any]] = [
        {
            "index": f.index,
            "name": f.qualname,
            "deprecated": f.deprecated,
            "request": [f"{x.name}:{x.kind.value}" for x in f.request],
            "reply": [f"{x.name}:{x.kind.value}" for x in f.reply],
        }
        for f in table.functions()
    ]
    if json_out:
        print_json(rows)
        return
    from rich.table import Table

    t = Table("#", "function", "request", "reply")
    for r in rows:
        name = str(r["name"]) + (" (deprecated)" if r["deprecated"] else "")
        t.add_row(str(r["index"]), name, ", ".join(r["request"]) or "-", ", ".join(r["reply"]) or "-")
    console().print(t)


@app.command(
    help="Decode one APIR command (header and request fields), e.g. from a capture or a log.\n\n"
    "Example: `apirctl apir decode 020000001400000009000000010000000000000007000000` is a FORWARD of "
    "buffer_clear (buffer 1, value 7) answered in resource 9."
)
def decode(
    data: Annotated[str, typer.Argument(help="The command as hex, or @FILE for raw bytes from a file.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the decoded fields as JSON.")] = False,
) -> None:
    """Decode one APIR command (header and request fields), e.g. from a capture or a log."""
    from apirctl.apir import messages
    from apirctl.apir.wire import ApirDecodeError
    from apirctl.cli.output import print_json
    from apirctl.errors import ApirctlError

    if data.startswith("@"):
        try:
            raw = Path(data[1:]).read_bytes()
        except OSError as exc:
            raise ApirctlError(f"cannot read {data[1:]}: {exc.strerror}") from None
    else:
        try:
            raw = bytes.fromhex(data.replace(" ", ""))
        except ValueError:
            raise ApirctlError("not hexadecimal bytes", hint="pass hex digits, or @FILE for a binary file") from None
    try:
        described = messages.describe(raw)
    except ApirDecodeError as exc:
        raise ApirctlError(f"cannot decode: {exc}") from None
    if json_out:
        print_json(described)
        return
    from rich.markup import escape

    from apirctl.cli.output import console

    head = f"{described['command']} {described.get('function', '')}".strip()
    console().print(f"{escape(head)} (reply in resource {described['reply_res_id']})")
    for key, value in described.get("request", {}).items():
        console().print(f"  {key} = {escape(repr(value))}")
    if "guest_version" in described:
        console().print(f"  guest version {described['guest_version']}")


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _trace_line(record: Any, origin: int, with_arguments: bool) -> str:
    """One record as a line: index, time since the first command, function, sizes, time, outcome."""
    at = (record.start_ns - origin) / 1e6
    line = (f"{record.index:>7} {at:>12.3f} ms  {record.name:<28} {len(record.request):>6} B -> "
            f"{len(record.reply):>5} B  {record.duration_ns / 1e3:>10.1f} us  {record.outcome}")
    if with_arguments:
        problem = record.problem()
        if problem:
            line += f"\n          undecodable: {problem}"
        else:
            args = record.arguments()
            for part in ("request", "reply"):
                if args.get(part):
                    shown = ", ".join(f"{k}={_short(v)}" for k, v in args[part].items())
                    line += f"\n          {part}: {shown}"
    return line


def _short(value: Any) -> str:
    """A decoded value in one short piece: tensors by name, op and shape."""
    if isinstance(value, dict) and "ne" in value:
        return f"<tensor {value.get('name') or '?'} op={value.get('op')} ne={list(value.get('ne') or [])}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@app.command(
    help="Decode a trace written by `apir-host --trace`: each command, the forwarded function's name, request "
    "and reply sizes, the host's time, and a summary (calls per function, total time, calls per graph "
    "compute, i.e. per generated token).\n\n"
    "Tracing is turned on per server with `apirctl serve MODEL --transport virtgpu --apir-trace` (Linux); "
    "`--server NAME` then finds its host's trace.\n\n"
    "Examples:\n\n"
    "  apirctl apir trace --server apirctl-smollm2 --summary\n\n"
    "  apirctl apir trace ./apir.trace --args --json\n\n"
    "  apirctl apir trace --server apirctl-smollm2 --follow"
)
def trace(
    path: Annotated[Path | None, typer.Argument(help="A trace file (default: the --server's, or the only "
                                                "traced server's).")] = None,
    server: Annotated[str | None, typer.Option("--server", help="A running server whose apir host "
                                               "writes a trace.")] = None,
    arguments: Annotated[bool, typer.Option("--args", help="Decode each command's request and reply "
                                            "fields.")] = False,
    summary_only: Annotated[bool, typer.Option("--summary", help="Print only the summary.")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep reading as the host writes (Ctrl-C "
                                         "ends); with --json, one JSON object per line.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print records and summary as JSON.")] = False,
) -> None:
    """Decode a trace written by `apir-host --trace`."""
    import json as json_lib

    from apirctl.apir import trace as decoding
    from apirctl.cli.output import print_json
    from apirctl.errors import ApirctlError

    if path is not None and server is not None:
        raise ApirctlError("give a trace file or --server, not both")
    live = path is None  # a host's own trace may be mid-write: a cut last record is where it is now
    if path is None:
        from apirctl.remoting import apir_hosts

        path = apir_hosts.trace_of(server)
    if path.is_dir():
        raise ApirctlError(f"{path} is a directory, not a trace file")
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise ApirctlError(f"cannot read {path}: {exc.strerror}") from None
    summary = decoding.Summary()
    kept: list[dict[str, Any]] = []
    origin: int | None = None
    with fh:
        try:
            for record in decoding.records(fh, follow=follow, live=live):
                summary.add(record)
                if origin is None:
                    origin = record.start_ns
                if summary_only:
                    continue
                if json_out and follow:
                    _line(json_lib.dumps(record.as_dict(arguments), default=str))
                elif json_out:
                    kept.append(record.as_dict(arguments))
                elif follow:
                    _line(_trace_line(record, origin, arguments))
                else:
                    print(_trace_line(record, origin, arguments))
        except decoding.ApirTraceError as exc:
            if not json_out and not summary_only:
                _print_summary(summary)
            raise ApirctlError(f"{path}: {exc}", hint="a trace is written by `apir-host --trace PATH`; a file cut "
                               "short is one whose host is still writing (use --follow) or died") from None
        except KeyboardInterrupt:
            if not follow:
                raise
    if json_out and follow:  # JSON lines to the end: the summary is the last one
        print(json_lib.dumps({"summary": summary.as_dict()}), flush=True)
        return
    if json_out:
        print_json({"file": str(path), **({} if summary_only else {"records": kept}), "summary": summary.as_dict()})
        return
    _print_summary(summary)


def _line(text: str) -> None:
    """One line in one write, flushed: a Ctrl-C that ends `--follow` comes between two lines, never
    between a line and its newline (print writes them apart, and the summary then joined the cut line)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _print_summary(summary: Any) -> None:
    """Plain aligned columns (a trace summary is read in terminals and pasted into reports alike)."""
    if not summary.records:
        print("no commands in the trace")
        return
    print(f"\n{summary.records} commands, {_ms(summary.host_ns)} ms in the host over {_ms(summary.span_ns)} ms"
          f"{f', {summary.failed} failed' if summary.failed else ''}")
    header = ("function", "calls", "failed", "total ms", "mean us", "max us", "request B", "reply B")
    rows = [(row.name, str(row.calls), str(row.failed), _ms(row.total_ns), f"{row.total_ns / row.calls / 1e3:.1f}",
             f"{row.max_ns / 1e3:.1f}", str(row.request_bytes), str(row.reply_bytes)) for row in summary.rows()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                       strict=True))))
    if summary.calls_per_compute is not None:
        print(f"{summary.computes} graph computes, {summary.calls_per_compute:.1f} forwarded calls per compute "
              "(per generated token in generation)")
    if summary.graph_bytes_per_compute is not None:
        print(f"graph bytes the host read: {summary.graph_bytes_per_compute / 1e3:.1f} KB per compute")
    cache = summary.graph_cache
    if cache.by_id or cache.sent or cache.unknown or cache.delta:
        print(f"graph cache: {cache.by_id} computes named a kept graph, {cache.sent} sent one, {cache.delta} updated "
              f"one by a delta, {cache.unknown} named one the host no longer kept, {cache.delta_refused} deltas were "
              f"refused; {cache.writes} writes and {cache.outputs} outputs rode along")
    if cache.outputs_placed:
        print(f"{cache.outputs_placed} of those outputs written where the caller reads them (not copied there)")
    if cache.read_calls:
        print(f"{cache.reads} reads of device memory answered in {cache.read_calls} calls "
              f"({cache.reads / cache.read_calls:.1f} a call)")
