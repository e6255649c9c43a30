"""`apirctl machine`: the host side of remoting (the RPC backend on Linux, krunkit on macOS)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from apirctl.machine import MachineStatus

app = typer.Typer(
    help=(
        "Prepare and inspect the host side of API remoting.\n\n"
        "On Linux this is llama.cpp's RPC server on the host GPU, bound to loopback and owned by apirctl. "
        "On macOS it is the libkrun Podman machine, restarted with a krunkit patched to load the "
        "API-remoting virglrenderer, the ggml-virtgpu backend and ggml-metal.\n\n"
        "Exit codes of `machine status`: 0 ready, 1 a remoting server runs, 10 vfkit machine, "
        "11 not running, 12 running without remoting, 20 bundle version unknown, 127 not installed."
    ),
    no_args_is_help=True,
)

NAME_HELP = "Podman machine name (macOS; default: the default machine). Ignored on Linux."


def _print(status: MachineStatus, json_out: bool) -> None:
    from apirctl.cli.output import console, print_json

    if json_out:
        print_json(status.model_dump(mode="json") | {"state_name": status.state.name.lower(),
                                                    "state": int(status.state)})
        return
    from rich.markup import escape

    good = int(status.state) in (0, 1)
    colour = "green" if good else "yellow"
    console().print(f"[bold {colour}]{escape(status.summary)}[/]")
    for key, value in status.details.items():
        if isinstance(value, (list, dict)):
            continue  # raw structures are for --json
        console().print(f"  {key}: {escape(str(value))}", soft_wrap=True)
    if status.next_step:
        console().print(f"[dim]next: {escape(status.next_step)}[/]")


@app.command()
def status(
    name: str = typer.Argument(None, help=NAME_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print the state as JSON."),
) -> None:
    """Report the remoting state precisely; the exit code is the state code."""
    from apirctl import machine

    result = machine.platform().status(name)
    _print(result, json_out)
    raise typer.Exit(int(result.state))


@app.command()
def restart(
    name: str = typer.Argument(None, help=NAME_HELP),
    remoting: bool = typer.Option(
        False, "--remoting", help="Restart with API remoting (Linux: start the host RPC backend)."
    ),
    device: str = typer.Option(None, "--device", help="Linux: GGML device the backend serves (e.g. CUDA0, CPU)."),
    threads: int = typer.Option(None, "--threads", help="Linux: CPU threads of the backend."),
    port: int = typer.Option(None, "--port", help="Linux: backend port on 127.0.0.1 (config: rpc_port)."),
    cache: bool = typer.Option(None, "--cache/--no-cache", help="Linux: let the backend cache weights on disk."),
    krunkit: str = typer.Option(None, "--krunkit", help="macOS: path of the krunkit to patch."),
    selftest: bool = typer.Option(True, "--selftest/--no-selftest",
                                  help="macOS: test the bundle's backend library before restarting."),
    json_out: bool = typer.Option(False, "--json", help="Print the resulting state as JSON."),
) -> None:
    """Restart the machine (macOS) or the host remoting backend (Linux), with or without remoting.

    Without --remoting, Linux stops the backend and leaves plain containers running.
    On failure the previous working state is restored and the exit code is non-zero.
    """
    from apirctl import machine

    options = machine.RestartOptions(name=name, remoting=remoting, device=device, threads=threads, port=port,
                                     cache=cache, krunkit=krunkit, selftest=selftest)
    result = machine.platform().restart(options)
    _print(result, json_out)


@app.command()
def stop(
    name: str = typer.Argument(None, help=NAME_HELP),
    force: bool = typer.Option(False, "--force", help="Stop the remoting containers that depend on it first."),
    json_out: bool = typer.Option(False, "--json", help="Print the resulting state as JSON."),
) -> None:
    """Stop the machine (macOS) or the host remoting backend (Linux).

    Refuses while a remoting server depends on it, unless --force.
    """
    from apirctl import machine

    _print(machine.platform().stop(name, force), json_out)


@app.command()
def logs(
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    tail: int = typer.Option(50, "--tail", "-n", help="Lines to show from the end."),
) -> None:
    """Show the host remoting backend's log (Linux: the RPC server; macOS: virglrenderer and APIR logs)."""
    from apirctl import machine

    impl = machine.platform()
    show = getattr(impl, "show_logs", None)
    if show is None:
        from apirctl.cli.output import not_implemented

        not_implemented("machine logs")
    else:
        show(follow=follow, tail=tail)
