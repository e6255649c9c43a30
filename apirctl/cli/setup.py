"""`apirctl setup`: build llama.cpp from the pinned source, build the image, fetch the demo model."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented


def setup(jobs: int = typer.Option(None, "--jobs", "-j", help="Parallel build jobs (default: all cores).")) -> None:
    """Build llama.cpp, the local inference image and fetch the demo model (cached: a rerun is instant)."""
    not_implemented("setup")


def register(app: typer.Typer) -> None:
    app.command()(setup)
