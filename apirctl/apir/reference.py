"""The function reference of docs/apir.md, generated from the table so the docs cannot drift.

`apirctl apir table --markdown` prints it; tests/apir checks docs/apir.md carries it verbatim between
the BEGIN/END markers.
"""

from __future__ import annotations

from apirctl.apir import protocol, table
from apirctl.apir.table import Field, Kind

BEGIN = "<!-- BEGIN GENERATED: apirctl apir table --markdown -->"
END = "<!-- END GENERATED -->"

_SIZES = {Kind.I32: "4", Kind.U32: "4", Kind.U8: "4", Kind.BOOL: "4", Kind.SIZE: "8", Kind.HANDLE: "8",
          Kind.RES_ID: "4", Kind.STATUS: "4", Kind.STRING: "8 + n, padded to 4", Kind.RPC_TENSOR: "304",
          Kind.INLINE_TENSOR: "336 + (8) + 336 per source"}


def _fields(fields: tuple[Field, ...]) -> str:
    if not fields:
        return "(empty)"
    return "<br>".join(f"`{f.name}` {f.kind.value} ({_SIZES[f.kind]})" for f in fields)


def markdown() -> str:
    lines = ["| # | function | request | reply | shared memory |", "| ---: | --- | --- | --- | --- |"]
    for fn in table.functions():
        name = f"`{fn.qualname}`" + (" (deprecated)" if fn.deprecated else "")
        lines.append(f"| {fn.index} | {name}: {fn.doc} | {_fields(fn.request)} | {_fields(fn.reply)} | "
                     f"{fn.shmem or '-'} |")
    lines += ["", "Return codes:", ""]
    for enum, what in ((protocol.LoadLibraryCode, "LOADLIBRARY"), (protocol.ForwardCode, "FORWARD"),
                       (protocol.BackendInitCode, "backend initialization (after LOADLIBRARY's base index)")):
        codes = ", ".join(f"{m.value} `{m.name}`" for m in enum)
        lines.append(f"- {what}: {codes}")
    lines.append(f"- dispatcher, unknown function index: {protocol.FORWARD_INDEX_INVALID}")
    return BEGIN + "\n" + "\n".join(lines) + "\n" + END


def section_of(text: str) -> str | None:
    """The generated section of a document, markers included, or None."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0:
        return None
    return text[start : end + len(END)]
