"""`apirctl doctor` and `apirctl info`: what works, what to fix, and versions for bug reports."""

from __future__ import annotations

import typer

_MARKS = {"ok": "[green]✔[/]", "warn": "[yellow]![/]", "fail": "[red]✘[/]", "skip": "[dim]-[/]"}


def doctor(json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
    """Check everything the default path needs and say how to fix each failure.

    Checks: podman present and answering, containers can start (restricted hosts that refuse
    ulimits or crun's cgroups are detected and explained), build tools, the llama.cpp build, the
    inference image, the demo model, and a GPU backend on the host. Exit 0 when nothing failed.
    """
    from rich.markup import escape

    from apirctl.cli.output import console, print_json
    from apirctl.diagnose import doctor as checks

    def show(check: checks.Check) -> None:
        if json_out:
            return
        console().print(f"{_MARKS[check.status]} [bold]{check.name}[/]: {escape(check.detail)}", soft_wrap=True)
        if check.fix and check.status in ("fail", "warn", "skip"):
            console().print(f"    [dim]fix: {escape(check.fix)}[/]", soft_wrap=True)

    report = checks.run(on_check=show)
    if json_out:
        print_json({"ok": report.ok, "checks": [c.model_dump() for c in report.checks]})
    elif report.ok:
        console().print("[green]all good[/]")
    raise typer.Exit(0 if report.ok else 1)


def info(
    report: bool = typer.Option(False, "--report", help="Print a Markdown block to paste into a bug report."),
    json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Print versions and the host: apirctl, podman, the llama.cpp build, image, bundle, OS, CPU, GPU.

    The remoting machine state is included (the same as `apirctl machine status`).
    """
    from apirctl.cli.output import console, print_json
    from apirctl.diagnose import sysinfo
    from apirctl.errors import ApirctlError
    from apirctl.remoting import machines

    found = sysinfo.collect()
    try:
        state = machines.current().status(None)
        machine_line = f"{state.summary} (state {int(state.state)})"
    except ApirctlError as exc:
        machine_line = f"unknown ({exc})"
    if json_out:
        print_json(found.model_dump() | {"machine": machine_line})
        return
    text = sysinfo.report(found) + f"\n- remoting: {machine_line}"
    if report:
        print(text)
        return
    from rich.markup import escape

    for line in text.splitlines()[1:]:
        console().print(escape(line.lstrip("- ")), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command()(info)
