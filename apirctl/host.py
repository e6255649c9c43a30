"""Which platform this host is: decided here and nowhere else.

`APIRCTL_PLATFORM=macos|linux` overrides what `sys.platform` says, so that the tests drive the
macOS code paths on Linux against the fakes in tests/support/fakes. What depends on the toolchain of the
machine itself (the libraries a build makes, the system tools there are) asks `os_is_macos`, which
no variable changes.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from apirctl.errors import ApirctlError

Platform = Literal["macos", "linux"]


def name() -> Platform:
    """"macos" or "linux"; an unknown `APIRCTL_PLATFORM` is an error, not a guess."""
    chosen = os.environ.get("APIRCTL_PLATFORM", "").strip().lower()
    if not chosen:
        return "macos" if sys.platform == "darwin" else "linux"
    if chosen in ("macos", "darwin"):
        return "macos"
    if chosen == "linux":
        return "linux"
    raise ApirctlError(f"APIRCTL_PLATFORM={chosen} is not a platform", hint="use macos or linux")


def is_macos() -> bool:
    """True on macOS, where containers run in the libkrun Podman machine."""
    return name() == "macos"


def os_is_macos() -> bool:
    """True when the operating system under this process is macOS, whatever APIRCTL_PLATFORM says:
    what its compilers make, which system tools exist."""
    return sys.platform == "darwin"


def os_is_linux() -> bool:
    """True when the kernel under this process is Linux, whatever APIRCTL_PLATFORM says: what only
    Linux offers (abstract Unix sockets, /proc)."""
    return sys.platform.startswith("linux")
