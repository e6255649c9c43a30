"""Printing helpers shared by the command modules: one console, JSON, one-line errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from apirctl.errors import ApirctlError
    from apirctl.models import DownloadProgress


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


@contextmanager
def download_bars(enabled: bool = True) -> Iterator[DownloadProgress | None]:
    """A download bar per label on stderr, drawn from the model store's progress reports (None
    when disabled: the store then downloads silently)."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bars = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err_console(), transient=False)
    tasks: dict[str, TaskID] = {}

    def update(label: str, done: int, total: int | None) -> None:
        if label not in tasks:
            if not tasks:
                bars.start()
            tasks[label] = bars.add_task(label, total=total, completed=done)
        bars.update(tasks[label], completed=done, total=total)

    try:
        yield update
    finally:
        if tasks:
            bars.stop()
