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

import _socket  # the C module under `socket`: socket.py and its selectors are 6 ms of the client
import marshal
import os
import signal
import struct
import sys
import zlib

TYPE_CHECKING = False  # typing and pathlib cost the client 20 ms of a 60 ms start: not imported at run time
if TYPE_CHECKING:
    import socket
    from typing import Any

    from apirctl.cli.root import PreparedApp

PROTOCOL = 1
IDLE_SECONDS = 15 * 60
ENV_SWITCH = "APIRCTL_RESIDENT"  # "0" turns the resident process off
ENV_DIR = "APIRCTL_RESIDENT_DIR"  # where the socket lives (tests use their own)
# Signals the client passes on to the command's process (it is not in the terminal's process group).
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGWINCH", "SIGUSR1", "SIGUSR2")
_HEADER = struct.Struct("!I")  # each message: its length, then marshal data (one interpreter on both ends)


# --- where -------------------------------------------------------------------------------------


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


def _package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def identity() -> str:
    """What a resident process must share with its caller to run its commands: the interpreter,
    this copy of apirctl, the import path (without its first entry, the script's folder or the
    working directory, which differ between `apirctl` and `python -m apirctl`), and the variables
    the interpreter reads only when it starts (PYTHON*, the locale)."""
    startup = sorted(f"{k}={v}" for k, v in os.environ.items()
                     if k.startswith("PYTHON") or k in ("LANG", "LC_ALL", "LC_CTYPE"))
    return "\0".join([os.path.realpath(sys.executable), _package_dir(), *sys.path[1:], *startup])


def socket_path() -> str:
    key = zlib.crc32(identity().encode()) & 0xFFFFFFFF
    return os.path.join(runtime_dir(), f"resident-{key:08x}.sock")


# --- client ------------------------------------------------------------------------------------


def run(argv: list[str]) -> int | None:
    """Run `apirctl argv` in the resident process; None when none answers (run it here then).

    Blocks until the command ends and returns its exit status. Signals that reach this process
    (Ctrl-C, `kill`, a terminal resize) are passed on to the command's process.
    """
    try:
        cwd = os.getcwd()
    except OSError:  # a deleted working directory: nothing to pass on
        return None
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.connect(socket_path())
        request = {
            "protocol": PROTOCOL,
            "argv": argv,
            "env": dict(os.environ),
            "cwd": cwd,
            "umask": _current_umask(),
            "encoding": [getattr(stream, "encoding", None) or "utf-8" for stream in (sys.stdout, sys.stderr)],
        }
        fds = struct.pack("3i", 0, 1, 2)
        conn.sendmsg([_frame(request)], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
    except OSError:  # none listening, or a closed stdin/stdout that cannot be passed: run here
        conn.close()
        return None
    try:
        return _await_exit(conn)
    finally:
        conn.close()


def _frame(message: dict[str, Any]) -> bytes:
    data = marshal.dumps(message)
    return _HEADER.pack(len(data)) + data


class _Reader:
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


def _current_umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _await_exit(conn: Any) -> int | None:
    """Read the command's pid, then its exit status; forward signals in between."""
    reader = _Reader(conn)
    pid = 0
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if pid:
            try:  # noqa: SIM105 - contextlib is 5 ms of the client's start
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    def suspend(signum: int, frame: object) -> None:
        """Ctrl-Z: stop the command too, and resume it with this process."""
        if pid:
            os.kill(pid, signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, suspend)  # running again (`fg`)
        if pid:
            os.kill(pid, signal.SIGCONT)

    for name in FORWARDED:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), forward)
    if hasattr(signal, "SIGTSTP"):
        signal.signal(signal.SIGTSTP, suspend)
    while True:
        message = reader.next()
        if message is None:
            # The connection closed without a status: the command's process was killed.
            if pid == 0:
                return None
            print("apirctl: the command's process ended without an exit status", file=sys.stderr)
            return 1
        if message.get("stale"):
            return None
        if "pid" in message:
            pid = int(message["pid"])
            for signum in pending:
                forward(signum, None)
            pending.clear()
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
        boot = f"import sys; sys.path[:] = {sys.path!r}; from apirctl.resident import main; main()"
        subprocess.Popen(
            [sys.executable, "-c", boot, socket_path()],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
            cwd="/",
        )


def status() -> dict[str, Any]:
    """Whether a resident process serves this apirctl, with its pid and socket."""
    path = socket_path()
    answer = _ask(path, {"protocol": PROTOCOL, "query": "status"})
    return {"running": answer is not None, "socket": path, **(answer or {})}


def stop(path: str | None = None) -> bool:
    """Ask the resident process (of this apirctl, or the one at `path`) to exit; True if one was running."""
    return _ask(path or socket_path(), {"protocol": PROTOCOL, "query": "stop"}) is not None


def _ask(path: str, request: dict[str, Any]) -> dict[str, Any] | None:
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.settimeout(5)
        conn.connect(path)
        conn.sendall(_frame(request))
        return _Reader(conn).next()
    except OSError:
        return None
    finally:
        conn.close()


# --- the resident process ----------------------------------------------------------------------


def _fingerprint() -> tuple[Any, ...]:
    """Changes when apirctl's files or the installed packages change (an edit, an upgrade)."""
    stamps: list[Any] = []
    for root, dirs, files in os.walk(_package_dir()):
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
    import contextlib
    import importlib

    from apirctl.cli import root

    # What the common commands import inside their functions (httpx loads httpcore and h11 only when a
    # client is made: 80 ms of the first `chat`); not the rare heavy ones (gguf with numpy, matplotlib).
    for module in ("pydantic", "httpx", "httpcore", "h11", "podman", "rich.console", "rich.progress",
                   "rich.table", "rich.markup", "rich.live", "rich.markdown", "apirctl.cli.output",
                   "apirctl.config", "apirctl.serve", "apirctl.models", "apirctl.engine", "apirctl.libpod",
                   "apirctl.image", "apirctl.llamacpp", "apirctl.transport", "apirctl.hostloopback",
                   "apirctl.machine", "apirctl.chat", "apirctl.doctor", "apirctl.bench"):
        with contextlib.suppress(ImportError):  # an optional part: a command imports it itself if needed
            importlib.import_module(module)
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


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    import socket

    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    message = _Reader(conn, data).next()
    if message is None:
        for fd in fds:
            os.close(fd)
        raise ValueError("truncated request")
    return message, list(fds)


def _peer_is_us(conn: socket.socket) -> bool:
    import socket

    if not hasattr(socket, "SO_PEERCRED"):  # macOS: the 0700 directory is the guard
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    try:  # noqa: SIM105 - the caller may be gone; nothing to do then
        conn.sendall(_frame(message))
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
    """The resident process: warm up, then fork a child for each command until idle or stale."""
    lock = _claim(path)
    if lock is None:
        return
    fingerprint = _fingerprint()
    runner = _prewarm()
    listener = _bind(path)  # only now: a command that comes during the warm-up runs by itself
    identity_inode = os.stat(path).st_ino

    def reap(signum: int, frame: object) -> None:
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    listener.settimeout(idle)
    served = from_spare = 0
    spare: _Spare | None = _Spare(listener, runner)
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(None)
                if not _peer_is_us(conn):
                    continue
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    continue
                if request.get("protocol") != PROTOCOL or _fingerprint() != fingerprint:
                    for fd in fds:
                        os.close(fd)
                    _reply(conn, {"stale": True})
                    return
                query = request.get("query")
                if query:
                    _reply(conn, {"pid": os.getpid(), "idle_seconds": idle, "served": served,
                                  "from_spare": from_spare})
                    if query == "stop":
                        return
                    continue
                if len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    continue
                served += 1
                if spare is not None and spare.ready():
                    spare = spare.take(conn, request, fds)  # None once taken: a new one follows below
                    from_spare += spare is not None
                if spare is None or not spare.taken:
                    child = os.fork()  # no spare ready: fork for this command alone
                    if child == 0:
                        listener.close()
                        _child(conn, request, fds, runner)  # never returns
                for fd in fds:
                    os.close(fd)
            if spare is None or spare.taken:  # after `conn` is closed here: a spare must not hold it
                spare = _Spare(listener, runner)
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == identity_inode:  # never remove a successor's socket
                os.unlink(path)
        except OSError:
            pass


class _Spare:
    """A child forked ahead of the next command, with the pages a command writes already copied.

    Why: after a fork, every page a command first writes (Python writes reference counts on every
    object it touches) is copied then, on the command's time: 2-3 ms for a chat client, as much as
    the fork itself. The spare forks and exercises the common paths (`_exercise`) while the resident
    process waits, then waits for a command; the resident process hands it the connection and the
    caller's descriptors, or forks directly while the spare is not ready yet.
    """

    def __init__(self, listener: socket.socket, runner: PreparedApp) -> None:
        import socket

        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = os.fork()
        if self.pid == 0:
            listener.close()
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

    def take(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> _Spare | None:
        """Hand it the command; returns itself (taken) or None when it is gone (fork then)."""
        import socket

        try:
            socket.send_fds(self.sock, [_frame(request)], [conn.fileno(), *fds])
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
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
        request = _Reader(sock, data).next()
    except BaseException:  # noqa: BLE001 - a spare that cannot serve just goes away
        os._exit(0)
    if request is None or len(fds) != 4:
        os._exit(0)  # the resident process ended
    sock.close()
    _child(socket.socket(fileno=fds[0]), request, fds[1:], runner)


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
    ["chat", "--url", "http://127.0.0.1:1/v1", "-p", "hi", "--max-tokens", "1", "--temperature", "0"],
    ["serve", "model.gguf", "--port", "1234", "--name", "x", "--transport", "none", "--ctx-size", "1024"],
    ["ps", "--json"],
    ["stop", "x"],
)


def _child(conn: socket.socket, request: dict[str, Any], fds: list[int], runner: PreparedApp) -> None:
    """Become the caller's command: its stdio, environment, directory and arguments; then run it."""
    import contextlib

    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupt)  # before the pid goes out: the caller forwards from then on
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
        _reply(conn, {"pid": os.getpid()})
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
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: the status still goes back
                stream.flush()
        _reply(conn, {"exit": code})
        os._exit(code)


def _interrupt(signum: int, frame: object) -> None:
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
        raise SystemExit("usage: python -m apirctl.resident SOCKET (apirctl starts it by itself)")
    serve_forever(sys.argv[1])


if __name__ == "__main__":
    main()
