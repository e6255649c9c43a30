"""Which platform this host is: decided here and nowhere else.

`APIRCTL_PLATFORM=macos|linux` overrides what `sys.platform` says, so that the tests drive the
macOS code paths on Linux against the fakes in tests/support/fakes. What depends on the toolchain of the
machine itself (the libraries a build makes, the system tools there are) asks `os_is_macos`, which
no variable changes.
"""

from __future__ import annotations

import functools
import os
import subprocess
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


#: Where a glibc loader looks by itself when it cannot be asked (the usual built-in folders).
DEFAULT_LOADER_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")
_LOADERS = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1")


@functools.cache
def loader_search_dirs() -> tuple[str, ...]:
    """The folders this host's dynamic loader searches without its cache or LD_LIBRARY_PATH.

    apirctl's images carry this loader but no cache: a library placed anywhere else (CUDA's runtime
    under /usr/local/cuda, a driver under /usr/local/nvidia) is not found in them unless it is put
    where they look."""
    for loader in _LOADERS:
        if not os.path.exists(loader):
            continue
        try:
            out = subprocess.run([loader, "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            break
        found = tuple(line.split()[0] for line in out.splitlines() if line.rstrip().endswith("(system search path)"))
        if found:
            return found
    return DEFAULT_LOADER_DIRS
