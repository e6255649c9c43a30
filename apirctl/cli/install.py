"""`apirctl install` / `uninstall`: API-remoting bundles (macOS)."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented


def install(source: str = typer.Option(None, "--from", help="Release tarball, directory or URL.")) -> None:
    """Import an API-remoting release bundle, or build one (macOS)."""
    not_implemented("install")


def uninstall(version: str = typer.Argument(None, help="Bundle version.")) -> None:
    """Remove an installed bundle."""
    not_implemented("uninstall")


def register(app: typer.Typer) -> None:
    app.command()(install)
    app.command()(uninstall)
