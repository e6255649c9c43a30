"""`apirctl machine`: the host side of remoting (the RPC backend on Linux, krunkit on macOS)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from apirctl.machine import MachineStatus

app = typer.Typer(
    help=(
        "Prepare and inspect the host side of API remoting.\n\n"
        "On Linux this is llama.cpp's RPC server on the host GPU, owned by apirctl: on a Unix socket in "
        "apirctl's private runtime directory (the default; each local remoting container then gets a backend "
        "of its own, over shared memory), or on 127.0.0.1 with `--listen tcp` (for SSH tunnels from other hosts). "
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
    console().print(f"[bold {colour}]{escape(status.summary)}[/]", soft_wrap=True)
    for key, value in status.details.items():
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            console().print(f"  {key}:")
            for item in value:
                console().print(f"    {escape(item)}", soft_wrap=True)
            continue
        if isinstance(value, (list, dict)):
            continue  # raw structures are for --json
        console().print(f"  {key}: {escape(str(value))}", soft_wrap=True)
    if status.next_step:
        console().print(f"[dim]next: {escape(status.next_step)}[/]", soft_wrap=True)


@app.command()
def status(
    name: str = typer.Argument(None, help=NAME_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print the state as JSON."),
) -> None:
    """Report the remoting state precisely; the exit code is the state code."""
    from apirctl.remoting import machines

    result = machines.current().status(name, gpu_memory=True)
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
    listen: str = typer.Option(
        None, "--listen", metavar="unix|tcp",
        help="Linux: where the backend listens: unix (a socket in apirctl's runtime directory; local containers "
        "get a backend each, over shared memory) or tcp (127.0.0.1, for SSH tunnels). Config: rpc_listen "
        "(default unix); --port implies tcp.",
    ),
    port: int = typer.Option(None, "--port", help="Linux: backend port on 127.0.0.1, with --listen tcp (config: "
                             "rpc_port)."),
    cache: bool = typer.Option(None, "--cache/--no-cache", help="Linux: let the backend cache weights on disk."),
    krunkit: str = typer.Option(None, "--krunkit", help="macOS: path of the krunkit to patch."),
    selftest: bool = typer.Option(True, "--selftest/--no-selftest",
                                  help="macOS: test the bundle's backend library before restarting."),
    restart_servers: bool = typer.Option(
        False, "--restart-servers",
        help="Linux: then restart the inference servers started against the previous backend (they do not "
        "reconnect by themselves). Without it, a terminal is asked; a script is told which servers and this flag.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the resulting state as JSON."),
) -> None:
    """Restart the machine (macOS) or the host remoting backend (Linux), with or without remoting.

    Without --remoting, Linux stops the backend and leaves plain containers running.
    On failure the previous working state is restored and the exit code is non-zero.
    """
    from apirctl.errors import ApirctlError
    from apirctl.machine import RestartOptions
    from apirctl.remoting import machines

    if listen is not None and listen not in ("unix", "tcp"):
        raise ApirctlError(f"--listen {listen!r}: choose unix or tcp")
    if listen == "unix" and port:
        raise ApirctlError("--port is for --listen tcp", hint="a Unix socket has no port: drop --port")
    options = RestartOptions(name=name, remoting=remoting, device=device, threads=threads, port=port, listen=listen,
                             cache=cache, krunkit=krunkit, selftest=selftest)
    from apirctl.cli.output import err_console

    with err_console().status("restarting") as shown:
        result = machines.current().restart(options, progress=shown.update)
        stale = machines.current().stale_servers()
    if stale and not restart_servers:
        for server in stale:
            err_console().print(f"{server.name}: {server.why}", soft_wrap=True, highlight=False, markup=False)
        if not json_out:
            restart_servers = _ask("restart them now?")
        if not restart_servers:
            err_console().print("[dim]hint: `apirctl machine restart --remoting --restart-servers` restarts them "
                                "(or `apirctl stop NAME`, then serve it again)[/]", soft_wrap=True)
    if stale and restart_servers:
        failed = _restart_servers([s.name for s in stale])
        result = machines.current().status(name)
        if failed:
            _print(result, json_out)
            raise ApirctlError(f"could not restart {'; '.join(failed)}",
                               hint="see `apirctl logs NAME`; or `apirctl stop NAME`, then serve it again")
    _print(result, json_out)


def _ask(question: str) -> bool:
    """A yes/no question on a terminal (yes by default); False without one: a script gets the hint."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    try:
        return typer.confirm(question, default=True, err=True)
    except typer.Abort:  # Ctrl-D or Ctrl-C at the question: a no
        return False


def _restart_servers(names: list[str]) -> list[str]:
    """Restart each server; the ones that failed, with why (the others are still restarted)."""
    from apirctl import serve
    from apirctl.cli.output import err_console
    from apirctl.errors import ApirctlError

    failed = []
    with err_console().status("restarting servers") as shown:
        for server in names:
            try:
                serve.restart(server, progress=shown.update)
            except ApirctlError as exc:
                failed.append(f"{server} ({exc})")
    return failed


@app.command()
def stop(
    name: str = typer.Argument(None, help=NAME_HELP),
    force: bool = typer.Option(False, "--force", help="Stop the remoting containers that depend on it first."),
    json_out: bool = typer.Option(False, "--json", help="Print the resulting state as JSON."),
) -> None:
    """Stop the machine (macOS) or the host remoting backend (Linux).

    Refuses while a remoting server depends on it, unless --force.
    """
    from apirctl import serve
    from apirctl.remoting import machines

    machine = machines.current()
    if force:
        for server in machine.servers(name):
            serve.stop(server.name)
    _print(machine.stop(name), json_out)


@app.command()
def logs(
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    tail: int = typer.Option(50, "--tail", help="Lines to show from the end."),
) -> None:
    """Show the host remoting backend's log (Linux: the RPC server; macOS: virglrenderer and APIR logs)."""
    from apirctl.remoting import machines

    for line in machines.current().logs(follow=follow, tail=tail):
        sys.stdout.write(line + "\n")
        if follow:
            sys.stdout.flush()
