"""`apirctl chat`: a streaming chat with any OpenAI-compatible server."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented


def chat(url: str = typer.Option(None, "--url", help="Base URL of an OpenAI-compatible server.")) -> None:
    """Chat with a served model, streaming the answer as it is generated."""
    not_implemented("chat")


def register(app: typer.Typer) -> None:
    app.command()(chat)
