"""`apirctl serve`, `ps`, `logs`, `stop`: the inference containers."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented


def serve(
    model: str = typer.Argument(None, help="Model reference: alias, path, hf://, ollama://, https://, pypi://."),
) -> None:
    """Launch a remoting-accelerated llama.cpp inference container and print its URL."""
    not_implemented("serve")


def ps(all_: bool = typer.Option(False, "--all", "-a", help="Include stopped servers.")) -> None:
    """List apirctl's inference servers."""
    not_implemented("ps")


def logs(name: str = typer.Argument(None, help="Server name.")) -> None:
    """Show a server's logs."""
    not_implemented("logs")


def stop(name: str = typer.Argument(None, help="Server name.")) -> None:
    """Stop and remove an inference server."""
    not_implemented("stop")


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(ps)
    app.command()(logs)
    app.command()(stop)
