"""`apirctl config`: the effective settings and where each came from."""

from __future__ import annotations

import typer

app = typer.Typer(help="Show and change apirctl's settings (defaults < config file < APIRCTL_* variables < flags).",
                  no_args_is_help=True)


@app.command()
def show(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Print every setting, its effective value and the layer that set it."""
    from apirctl import config
    from apirctl.cli.output import console, print_json
    from apirctl.paths import dirs

    loaded = config.load()
    values = loaded.settings.model_dump()
    if json_out:
        print_json({
            "config_file": str(dirs().config_file),
            "settings": {k: {"value": values[k], "source": loaded.sources[k]} for k in values},
        })
        return
    from rich.table import Table

    table = Table(title=f"config file: {dirs().config_file}", title_justify="left")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("source", style="dim")
    for key, value in values.items():
        table.add_row(key, repr(value), loaded.sources[key])
    console().print(table)


@app.command("set")
def set_(
    key: str = typer.Argument(..., help="Setting name (see `apirctl config show`)."),
    value: str = typer.Argument(..., help="New value; model_aliases takes a JSON object."),
) -> None:
    """Write one setting to the config file, validated first (e.g. `apirctl config set rpc_port 50100`)."""
    from apirctl import config
    from apirctl.cli.output import console

    path = config.write_value(key, value)
    console().print(f"{key} = {config.load(environ={}).settings.model_dump()[key]!r} in {path}", soft_wrap=True)


@app.command()
def unset(key: str = typer.Argument(..., help="Setting name.")) -> None:
    """Remove one setting from the config file (its default or APIRCTL_* variable applies again).

    Also repairs a file that no longer reads when the lines of KEY are what is wrong with it."""
    from apirctl import config
    from apirctl.cli.output import console

    path = config.write_value(key, None)
    console().print(f"{key} removed from {path}", soft_wrap=True)


@app.command()
def edit() -> None:
    """Edit the config file in $VISUAL or $EDITOR (else vi); it is saved only once it is valid.

    A broken file (not UTF-8, invalid TOML, an unknown key or a bad value) opens as it is, so it
    can be repaired; on a terminal an invalid edit is offered again, elsewhere it is not saved.
    """
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from apirctl import config
    from apirctl.cli.output import console, err_console
    from apirctl.errors import ApirctlError

    editor = shlex.split(os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi")

    def run_editor(path: Path) -> None:
        try:
            done = subprocess.run([*editor, str(path)], check=False)
        except OSError as exc:
            raise ApirctlError(f"cannot start the editor {editor[0]!r}: {exc.strerror}",
                               hint="set EDITOR to your editor, e.g. EDITOR=nano") from None
        if done.returncode != 0:
            raise ApirctlError(f"the editor {editor[0]!r} exited with status {done.returncode}; nothing was saved")

    def retry(exc: ApirctlError) -> bool:
        if not sys.stdin.isatty():
            return False
        from rich.markup import escape

        err_console().print(f"[bold red]apirctl: error:[/] {escape(exc.message)}", soft_wrap=True)
        return typer.confirm("edit it again?", default=True)

    path = config.edit(run_editor, retry)
    console().print(f"saved {path}", soft_wrap=True)
