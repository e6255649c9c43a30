"""A short flag means one thing in every command, and docs/cli.md's table says which.

The app is walked as the parser sees it (every group and command, their options and help option),
so a flag added anywhere is checked without a list to keep up to date here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DOC = Path(__file__).parents[2] / "docs" / "cli.md"


def short_flags() -> dict[str, dict[str, list[str]]]:
    """short flag -> {its long name -> the commands where it means that}."""
    from apirctl.cli.root import build_command

    found: dict[str, dict[str, list[str]]] = {}

    def walk(cmd: Any, path: list[str], parent: Any) -> None:
        # typer carries its own copy of click: its classes, reached through the command
        ctx = cmd.context_class(cmd, info_name=path[-1] if path else "apirctl", parent=parent, **cmd.context_settings)
        where = " ".join(path) or "apirctl"
        for param in [*cmd.params, cmd.get_help_option(ctx)]:
            if getattr(param, "param_type_name", "") != "option":
                continue
            for names in (param.opts, param.secondary_opts):
                longs = [n for n in names if n.startswith("--")]
                for short in (n for n in names if not n.startswith("--")):
                    assert longs, f"{where}: {short} has no long form"
                    found.setdefault(short, {}).setdefault(longs[0], []).append(where)
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name], ctx)

    walk(build_command(), [], None)
    return found


def documented() -> dict[str, str]:
    rows = re.findall(r"^\| `(-\w)` \| `(--[\w-]+)` \|", DOC.read_text(), re.MULTILINE)
    return dict(rows)


def test_every_short_flag_has_one_meaning() -> None:
    clashes = {short: meanings for short, meanings in short_flags().items() if len(meanings) > 1}
    assert not clashes, f"short flags with several meanings: {clashes}"


def test_the_documented_table_is_the_apps() -> None:
    app = {short: next(iter(meanings)) for short, meanings in short_flags().items()}
    assert documented() == app


def test_the_conventions_hold_where_users_expect_them() -> None:
    flags = short_flags()
    assert {"serve", "run", "chat"} <= set(flags["-p"]["--port"])
    assert {"serve", "run", "chat"} <= set(flags["-n"]["--name"])
    assert {"serve", "run", "chat"} <= set(flags["-c"]["--ctx-size"])
    assert {"logs", "machine logs"} <= set(flags["-f"]["--follow"])
    assert len(flags["-h"]["--help"]) > 40  # every command


def test_an_old_chat_prompt_after_p_says_where_the_prompt_goes() -> None:
    """`chat -p 'TEXT'` (-p was the prompt before it was the port): a usage error that teaches."""
    done = subprocess.run([sys.executable, "-m", "apirctl", "chat", "-p", "Why is the sky blue?"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "APIRCTL_RESIDENT": "0"})
    assert done.returncode == 2
    assert "is not a port" in done.stderr and "apirctl chat 'TEXT'" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
