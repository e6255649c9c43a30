"""`apirctl config`: the effective settings and where each came from."""

from __future__ import annotations

import typer

app = typer.Typer(help="Show apirctl's settings (defaults < config file < APIRCTL_* variables < flags).",
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
