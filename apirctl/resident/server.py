"""The resident process: warm up once, then run each caller's command in a fork of itself.

`serve_forever` accepts connections on the private socket, checks the caller (same user) and that
apirctl has not changed since the warm-up, and hands the command to a spare child forked ahead of
time (`_Spare`), or forks for it. The child becomes the caller's command (`_child`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import sys

from apirctl.resident.shared import (
    CONFIRM_SECONDS,
    IDLE_SECONDS,
    MAX_REQUEST,
    PROTOCOL,
    REQUEST_SECONDS,
    Reader,
    frame,
    package_dir,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

    from apirctl.cli.root import PreparedApp


def _fingerprint() -> tuple[Any, ...]:
    """Changes when apirctl's files or the installed packages change (an edit, an upgrade)."""
    stamps: list[Any] = []
    for root, dirs, files in os.walk(package_dir()):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                info = os.stat(os.path.join(root, name))
                stamps.append((name, info.st_mtime_ns, info.st_size))
    for entry in sys.path:
        if entry.endswith("site-packages") and os.path.isdir(entry):
            stamps.append((entry, os.stat(entry).st_mtime_ns))
    return tuple(stamps)


def _prewarm() -> PreparedApp:
    """Import everything a command needs and build the command tree once; returns the runner."""
    import importlib

    from apirctl.cli import root

    # What the common commands import inside their functions (httpx loads httpcore and h11 only when a
    # client is made: 80 ms of the first `chat`); not the rare heavy ones (gguf with numpy, matplotlib).
    for module in ("pydantic", "httpx", "httpcore", "h11", "podman", "rich.console", "rich.progress",
                   "rich.table", "rich.markup", "rich.live", "rich.markdown", "apirctl.cli.output",
                   "apirctl.config", "apirctl.serve", "apirctl.models", "apirctl.podman.engine",
                   "apirctl.podman.libpod", "apirctl.build.image", "apirctl.build.llamacpp",
                   "apirctl.remoting.transport", "apirctl.remoting.hostloopback", "apirctl.machine",
                   "apirctl.chat", "apirctl.cli.chat_session", "apirctl.diagnose.doctor", "apirctl.bench"):
        importlib.import_module(module)  # each one a dependency or apirctl's own: none is optional
    runner = root.PreparedApp()
    _warm_http()
    import gc

    gc.collect()
    gc.freeze()  # the children's collections then skip (and do not copy) the warm objects' pages
    return runner


def _warm_http() -> None:
    """What a process's first HTTP client pays once (OpenSSL's configuration, the proxy settings'
    and URL parsers' regular expressions): 4-5 ms of the first `chat` request otherwise."""
    import contextlib

    import httpx

    with contextlib.suppress(Exception), httpx.Client(verify=False) as client:
        client.build_request("POST", "http://127.0.0.1:1/v1/chat/completions", json={})


class _Pending:
    """A connection whose request is still arriving: its bytes and descriptors so far, and the time
    by which it must be whole (a caller that stalls is dropped then, and blocks nobody meanwhile)."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn, self.deadline = conn, deadline
        self.data = b""
        self.fds: list[int] = []

    def read(self) -> dict[str, Any] | None | bool:
        """Read what has arrived: the request when whole, None while incomplete, False when the
        connection is to be dropped (closed, too large, not a request)."""
        import socket

        try:
            data, fds, _flags, _addr = socket.recv_fds(self.conn, 1 << 16, 3)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return False
        self.fds.extend(fds)
        if not data:
            return False
        self.data += data
        if len(self.data) < 4:
            return None
        (size,) = struct.unpack("!I", self.data[:4])
        if size > MAX_REQUEST:
            return False
        if len(self.data) < 4 + size:
            return None
        try:
            message = Reader(None, self.data).next()
        except (ValueError, EOFError, TypeError):
            return False
        return message if message is not None else False

    def drop(self) -> None:
        self.close_fds()
        self.conn.close()

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _peer_is_us(conn: socket.socket) -> bool:
    import socket

    if not hasattr(socket, "SO_PEERCRED"):  # macOS: the 0700 directory is the guard
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    try:  # noqa: SIM105 - the caller may be gone; nothing to do then
        conn.sendall(frame(message))
    except OSError:
        pass


def _claim(path: str) -> object | None:
    """The lock that makes one process the resident one for `path` (held for its whole life);
    None when another process holds it (running, or warming up)."""
    import fcntl

    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.stat(directory)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SystemExit(f"apirctl resident: {directory} is not private to this user")
    lock = open(path + ".lock", "w")  # noqa: SIM115 - held for the life of the process
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    return lock


def _bind(path: str) -> socket.socket:
    import socket

    if os.path.exists(path):  # left by a process that was killed: the lock says it is gone
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    return listener


def serve_forever(path: str, idle: float = IDLE_SECONDS) -> None:
    """The resident process: warm up, then fork a child for each command until idle or stale.

    Connections are served concurrently (one poll loop, no threads: the process forks): a caller
    that connects and stalls is dropped after `REQUEST_SECONDS` and never delays another.
    """
    import selectors
    import time

    lock = _claim(path)
    if lock is None:
        return
    fingerprint = _fingerprint()
    runner = _prewarm()
    listener = _bind(path)  # only now: a command that comes during the warm-up runs by itself
    identity_inode = os.stat(path).st_ino

    def reap(signum: int, _frame: object) -> None:
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(0))
    listener.setblocking(False)
    poll = selectors.DefaultSelector()
    poll.register(listener, selectors.EVENT_READ)
    pending: dict[int, _Pending] = {}
    stats = {"served": 0, "from_spare": 0}
    spare: _Spare | None = _Spare(listener, runner, pending)
    last_active = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            for fd in [k for k, p in pending.items() if p.deadline <= now]:  # stalled callers
                poll.unregister(pending[fd].conn)
                pending.pop(fd).drop()
            wait = min([p.deadline for p in pending.values()] + [last_active + idle]) - now
            if wait <= 0 and not pending:
                return  # idle
            for key, _events in poll.select(max(0.0, wait)):
                if key.fileobj is listener:
                    _accept(listener, poll, pending, time.monotonic() + REQUEST_SECONDS)
                    continue
                waiting = pending[key.fd]
                request = waiting.read()
                if request is None:
                    continue
                poll.unregister(waiting.conn)
                del pending[key.fd]
                if request is False:
                    waiting.drop()
                    continue
                last_active = time.monotonic()
                assert isinstance(request, dict)
                outcome, spare = _dispatch(waiting, request, listener, runner, spare, fingerprint, idle, stats,
                                           pending)
                if outcome == "exit":
                    return
    finally:
        for waiting in pending.values():
            waiting.drop()
        listener.close()
        try:
            if os.stat(path).st_ino == identity_inode:  # never remove a successor's socket
                os.unlink(path)
        except OSError:
            pass


def _accept(listener: socket.socket, poll: Any, pending: dict[int, _Pending], deadline: float) -> None:
    import selectors

    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of descriptors, for one: the caller runs its command itself
            return
        if not _peer_is_us(conn):
            conn.close()
            continue
        conn.setblocking(False)
        pending[conn.fileno()] = _Pending(conn, deadline)
        poll.register(conn, selectors.EVENT_READ)


def _dispatch(waiting: _Pending, request: dict[str, Any], listener: socket.socket, runner: PreparedApp,
              spare: _Spare | None, fingerprint: tuple[Any, ...], idle: float,
              stats: dict[str, int], pending: dict[int, _Pending]) -> tuple[str, _Spare | None]:
    """Answer a query or hand a command to a child; ("exit", ...) when this process should end."""
    conn = waiting.conn
    conn.setblocking(True)
    conn.settimeout(REQUEST_SECONDS)  # a reply to a caller that stopped reading must not block us
    with conn:
        if request.get("protocol") != PROTOCOL or _fingerprint() != fingerprint:
            waiting.close_fds()
            _reply(conn, {"stale": True})
            return "exit", spare
        query = request.get("query")
        if query:
            waiting.close_fds()
            _reply(conn, {"pid": os.getpid(), "idle_seconds": idle, **stats})
            return ("exit" if query == "stop" else "ok"), spare
        waiting.close_fds()  # the caller's descriptors come with its "go", never with the request
        conn.settimeout(None)
        stats["served"] += 1
        if spare is not None and spare.ready():
            spare = spare.take(conn, request)  # None once taken: a new one follows below
            stats["from_spare"] += spare is not None
        if spare is None or not spare.taken:
            child = os.fork()  # no spare ready: fork for this command alone
            if child == 0:
                _close_inherited(listener, pending)
                _child(conn, request, runner)  # never returns
    if spare is None or spare.taken:  # after `conn` is closed here: a spare must not hold it
        spare = _Spare(listener, runner, pending)
    return "ok", spare


def _close_inherited(listener: socket.socket, pending: dict[int, _Pending]) -> None:
    """In a fresh fork: drop the listener and the other callers' connections (a copy held here would
    keep a stalled caller's connection open after the resident process drops it)."""
    listener.close()
    for waiting in pending.values():
        waiting.conn.close()


class _Spare:
    """A child forked ahead of the next command, with the pages a command writes already copied.

    Why: after a fork, every page a command first writes (Python writes reference counts on every
    object it touches) is copied then, on the command's time: 2-3 ms for a chat client, as much as
    the fork itself. The spare forks and exercises the common paths (`_exercise`) while the resident
    process waits, then waits for a command; the resident process hands it the connection and the
    caller's descriptors, or forks directly while the spare is not ready yet.
    """

    def __init__(self, listener: socket.socket, runner: PreparedApp, pending: dict[int, _Pending]) -> None:
        import socket

        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = os.fork()
        if self.pid == 0:
            _close_inherited(listener, pending)
            parent_end.close()
            _spare_main(child_end, runner)  # never returns
        child_end.close()
        self.sock, self.is_ready, self.taken = parent_end, False, False

    def ready(self) -> bool:
        """Whether it has said it is ready (never blocks)."""
        if not self.is_ready:
            self.sock.setblocking(False)
            try:
                self.is_ready = self.sock.recv(1) == b"R"
            except (BlockingIOError, InterruptedError):
                pass
            finally:
                self.sock.setblocking(True)
        return self.is_ready

    def take(self, conn: socket.socket, request: dict[str, Any]) -> _Spare | None:
        """Hand it the command; returns itself (taken) or None when it is gone (fork then)."""
        import socket

        try:
            socket.send_fds(self.sock, [frame(request)], [conn.fileno()])
        except OSError:
            self.sock.close()
            return None
        self.sock.close()
        self.taken = True
        return self


def _spare_main(sock: socket.socket, runner: PreparedApp) -> None:
    """A spare's life: exercise, say ready, wait for a command (or the resident process's end)."""
    import socket

    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _exercise(runner)
        sock.sendall(b"R")
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
        request = Reader(sock, data).next()
    except BaseException:  # noqa: BLE001 - a spare that cannot serve just goes away
        os._exit(0)
    if request is None or len(fds) != 1:
        os._exit(0)  # the resident process ended
    sock.close()
    _child(socket.socket(fileno=fds[0]), request, runner)


def _exercise(runner: PreparedApp) -> None:
    """Write, in this fresh fork, the pages the usual commands write: parse every command, run
    `--version`, make a chat client. Only what does not depend on the caller's environment."""
    import contextlib
    import io

    with contextlib.suppress(Exception):
        runner.exercise(samples=_SAMPLE_COMMANDS)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runner(["--version"])
        from apirctl import chat

        with chat.ChatClient("http://127.0.0.1:1/v1") as client:
            client.build_request({"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 1})


# Command lines parsed (not run) by a spare, so that its converters have run on real values.
_SAMPLE_COMMANDS = (
    ["chat", "--url", "http://127.0.0.1:1/v1", "hi", "--max-tokens", "1", "--temperature", "0"],
    ["serve", "model.gguf", "--port", "1234", "--name", "x", "--transport", "none", "--ctx-size", "1024"],
    ["ps", "--json"],
    ["stop", "x"],
)


def _child(conn: socket.socket, request: dict[str, Any], runner: PreparedApp) -> None:
    """Become the caller's command: its stdio, environment, directory and arguments; then run it.

    The pid goes out first; the caller answers with its "go" and its stdin, stdout and stderr. A caller
    that gave up meanwhile sends neither: its descriptors are never held here (a hung resident process
    would otherwise keep the caller's pipes open), and the command runs only where the caller ran it.
    """
    import contextlib

    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupt)  # before the pid goes out: the caller forwards from then on
        _reply(conn, {"pid": os.getpid()})
        fds = _confirmed(conn)
        if fds is None:
            os._exit(0)  # the caller gave up waiting and runs the command itself
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(int(request["umask"]))
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_stdio(request.get("encoding") or ["utf-8", "utf-8"])
        argv = list(request["argv"])
        sys.argv = ["apirctl", *argv]
        _watch_caller(conn)
        code = runner(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - the child must always report and exit
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the caller hangs up once it has the status
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: the status still goes back
                stream.flush()
        _reply(conn, {"exit": code})
        os._exit(code)


def _confirmed(conn: socket.socket) -> list[int] | None:
    """The caller's "go" with its three descriptors: it still wants this process to run the command
    (it runs the command itself when the pid came too late, and then never sends it). None otherwise."""
    import socket

    conn.settimeout(CONFIRM_SECONDS)
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
        message = Reader(conn, data).next()
    except (OSError, ValueError, EOFError):
        return None
    finally:
        conn.settimeout(None)
    if not (message and message.get("go")) or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    return list(fds)


def _watch_caller(conn: socket.socket) -> None:
    """Stop this command when its caller is gone (SIGKILLed, its terminal closed): the caller sends
    nothing more, so the connection's end means it died. The command gets SIGTERM, the same clean-up
    as Ctrl-C (a chat stops generating, a serve removes what it created)."""
    import threading

    def watch() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="caller-watch", daemon=True).start()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _reopen_stdio(encodings: list[str]) -> None:
    """Fresh text streams on fds 0-2, buffered the way Python would for the caller's files."""
    import io

    out_enc, err_enc = (encodings + ["utf-8", "utf-8"])[:2]
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=out_enc)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding=out_enc,
                                  line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding=err_enc,
                                  errors="backslashreplace", line_buffering=True)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m apirctl.resident.server SOCKET (apirctl starts it by itself)")
    serve_forever(sys.argv[1])


if __name__ == "__main__":
    main()
