"""Printing helpers shared by the command modules: one console, JSON, one-line errors."""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from apirctl.errors import ApirctlError


@lru_cache(maxsize=1)
def console() -> Console:
    from rich.console import Console

    return Console(highlight=False)


@lru_cache(maxsize=1)
def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colours, stable key order."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(exc: ApirctlError) -> None:
    from rich.markup import escape

    err_console().print(f"[bold red]apirctl: error:[/] {escape(exc.message)}", soft_wrap=True)
    if exc.hint:
        err_console().print(f"[dim]hint: {escape(exc.hint)}[/]", soft_wrap=True)


def not_implemented(what: str) -> None:
    """For commands whose issue has not landed: say so and exit 2, never pretend."""
    from apirctl.errors import NotImplementedYet

    raise NotImplementedYet(what)
