"""Ports for tests that run side by side: each asks the kernel for one nobody holds, never a fixed
number that another worker may be serving on."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free at the time of asking."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
