"""The `apirctl` command line: parsing and printing only.

Each command lives in its own module under `apirctl/cli/`; command modules import
only typer and the standard library at import time and import the library modules
that do the work inside the command function, so `apirctl --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from apirctl import __version__
from apirctl.cli import (
    apir,
    backend,
    bench,
    chat,
    config,
    diagnose,
    install,
    machine,
    models,
    serve,
    setup,
)

app = typer.Typer(
    name="apirctl",
    help=(
        "Near-native GPU speed for llama.cpp in Podman containers, by API remoting: the container's "
        "GGML backend calls run on the host's GPU.\n\n"
        "Start here: `apirctl setup`, then `apirctl machine restart --remoting`, "
        "`apirctl serve smollm2` and `apirctl chat`."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"apirctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Root options."""


app.add_typer(machine.app, name="machine")
serve.register(app)
chat.register(app)
app.add_typer(bench.app, name="bench")
app.add_typer(models.app, name="models")
install.register(app)
app.add_typer(backend.app, name="backend")
setup.register(app)
diagnose.register(app)
app.add_typer(config.app, name="config")
app.add_typer(apir.app, name="apir")


def main() -> None:
    """Console entry point: run the app, turning user-facing errors into one line and an exit code."""
    import signal

    from apirctl.errors import ApirctlError

    def _terminate(signum: int, frame: object) -> None:
        # `kill`/`timeout` get the same clean-up as Ctrl-C: containers and processes we started go away.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except ApirctlError as exc:
        from apirctl.cli.output import error

        error(exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("apirctl: interrupted", file=sys.stderr)
        sys.exit(130)
