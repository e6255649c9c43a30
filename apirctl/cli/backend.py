"""`apirctl backend`: drive the host remoting backend library directly."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented

app = typer.Typer(help="Test the host API-remoting backend library.", no_args_is_help=True)


@app.command()
def selftest() -> None:
    """Load the ggml-virtgpu backend library and drive it through the APIR protocol."""
    not_implemented("backend selftest")
