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
    console().print(f"{key} = {config.load().settings.model_dump()[key]!r} in {path}", soft_wrap=True)


@app.command()
def unset(key: str = typer.Argument(..., help="Setting name.")) -> None:
    """Remove one setting from the config file (its default or APIRCTL_* variable applies again)."""
    from apirctl import config
    from apirctl.cli.output import console

    path = config.write_value(key, None)
    console().print(f"{key} removed from {path}", soft_wrap=True)
