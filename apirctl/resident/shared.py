"""What the resident process and its client share: the switch, the socket's place (from the
identity both must share) and the wire format (length-prefixed marshal messages)."""

from __future__ import annotations

import marshal
import os
import struct
import sys
import zlib

TYPE_CHECKING = False  # typing costs the client 15 ms of a 30 ms start: only for the type checker
if TYPE_CHECKING:
    from typing import Any

PROTOCOL = 2  # 2: the caller confirms ("go") before the command runs
IDLE_SECONDS = 15 * 60
ENV_ANSWER = "APIRCTL_RESIDENT_ANSWER_SECONDS"  # the caller's wait, longer (tests that need the fork, under load)


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


# How long the caller waits for the resident process to take its command (connect, send, the child's
# pid) before it runs the command itself; and how long the resident process waits for a request.
ANSWER_SECONDS = _seconds(ENV_ANSWER, 2.0)
REQUEST_SECONDS = 2.0
# How long a child waits for the caller's "go" after sending its pid: at least as long as a caller may
# wait for that pid, so a caller that got the pid in time is never left without its command.
CONFIRM_SECONDS = max(REQUEST_SECONDS, ANSWER_SECONDS)
MAX_REQUEST = 1 << 20
ENV_SWITCH = "APIRCTL_RESIDENT"  # "1" turns the resident process on, "0" off (default: the config file)
ENV_DIR = "APIRCTL_RESIDENT_DIR"  # where the socket lives (tests use their own)
_HEADER = struct.Struct("!I")  # each message: its length, then marshal data (one interpreter on both ends)


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Off unless turned on: APIRCTL_RESIDENT=1, or `resident = true` in the config file (the variable
    wins, as every APIRCTL_* variable does). Only for a plain interpreter: options such as
    `-X importtime`, `-W error` or `-O` act at start-up, so a command started with them runs in its
    own process."""
    switch = environ.get(ENV_SWITCH, "").strip().lower()
    if switch in ("0", "no", "false", "off"):
        return False
    if switch not in ("1", "yes", "true", "on") and not _config_turns_on(environ):
        return False
    flags = sys.flags
    return not (sys._xoptions or sys.warnoptions or flags.dev_mode or flags.optimize or flags.inspect
                or flags.isolated or flags.no_site or flags.ignore_environment)


def config_path(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """apirctl's config file, as `apirctl.paths.dirs().config_file` finds it, with the standard library
    only (platformdirs' user config folder on Linux and macOS; a test keeps the two in step)."""
    home = environ.get("APIRCTL_HOME")
    if home:
        return os.path.join(os.path.abspath(os.path.expanduser(home)), "config", "config.toml")
    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Application Support")
    else:
        base = environ.get("XDG_CONFIG_HOME", "").strip() or os.path.expanduser("~/.config")
    return os.path.join(base, "apirctl", "config.toml")


def _config_turns_on(environ: dict[str, str] | os._Environ[str]) -> bool:
    """`resident = true` in the config file. The file is parsed only when it mentions `resident`; an
    unreadable or invalid one counts as off (the command then reports it)."""
    try:
        with open(config_path(environ), "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    if b"resident" not in data:
        return False
    try:
        import tomllib  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef,unused-ignore]
    try:
        return tomllib.loads(data.decode("utf-8")).get("resident") is True
    except (ValueError, UnicodeDecodeError):
        return False


def suitable(argv: list[str], environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether a command may run in (and start) the resident process. Not `resident ...` itself
    (`resident stop` must never start one), and not shell completion: it finds the shell from its
    parent process, which would be the resident process."""
    if argv[:1] == ["resident"] or "--show-completion" in argv or "--install-completion" in argv:
        return False
    return "_APIRCTL_COMPLETE" not in environ


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
