"""`apirctl apir`: the APIR protocol library's tools (headers, function table)."""

from __future__ import annotations

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
