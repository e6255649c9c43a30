"""Linux remoting: llama.cpp's RPC server on the host GPU, owned by apirctl.

There is no krunkit on Linux; the same idea (the container's GGML calls run on the host GPU)
is served by `ggml-rpc-server` from apirctl's own llama.cpp build. apirctl starts it in the
background, bound to 127.0.0.1 only (the RPC protocol has no authentication and lets a client
read and write host memory it allocated), and keeps its pid, port, device, log file and start
time in the state directory. Readiness is a protocol answer (`rpc_client.probe`), never just an
open port. Containers reach it through slirp4netns' host-loopback address (`apirctl.transport`).

States (the exit codes of `apirctl machine status`): 127 no build, 11 not running,
0 ready, 1 an rpc inference server uses it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, MachineStatus, RestartOptions
from apirctl.paths import dirs, ensure

if TYPE_CHECKING:
    from apirctl.llamacpp import Build
    from apirctl.serve import Server

PLATFORM = "linux"
LOOPBACK = "127.0.0.1"
BINARY = "ggml-rpc-server"
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
RESTART_HINT = "start it with `apirctl machine restart --remoting`"

# Popen objects of backends this process started, so that their exit is reaped (no zombies
# while a long-lived caller, such as a test session, keeps running).
_children: list[subprocess.Popen[bytes]] = []


class BackendRecord(BaseModel):
    """What apirctl remembers about the backend it started (state dir, JSON)."""

    pid: int
    host: str = LOOPBACK
    port: int
    device: str | None = None  # as asked (--device); None = the server's own choice (all GPUs, else CPU)
    threads: int | None = None
    cache: bool = True
    cache_dir: str | None = None
    log: str
    started_at: float
    binary: str
    source_version: str = ""


def record_file() -> Path:
    return dirs().state / "rpc-backend.json"


def log_file() -> Path:
    return dirs().logs / "rpc-backend.log"


def cache_dir() -> Path:
    """The server's weight cache (it appends `rpc/` to LLAMA_CACHE)."""
    return dirs().cache / "llama-cache"


def read_record() -> BackendRecord | None:
    path = record_file()
    if not path.exists():
        return None
    try:
        return BackendRecord.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None


def _write_record(record: BackendRecord) -> None:
    path = record_file()
    ensure(path.parent)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(path)


def _clear_record() -> None:
    with contextlib.suppress(FileNotFoundError):
        record_file().unlink()


# --- processes and ports ---------------------------------------------------------------------


def _reap() -> None:
    for child in list(_children):
        if child.poll() is not None:
            _children.remove(child)


def is_backend_process(pid: int) -> bool:
    """True when `pid` is a live (not zombie) ggml-rpc-server: a recycled pid is not ours."""
    _reap()
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return state not in ("Z", "X") and bool(cmdline) and Path(os.fsdecode(cmdline[0])).name == BINARY


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` on any IPv4/IPv6 address (from /proc/net/tcp*)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    return inodes


def port_holder(port: int) -> str | None:
    """Which process listens on `port`, as "NAME (pid N)", when this user can see it."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        name = (proc / "comm").read_text().strip()
                        return f"{name} (pid {proc.name})"
    return "a process this user cannot see"


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Raise a clear error naming the holder if `host:port` cannot be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return
        except OSError as exc:
            reason = exc.strerror or str(exc)
    holder = port_holder(port)
    who = f" by {holder}" if holder else ""
    raise ApirctlError(
        f"port {port} on {host} is already in use{who} ({reason})",
        hint="choose another port with `--port` (or `apirctl config set rpc_port N`), or stop that process",
    )


# --- the backend's own facts -----------------------------------------------------------------


def _log_tail(lines: int = 20) -> list[str]:
    path = log_file()
    if not path.exists():
        return []
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 64 * 1024))
        text = fh.read().decode(errors="replace")
    return text.splitlines()[-lines:]


def _devices_from_log() -> list[str]:
    """The `Devices:` lines of the last start ("CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, ...)")."""
    lines = _log_tail(200)
    starts = [i for i, line in enumerate(lines) if line.startswith("Devices:")]
    if not starts:
        return []
    out = []
    for line in lines[starts[-1] + 1:]:
        if not line.startswith("  ") or ":" not in line or line.strip().startswith(("endpoint", "transport")):
            break
        out.append(line.strip())
    return out


def _failure_line() -> str:
    """The most telling line of a failed start (an error line, else the last one)."""
    tail = [line.strip() for line in _log_tail(40) if line.strip() and not line.startswith("--- apirctl")]
    for line in reversed(tail):
        if any(word in line.lower() for word in ("error", "failed", "unknown", "invalid", "abort")):
            return line
    return tail[-1] if tail else "no output"


def rpc_servers(port: int | None = None) -> list[Server]:
    """Running inference servers that use this host's backend (on `port` when given).

    Servers of other backends (`--rpc-backend`, or a backend on another port) are not its users.
    Empty when Podman cannot be asked.
    """
    try:
        from apirctl import serve

        found = serve.list_servers(probe_health=False)
    except Exception:  # noqa: BLE001 - status must answer even when Podman does not
        return []
    return [s for s in found if s.transport == "rpc" and s.state == "running" and not s.rpc_backends
            and (port is None or not s.rpc_target or s.rpc_target.rsplit(":", 1)[-1] == str(port))]


def backend_problem() -> str | None:
    """Why rpc containers cannot work now, or None; cheap (no probe, no Podman) so `ps` can ask.

    llama-server only notices a dead backend at its next request, so its own /health keeps
    saying ok until then; `apirctl ps` shows this reason instead.
    """
    record = read_record()
    if record is None:
        return "rpc backend not running"
    if not is_backend_process(record.pid):
        return "rpc backend down"
    return None


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def _st(state: MachineState, summary: str, next_step: str | None = None, **details: Any) -> MachineStatus:
    return MachineStatus(platform=PLATFORM, state=state, summary=summary, next_step=next_step,
                         details={k: v for k, v in details.items() if v is not None})


def _find_build() -> tuple[Build | None, str | None]:
    """The host build and its server binary's problem, if any."""
    from apirctl import llamacpp

    try:
        build = llamacpp.current_build()
    except ApirctlError as exc:
        return None, exc.message
    if build is None:
        return None, "llama.cpp is not built on this host"
    if not (build.bin_dir / BINARY).exists():
        return build, f"the llama.cpp build has no {BINARY}"
    return build, None


# --- the Platform interface ------------------------------------------------------------------


def status(name: str | None = None) -> MachineStatus:
    """Not installed (127) / not running (11) / ready (0) / serving (1), with the facts."""
    build, problem = _find_build()
    if problem:
        return _st(MachineState.NOT_INSTALLED, f"remoting is not installed: {problem}", "run `apirctl setup`")
    record = read_record()
    if record is None:
        return _st(MachineState.NOT_RUNNING, "the host RPC backend is not running", RESTART_HINT)
    common = {"pid": record.pid, "port": record.port, "host": record.host, "log": record.log}
    if not is_backend_process(record.pid):
        return _st(MachineState.NOT_RUNNING,
                   f"the host RPC backend is down: pid {record.pid} was killed or exited "
                   f"(last log line: {_failure_line()})", RESTART_HINT, port=record.port, log=record.log,
                   note="rpc inference servers abort at their next request; restart them after the backend")
    from apirctl.machine import rpc_client

    uptime = _uptime(time.time() - record.started_at)
    devices = _devices_from_log()
    servers = rpc_servers(record.port)
    serving = ", ".join(s.name for s in servers) or None
    if servers:  # its one connection belongs to them: a probe would only queue behind it
        return _st(MachineState.SERVING, f"the host RPC backend is serving: {serving}", None,
                   device=", ".join(devices) or record.device, uptime=uptime, serving=serving,
                   cache=record.cache_dir if record.cache else "off", **common)
    try:
        info = rpc_client.probe(record.host, record.port, timeout=2.0)
    except rpc_client.RpcBusy:
        return _st(MachineState.READY, "the host RPC backend runs (busy with a client now)", None,
                   device=", ".join(devices) or record.device, uptime=uptime, **common)
    except (OSError, rpc_client.RpcError) as exc:
        return _st(MachineState.NOT_RUNNING,
                   f"the host RPC backend (pid {record.pid}) does not answer on {record.host}:{record.port}: {exc}",
                   RESTART_HINT, **common)
    memory = [f"{d.free // 2**20} MiB free of {d.total // 2**20} MiB" for d in info.devices]
    details = dict(device=", ".join(devices) or record.device or "server default", memory="; ".join(memory),
                   memory_bytes=[{"index": d.index, "free": d.free, "total": d.total} for d in info.devices],
                   protocol=info.version, uptime=uptime, cache=record.cache_dir if record.cache else "off",
                   **common)
    return _st(MachineState.READY, f"the host RPC backend is ready on {record.host}:{record.port}", None, **details)


def _terminate(pid: int, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after `timeout`; polls, never a fixed sleep."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_backend_process(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.05)


def _refuse_if_used(force: bool, action: str) -> None:
    record = read_record()
    servers = rpc_servers(record.port if record else None)
    if not servers:
        return
    names = ", ".join(s.name for s in servers)
    if not force:
        raise ApirctlError(f"cannot {action} the host RPC backend: inference servers use it ({names})",
                           hint="stop them with `apirctl stop NAME`, or pass --force to stop them first")
    from apirctl import serve

    for server in servers:
        serve.stop(server.name)


def stop(name: str | None = None, force: bool = False) -> MachineStatus:
    """Stop the backend; refuses while an rpc inference server uses it, unless `force`."""
    record = read_record()
    if record is not None and is_backend_process(record.pid):
        _refuse_if_used(force, "stop")
        _terminate(record.pid)
    _clear_record()
    return status(name)


def _spawn(build: Build, port: int, device: str | None, threads: int | None, cache: bool) -> BackendRecord:
    """Start the server in its own session with its output in the log; wait for a protocol answer."""
    from apirctl.machine import rpc_client

    binary = build.binary(BINARY)
    args = [str(binary), "-H", LOOPBACK, "-p", str(port)]
    if device:
        args += ["-d", device]
    if threads:
        args += ["-t", str(threads)]
    env = dict(os.environ)
    if cache:
        args.append("-c")
        env["LLAMA_CACHE"] = str(ensure(cache_dir()))
    log = log_file()
    ensure(log.parent)
    with log.open("ab") as fh:
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        fh.write(f"--- apirctl: {stamp} starting {' '.join(args)}\n".encode())
        fh.flush()
        # restore_signals=False keeps SIGPIPE ignored (Python's own setting) in the server: a client
        # that vanishes mid-reply (a killed container) then costs the server a failed write, not its life.
        child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, restore_signals=False)
    _children.append(child)
    record = BackendRecord(pid=child.pid, port=port, device=device, threads=threads, cache=cache,
                           cache_dir=str(cache_dir() / "rpc") if cache else None, log=str(log),
                           started_at=time.time(), binary=str(binary), source_version=build.source_version)
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        if child.poll() is not None:
            raise ApirctlError(f"{BINARY} exited with code {child.returncode} at start: {_failure_line()}",
                               hint="see `apirctl machine logs`")
        try:
            rpc_client.probe(LOOPBACK, port, timeout=2.0)
            return record
        except (OSError, rpc_client.RpcError) as exc:
            if time.monotonic() > deadline:
                _terminate(child.pid)
                raise ApirctlError(f"{BINARY} did not answer on {LOOPBACK}:{port} within {READY_TIMEOUT:.0f}s "
                                   f"({exc})", hint="see `apirctl machine logs`") from None
        time.sleep(0.1)


def restart(options: RestartOptions) -> MachineStatus:
    """(Re)start the backend with `--remoting`; without it, stop the backend (plain containers stay).

    On a failed start the previous backend, if one ran, is started again with its old settings.
    """
    if not options.remoting:
        return stop(options.name, force=False)
    from apirctl import config, llamacpp

    settings = config.settings()
    build = llamacpp.require_build()
    build.binary(BINARY)
    port = options.port or settings.rpc_port
    cache = settings.rpc_cache if options.cache is None else options.cache
    threads = options.threads or settings.threads
    old = read_record()
    old_running = old is not None and is_backend_process(old.pid)
    if not (old_running and old is not None and old.port == port):
        check_port_free(port)
    if old_running and old is not None:
        _refuse_if_used(False, "restart")
        _terminate(old.pid)
    _clear_record()
    try:
        record = _spawn(build, port, options.device, threads, cache)
    except ApirctlError:
        if old_running and old is not None:
            with contextlib.suppress(ApirctlError):
                _write_record(_spawn(build, old.port, old.device, old.threads, old.cache))
        raise
    _write_record(record)
    return status(options.name)


def show_logs(follow: bool = False, tail: int = 50) -> None:
    """Print the end of the backend's log; with `follow`, keep printing what it appends."""
    path = log_file()
    if not path.exists():
        raise ApirctlError("the host RPC backend has no log yet", hint="it appears after `apirctl machine "
                           "restart --remoting`")
    for line in _log_tail(tail) if tail > 0 else []:
        print(line)
    sys.stdout.flush()
    offset = path.stat().st_size
    while follow:
        time.sleep(0.5)
        size = path.stat().st_size if path.exists() else 0
        if size < offset:
            offset = 0
        if size > offset:
            with path.open("rb") as fh:
                fh.seek(offset)
                sys.stdout.write(fh.read().decode(errors="replace"))
                sys.stdout.flush()
            offset = size
