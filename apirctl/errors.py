"""The one exception type the CLI turns into a one-line error and an exit code.

Library code raises `ApirctlError` (or a subclass) for anything the user can fix;
the CLI prints `apirctl: error: <message>` and exits with `exit_code`, never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

#: Exit codes (docs/exit-codes.md): 1 a failure, 2 a usage error (click's), 3 a prerequisite missing
#: (a tool not installed, llama.cpp or the image not built), 130 interrupted. `machine status` has its own.
MISSING = 3


class ApirctlError(Exception):
    """A user-facing failure: one line of text, and the exit code to leave with."""

    exit_code: int = 1

    def __init__(self, message: str, exit_code: int | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


#: How much of a log file `tail` reads: its end holds the reason, and a build log can be megabytes.
TAIL_BYTES = 64 * 1024


def tail(output: str | Path | None, lines: int = 1, *, telling: Iterable[str] = (), default: str = "") -> str:
    """The end of a tool's output (its text, or a log file's last 64 KiB): what an error or a log view quotes.

    The last `lines` non-blank lines, right-stripped and joined by newlines; a single line comes stripped,
    ready for a one-line error. With `telling` words, the last line holding one of them (in any case)
    comes instead when there is one: a library's last complaint rather than its farewell. `default` when
    there is nothing to quote (no output, a missing or unreadable file). The one helper for this: the
    reason a tool gave and a log's last lines are both its job.
    """
    if isinstance(output, Path):
        try:
            with output.open("rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - TAIL_BYTES))
                output = fh.read().decode(errors="replace")
        except OSError:
            return default
    kept = [line.rstrip() for line in (output or "").splitlines() if line.strip()]
    words = [word.lower() for word in telling]
    if words:
        for line in reversed(kept):
            if any(word in line.lower() for word in words):
                return line.strip()
    if not kept:
        return default
    return kept[-1].strip() if lines == 1 else "\n".join(kept[-lines:])
