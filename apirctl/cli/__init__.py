"""The `apirctl` command line: parsing and printing only.

Each command lives in its own module under `apirctl/cli/` (the typer app is `apirctl.cli.root`);
command modules import only typer and the standard library at import time and import the library
modules that do the work inside the command function, so `apirctl --help` stays fast.

The entry point itself imports nothing but the standard library's socket layer: it first hands the
command to the resident apirctl process (`apirctl.resident`), which runs it in a fork of an
interpreter that has everything imported already, and only without one runs it here.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # `typing` is 15 ms of the entry point's start: only for the type checker
if TYPE_CHECKING:
    import typer

    app: typer.Typer


def main() -> None:
    """Console entry point: run the command (in the resident process when there is one) and exit
    with its status; user-facing errors are one line."""
    from apirctl import resident

    argv = sys.argv[1:]
    use_resident = resident.enabled() and resident.suitable(argv)
    if use_resident:
        try:
            code = resident.run(argv)
        except resident.Interrupted:
            print("apirctl: interrupted", file=sys.stderr)
            code = 130
        except resident.Lost as exc:
            print(f"apirctl: {exc}", file=sys.stderr)
            code = 1
        if code is not None:
            # Nothing of this process needs tearing down (the command ran elsewhere): skip the
            # interpreter's finalisation, a few milliseconds of every command.
            import os

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    from apirctl.cli.root import run

    code = run(argv)
    if use_resident:
        sys.stdout.flush()
        resident.spawn()
    sys.exit(code)


def __getattr__(name: str) -> object:
    """`from apirctl.cli import app` still gives the typer app, imported only when asked for."""
    if name == "app":
        from apirctl.cli.root import app

        return app
    raise AttributeError(name)
