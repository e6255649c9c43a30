"""The one exception type the CLI turns into a one-line error and an exit code.

Library code raises `ApirctlError` (or a subclass) for anything the user can fix;
the CLI prints `apirctl: error: <message>` and exits with `exit_code`, never a traceback.
"""

from __future__ import annotations


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


class NotImplementedYet(ApirctlError):
    """A command whose issue has not landed yet: says so and exits 2."""

    exit_code = 2

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is not implemented yet")
