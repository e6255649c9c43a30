"""The help screens as users read them, kept as a snapshot: a change to any of them shows in review.

Every screen is plain text at 100 columns: metavars are words (PORT, MODEL), text in brackets
(`apirctl[plot]`, `on-failure[:N]`) survives, paragraphs reflow, and every command has examples.
After an intended change: `UPDATE_HELP_SNAPSHOT=1 pytest tests/cli/test_help_snapshot.py`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).parent / "help_snapshot.txt"


def screens() -> dict[str, str]:
    import click

    from apirctl.cli.root import build_command

    found: dict[str, str] = {}

    def walk(cmd: Any, path: list[str], parent: Any) -> None:
        ctx = click.Context(cmd, info_name=path[-1] if path else "apirctl", parent=parent, terminal_width=100,
                            max_content_width=100)
        found[" ".join(["apirctl", *path])] = cmd.get_help(ctx)
        for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
            if not sub.hidden:
                walk(sub, [*path, name], ctx)

    walk(build_command(), [], None)
    return found


def render(found: dict[str, str]) -> str:
    return "".join(f"==== {name} --help\n{text}\n\n" for name, text in found.items())


def test_help_screens_match_the_snapshot() -> None:
    text = render(screens())
    if os.environ.get("UPDATE_HELP_SNAPSHOT"):
        SNAPSHOT.write_text(text)
    assert SNAPSHOT.read_text() == text, "help changed: review it, then update the snapshot (see the docstring)"


def test_help_reads_well() -> None:
    for name, text in screens().items():
        assert not re.search(r"<(int|str|float|bool|list\[\w+\]|path)( range)?>", text), name
        assert "Example" in text, f"{name} has no examples"
    assert "on-failure[:N]" in screens()["apirctl serve"]
