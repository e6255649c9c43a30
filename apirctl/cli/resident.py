"""`apirctl resident status|stop`: the warm process that runs apirctl's commands (apirctl.resident)."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="The resident apirctl process (off unless turned on with APIRCTL_RESIDENT=1 or `apirctl config set "
    "resident true`): commands run in forks of a warm interpreter, so they start in milliseconds instead of a "
    "third of a second. Once on, it starts by itself after a command, exits after 15 idle minutes or when "
    "apirctl is upgraded.",
    no_args_is_help=True,
)


@app.command()
def status(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Say whether a resident process serves this apirctl (its pid and socket). Exit 0 if one runs, 1 if not."""
    from apirctl import resident
    from apirctl.cli.output import console, print_json

    found = resident.status()
    found["enabled"] = resident.enabled()
    if json_out:
        print_json(found)
    elif found["running"]:
        console().print(f"running: pid {found['pid']}, socket {found['socket']}, "
                        f"exits after {found['idle_seconds'] // 60} idle minutes", soft_wrap=True)
    else:
        state = "not running" if found["enabled"] else \
            "off (turn it on with APIRCTL_RESIDENT=1 or `apirctl config set resident true`)"
        console().print(f"{state}; socket {found['socket']}", soft_wrap=True)
    raise typer.Exit(0 if found["running"] else 1)


@app.command()
def stop(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Stop the resident process (while it is turned on, the next command starts a new one).

    Commands that are running go on to their end.
    """
    from apirctl import resident
    from apirctl.cli.output import console, print_json

    stopped = resident.stop()
    if json_out:
        print_json({"stopped": stopped})
    else:
        console().print("stopped" if stopped else "no resident process was running")
