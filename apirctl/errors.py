"""The one exception type the CLI turns into a one-line error and an exit code.

Library code raises `ApirctlError` (or a subclass) for anything the user can fix;
the CLI prints `apirctl: error: <message>` and exits with `exit_code`, never a traceback.
"""

from __future__ import annotations

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


def last_line(output: str | None, default: str = "(no output)") -> str:
    """The last non-blank line of a tool's output: what a one-line error quotes as the reason."""
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    return lines[-1] if lines else default
