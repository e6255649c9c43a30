"""A warm apirctl process that runs commands in forks of itself, so a command starts in milliseconds.

Why: every `apirctl` process pays for the interpreter, typer, pydantic and apirctl's own modules
(0.25-0.4 s on a small machine) before it does anything, which is most of the difference between
`apirctl serve` and `podman run` (docs/performance.md). The resident process imports all of that
once; each command then runs in a `fork()` of it, with the caller's arguments, environment,
working directory and terminal (its stdin, stdout and stderr are passed over a unix socket with
SCM_RIGHTS), so it behaves as if it had been started directly.

The client half (`run`) is what `apirctl` does first: it needs only the standard library's socket
layer. When no resident process answers, the command runs in the calling process as before, and a
resident process is started in the background for the next command (`spawn`). It exits after
`IDLE_SECONDS` without a command, and at once when apirctl's code or installed packages changed
since it started (so an upgrade or an edit is never served by stale code). `APIRCTL_RESIDENT=0`
turns it off; `apirctl resident status|stop` shows and stops it.

Security: the socket lives in a directory only the user can enter (mode 0700), and on Linux each
connection's peer uid is checked (SO_PEERCRED) before anything runs.
"""

from __future__ import annotations

import marshal
import os
import struct
import sys
import zlib

TYPE_CHECKING = False  # typing costs the client 15 ms of a 30 ms start: only for the type checker
if TYPE_CHECKING:
    from typing import Any

PROTOCOL = 1
IDLE_SECONDS = 15 * 60
ENV_SWITCH = "APIRCTL_RESIDENT"  # "0" turns the resident process off
ENV_DIR = "APIRCTL_RESIDENT_DIR"  # where the socket lives (tests use their own)
_HEADER = struct.Struct("!I")  # each message: its length, then marshal data (one interpreter on both ends)


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """On unless APIRCTL_RESIDENT=0, and only for a plain interpreter: options such as `-X importtime`,
    `-W error` or `-O` act at start-up, so a command started with them runs in its own process."""
    if environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "no", "false", "off"):
        return False
    flags = sys.flags
    return not (sys._xoptions or sys.warnoptions or flags.dev_mode or flags.optimize or flags.inspect
                or flags.isolated or flags.no_site or flags.ignore_environment)


def runtime_dir() -> str:
    """A per-user directory for the socket: $APIRCTL_RESIDENT_DIR, $XDG_RUNTIME_DIR/apirctl or /tmp."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "apirctl")
    return f"/tmp/apirctl-{os.getuid()}"


def package_dir() -> str:
    """This copy of apirctl (the folder of the `apirctl` package)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def identity() -> str:
    """What a resident process must share with its caller to run its commands: the interpreter,
    this copy of apirctl, the import path (without its first entry, the script's folder or the
    working directory, which differ between `apirctl` and `python -m apirctl`), and the variables
    the interpreter reads only when it starts (PYTHON*, the locale)."""
    startup = sorted(f"{k}={v}" for k, v in os.environ.items()
                     if k.startswith("PYTHON") or k in ("LANG", "LC_ALL", "LC_CTYPE"))
    return "\0".join([os.path.realpath(sys.executable), package_dir(), *sys.path[1:], *startup])


def socket_path() -> str:
    key = zlib.crc32(identity().encode()) & 0xFFFFFFFF
    return os.path.join(runtime_dir(), f"resident-{key:08x}.sock")


# --- the wire: length-prefixed marshal messages -------------------------------------------------


def frame(message: dict[str, Any]) -> bytes:
    data = marshal.dumps(message)
    return _HEADER.pack(len(data)) + data


class Reader:
    """Messages from a stream socket, one frame at a time."""

    def __init__(self, conn: Any, data: bytes = b"") -> None:
        self.conn, self.data = conn, data

    def _fill(self, size: int) -> bool:
        while len(self.data) < size:
            chunk = self.conn.recv(65536)
            if not chunk:
                return False
            self.data += chunk
        return True

    def next(self) -> dict[str, Any] | None:
        """The next message; None at the end of the stream (or a cut one)."""
        if not self._fill(_HEADER.size):
            return None
        (size,) = _HEADER.unpack(self.data[:_HEADER.size])
        if not self._fill(_HEADER.size + size):
            return None
        body, self.data = self.data[_HEADER.size:_HEADER.size + size], self.data[_HEADER.size + size:]
        message = marshal.loads(body)
        return message if isinstance(message, dict) else None


from apirctl.resident.client import run, spawn, status, stop  # noqa: E402 - the public surface

__all__ = ["enabled", "identity", "run", "runtime_dir", "socket_path", "spawn", "status", "stop"]
