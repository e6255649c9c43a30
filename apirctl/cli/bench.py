"""`apirctl bench`: native, remoting and plain-container performance side by side."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented

app = typer.Typer(help="Benchmark llama.cpp: native, remoting and container without remoting.")


@app.callback(invoke_without_command=True)
def bench(ctx: typer.Context, model: str = typer.Argument(None, help="Model reference.")) -> None:
    """Run llama-bench pp/tg in each mode and compare with native."""
    if ctx.invoked_subcommand is None:
        not_implemented("bench")
