"""`apirctl machine`: the host side of remoting (the RPC backend on Linux, krunkit on macOS)."""

from __future__ import annotations

import typer

from apirctl.cli.output import not_implemented

app = typer.Typer(
    help=(
        "Prepare and inspect the host side of API remoting.\n\n"
        "On Linux this is llama.cpp's RPC server on the host GPU, bound to loopback. On macOS it is the "
        "libkrun Podman machine, restarted with a krunkit patched to load the API-remoting virglrenderer."
    ),
    no_args_is_help=True,
)


@app.command()
def status(
    name: str = typer.Argument(None, help="Podman machine name (macOS; default: the default machine)."),
    json_out: bool = typer.Option(False, "--json", help="Print the state as JSON."),
) -> None:
    """Report the remoting state; the exit code is the state code (0 ready, 1 serving, 11 not running, 127 not installed)."""
    not_implemented("machine status")


@app.command()
def restart(
    name: str = typer.Argument(None, help="Podman machine name (macOS)."),
    remoting: bool = typer.Option(False, "--remoting", help="Restart with API remoting enabled."),
) -> None:
    """Restart the machine (macOS) or the host remoting backend (Linux)."""
    not_implemented("machine restart")


@app.command()
def stop(
    name: str = typer.Argument(None, help="Podman machine name (macOS)."),
    force: bool = typer.Option(False, "--force", help="Stop the remoting containers that depend on it first."),
) -> None:
    """Stop the machine (macOS) or the host remoting backend (Linux)."""
    not_implemented("machine stop")
