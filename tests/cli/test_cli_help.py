"""Every command answers --help with its teaching text, and --version works, in a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _all_commands() -> list[list[str]]:
    """Every group and command of the real app, walked from its command tree."""
    import typer.main

    from apirctl.cli import app

    found: list[list[str]] = []

    def walk(cmd, path: list[str]) -> None:  # type: ignore[no-untyped-def]
        found.append(path)
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


COMMANDS = _all_commands()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
                               "APIRCTL_HOME": "/nonexistent/apirctl",
                               "APIRCTL_RESIDENT_DIR": os.environ["APIRCTL_RESIDENT_DIR"]})


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "root")
def test_help(command: list[str]) -> None:
    proc = run(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout
    # The first line of the docstring (the teaching text) is shown, never an empty help.
    body = proc.stdout.split("Usage:", 1)[1]
    assert len(body.strip().splitlines()) > 2


def test_version() -> None:
    from apirctl import __version__

    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"apirctl {__version__}"


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys; sys.argv=['apirctl','--help']\n"
        "from apirctl.cli import app\n"
        "heavy = [m for m in ('podman','httpx','pydantic','gguf','numpy','macholib','apirctl.podman.engine',"
        "'apirctl.build.llamacpp','apirctl.models') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
