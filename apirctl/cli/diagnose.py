"""`apirctl doctor` and `apirctl info`: what works, what to fix, and versions for bug reports."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented


def doctor(json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
    """Check everything the default path needs and say how to fix each failure."""
    not_implemented("doctor")


def info(report: bool = typer.Option(False, "--report", help="Print a block to paste into a bug report.")) -> None:
    """Print versions: apirctl, podman, the llama.cpp build, the bundle, the host."""
    not_implemented("info")


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command()(info)
