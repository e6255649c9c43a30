"""Waiting for something a test cannot be told about (a process to die, a line in a log, a server to
answer): one poll-until-true helper for the whole suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """Call `check` until it returns something true, and return that; fail the test naming `what` when
    `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(interval)
