"""The `apirctl` typer app: every command group and command, and running it in this process.

Each command lives in its own module under `apirctl/cli/`; command modules import
only typer and the standard library at import time and import the library modules
that do the work inside the command function, so `apirctl --help` stays fast.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import typer
import typer.main

from apirctl import __version__
from apirctl.cli import (
    apir,
    backend,
    bench,
    chat,
    config,
    diagnose,
    gpu,
    install,
    machine,
    models,
    perplexity,
    resident,
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
    rich_markup_mode=None,  # help is plain text: `apirctl[plot]` stays, paragraphs reflow
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"apirctl {__version__}")
        raise typer.Exit()


@app.command("version")
def version_() -> None:
    """Print apirctl's version (`apirctl info` describes the whole installation)."""
    print(f"apirctl {__version__}")


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
perplexity.register(app)
app.add_typer(models.app, name="models")
models.register(app)
install.register(app)
app.add_typer(backend.app, name="backend")
setup.register(app)
diagnose.register(app)
app.add_typer(config.app, name="config")
app.add_typer(apir.app, name="apir")
app.add_typer(resident.app, name="resident")
app.add_typer(gpu.app, name="gpu")


def _metavar(param: Any) -> str:
    """A plain word for a value: the option's long name (PORT, CTX-SIZE) or the argument's (MODEL)."""
    longs = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return (longs[0][2:] if longs else (param.name or "value")).replace("_", "-").upper()


def build_command() -> Any:
    """The click command of `app`, with plain metavars (typer writes `<int>`, `<list[str]>`)."""
    from apirctl.cli.examples import epilog

    command = typer.main.get_command(app)

    def fix(cmd: Any, path: str = "") -> None:
        text = f"{cmd.help or ''}{cmd.epilog or ''}"
        if "xample" not in text and epilog(path):
            cmd.epilog = epilog(path)
        for param in cmd.params:
            if param.metavar is None and not getattr(param, "is_flag", False) and not getattr(param, "count", False):
                param.metavar = _metavar(param)
            if getattr(param, "param_type_name", "") == "argument":
                param.display_type_rich = lambda ctx=None: None  # the name says it: no `<str>` after it
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            fix(sub, f"{path} {name}".strip())

    fix(command)
    return command


def run(argv: list[str], command: Any = None) -> int:
    """Run `apirctl argv` in this process and return its exit status (errors become one line).

    `command` is the click command built from `app`; the resident process builds it once
    (`prepared_runner`), a plain run builds it here.
    """
    import signal

    from apirctl.errors import ApirctlError

    def _terminate(signum: int, frame: object) -> None:
        # `kill`/`timeout` get the same clean-up as Ctrl-C: containers and processes we started go away.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        # Not standalone: a usage error comes back here and becomes one line and a hint, like every
        # other error, instead of the framework's boxed usage text.
        result = (command or build_command()).main(args=argv, prog_name="apirctl", standalone_mode=False)
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except ApirctlError as exc:
        from apirctl.cli.output import error

        error(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print("apirctl: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        code = _usage_error(exc)
        if code is None:
            raise
        return code


def _usage_error(exc: Exception) -> int | None:
    """A command-line parsing error (the framework's exception, found by its interface: typer ships
    its own copy of click) as one line and a hint; None for anything else."""
    if not (hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int)):
        return None
    code = int(exc.exit_code)  # type: ignore[attr-defined]
    if type(exc).__name__ == "NoArgsIsHelpError":  # `apirctl` or a group alone: its help
        exc.show()  # type: ignore[attr-defined]
        return code
    from apirctl.cli.output import error
    from apirctl.errors import ApirctlError

    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "apirctl"
    message = " ".join(str(exc.format_message()).split())
    error(ApirctlError(message, hint=f"see `{where} -h`"))
    return code


class PreparedApp:
    """The command tree built once, for a process that forks per command (apirctl.resident): typer
    makes a pydantic adapter per option the first time it converts it, click a help option per
    command; `exercise` does that work (and an empty parse of every command) ahead of time."""

    def __init__(self) -> None:
        self.command = build_command()
        self.exercise()

    def exercise(self, samples: tuple[list[str], ...] = ()) -> None:
        """Build what parsing builds lazily; `samples` are command lines parsed too (never run)."""

        def walk(cmd: Any, parent: Any = None) -> None:
            with contextlib.suppress(Exception):  # an optimisation: parsing builds whatever is missing
                ctx = cmd.context_class(cmd, parent=parent, info_name=cmd.name, **cmd.context_settings)
                for param in [*cmd.params, cmd.get_help_option(ctx)]:
                    builder = getattr(param, "get_runtime_param", None)
                    if builder is not None:
                        builder()
                # A parse of no arguments (no callbacks, no errors) runs the parser and each converter.
                cmd.make_context(cmd.name, [], parent=parent, resilient_parsing=True)
                for sub in (getattr(cmd, "commands", None) or {}).values():
                    walk(sub, ctx)

        walk(self.command)
        commands = getattr(self.command, "commands", {})
        for name, *args in samples:  # a top-level command and its arguments
            with contextlib.suppress(Exception):
                root = self.command.make_context("apirctl", [], resilient_parsing=True)
                commands[name].make_context(name, args, parent=root, resilient_parsing=True)

    def __call__(self, argv: list[str]) -> int:
        return run(argv, self.command)
