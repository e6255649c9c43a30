"""`apirctl apir`: the APIR protocol library's tools."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented

app = typer.Typer(help="The APIR frontend/backend protocol: generate and check its C headers.", no_args_is_help=True)


@app.command()
def generate(out: str = typer.Option(..., "--out", help="Directory to write the headers to.")) -> None:
    """Write the three generated C headers from apirctl's function table."""
    not_implemented("apir generate")
