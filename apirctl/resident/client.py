"""The caller's side: hand a command to the resident process and wait for its status (run), start
one (spawn), ask about one (status, stop). Standard library only, and its cheapest parts: this is
what every `apirctl` command imports before anything else."""

from __future__ import annotations

import _socket  # the C module under `socket`: socket.py and its selectors are 6 ms of the client
import os
import signal
import struct
import sys

from apirctl.resident.shared import ANSWER_SECONDS, PROTOCOL, Reader, frame, runtime_dir, socket_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Signals the client passes on to the command's process (it is not in the terminal's process group).
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGWINCH", "SIGUSR1", "SIGUSR2")


class Interrupted(Exception):
    """The user interrupted the command before a process took it: it ran nowhere (exit 130)."""


class Lost(Exception):
    """The command's process ended without an exit status: it was killed."""


def run(argv: list[str]) -> int | None:
    """Run `apirctl argv` in the resident process; None when none answers in time (run it here then).

    The resident process must take the command within `ANSWER_SECONDS` (connect, send, the pid of the
    process that will run it); the command runs only after this side confirms ("go"), so a command
    given up on here never also runs there. Then this blocks until the command ends and returns its
    exit status; signals that reach this process (Ctrl-C, `kill`, a terminal resize) are passed on.
    `Interrupted` and `Lost` say why there is no status; the entry point prints them.
    """
    import time

    try:
        cwd = os.getcwd()
    except OSError:  # a deleted working directory: nothing to pass on
        return None
    deadline = time.monotonic() + ANSWER_SECONDS
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.settimeout(ANSWER_SECONDS)
        conn.connect(socket_path())
        request = {
            "protocol": PROTOCOL,
            "argv": argv,
            "env": dict(os.environ),
            "cwd": cwd,
            "umask": _current_umask(),
            "encoding": [getattr(stream, "encoding", None) or "utf-8" for stream in (sys.stdout, sys.stderr)],
        }
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        conn.sendall(frame(request))
    except OSError:  # none listening, or too slow: run here
        conn.close()
        return None
    try:
        return _await_exit(conn, deadline)
    finally:
        conn.close()


def _current_umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _await_exit(conn: Any, deadline: float) -> int | None:
    """Read the command's pid (by `deadline`; None if it does not come), confirm, then read its exit
    status; forward signals in between."""
    import time

    reader = Reader(conn)
    pid = 0
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if pid:
            try:  # noqa: SIM105 - contextlib is 5 ms of the client's start
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    def suspend(signum: int, _frame: object) -> None:
        """Ctrl-Z: stop the command too, and resume it with this process."""
        if pid:
            os.kill(pid, signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, suspend)  # running again (`fg`)
        if pid:
            os.kill(pid, signal.SIGCONT)

    saved = {}
    for name in FORWARDED:
        if hasattr(signal, name):
            saved[name] = signal.signal(getattr(signal, name), forward)
    try:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        first = reader.next()
        if first is not None and not first.get("stale") and "pid" in first:
            conn.settimeout(None)
            fds = struct.pack("3i", 0, 1, 2)  # the caller's stdio, only now: never held by a hung resident
            conn.sendmsg([frame({"go": True})], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
            pid = int(first["pid"])
    except OSError:  # no answer in time (a busy or stuck resident process), or a closed stdin/stdout
        pass
    if not pid:  # run the command here, unless the user asked to stop meanwhile
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
        if any(signal.Signals(signum).name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") for signum in pending):
            raise Interrupted
        return None
    if hasattr(signal, "SIGTSTP"):
        signal.signal(signal.SIGTSTP, suspend)
    for signum in pending:
        forward(signum, None)
    pending.clear()
    while True:
        try:
            message = reader.next()
        except OSError:
            message = None
        if message is None:
            raise Lost("the command's process ended without an exit status")
        if "exit" in message:
            return int(message["exit"])


def spawn() -> None:
    """Start a resident process in the background (no-op if one is starting or running)."""
    import subprocess

    directory = runtime_dir()
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.stat(directory).st_uid != os.getuid():
            return  # someone else's directory: never serve from it
        log = open(socket_path().removesuffix(".sock") + ".log", "ab")  # noqa: SIM115 - closed below
    except OSError:
        return
    with log:
        # The caller's import path, whole: the resident process must import the very modules the
        # caller would (`python -m apirctl` puts the working directory first).
        boot = f"import sys; sys.path[:] = {sys.path!r}; from apirctl.resident.server import main; main()"
        subprocess.Popen(
            [sys.executable, "-c", boot, socket_path()],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
            cwd="/",
        )


def status() -> dict[str, Any]:
    """Whether a resident process serves this apirctl, with its pid and socket."""
    path = socket_path()
    answer = _ask(path, {"protocol": PROTOCOL, "query": "status"})
    if answer is None or "pid" not in answer:  # none, or a stale one (it exits on being asked)
        return {"running": False, "socket": path}
    return {"running": True, "socket": path, **answer}


def stop(path: str | None = None) -> bool:
    """Ask the resident process (of this apirctl, or the one at `path`) to exit; True if one was running."""
    answer = _ask(path or socket_path(), {"protocol": PROTOCOL, "query": "stop"})
    return answer is not None and "pid" in answer


def _ask(path: str, request: dict[str, Any]) -> dict[str, Any] | None:
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.settimeout(ANSWER_SECONDS)
        conn.connect(path)
        conn.sendall(frame(request))
        return Reader(conn).next()
    except OSError:
        return None
    finally:
        conn.close()
