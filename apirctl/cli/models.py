"""`apirctl models`: the model store."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented

app = typer.Typer(help="Download, list, inspect and remove GGUF models.", no_args_is_help=True)


@app.command("list")
def list_() -> None:
    """List models in apirctl's store and those found from Podman AI Lab and RamaLama."""
    not_implemented("models list")


@app.command()
def pull(ref: str = typer.Argument(..., help="Model reference.")) -> None:
    """Download a model into the store."""
    not_implemented("models pull")


@app.command()
def rm(ref: str = typer.Argument(..., help="Model reference.")) -> None:
    """Remove a model from apirctl's store."""
    not_implemented("models rm")


@app.command()
def inspect(ref: str = typer.Argument(..., help="Model reference.")) -> None:
    """Show a model's GGUF metadata."""
    not_implemented("models inspect")
