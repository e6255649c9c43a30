"""One `ggml-rpc-server` per remoting container, each on its own Unix socket.

Why one each: the RPC server serves one client at a time, so a shared backend allows one
remoting container (the upstream limit); with a process per container, GPU memory is the only
limit. Each backend listens on `rpc.sock` in a directory of its own under apirctl's runtime
directory (`paths.private_dir`: 0700, checked at each start). That directory, and nothing else,
is bind-mounted read-only into the container at `CONTAINER_DIR`, so the container needs no
network route to the host: it works with `--network none`, slirp4netns, pasta or a bridge. On
Linux the patched llama.cpp upgrades the connection to shared-memory rings (a memfd passed over
the socket); the backend logs it, and `Instance.link` records it ("shm", else "unix").

Records live in the state directory, not in the mounted directory: a container must not be able
to point apirctl at another process to stop. A record names the apirctl process that started the
backend (`owner_pid`) until its container exists; a backend whose owner is gone and whose container
no longer runs is stale, and `clean` stops it and removes its directory (a container that died, or
a serve that was killed between its steps).

The process helpers (`spawn`, `wait_ready`, `terminate`, `is_backend_process`) are shared with the
host backend of `machine restart --remoting` (`apirctl.remoting.rpc_server`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, ensure, private_dir, socket_path
from apirctl.remoting import rpc_client
from apirctl.remoting.records import RecordStore

if TYPE_CHECKING:
    from apirctl.build.llamacpp import Build

BINARY = "ggml-rpc-server"
SOCKET_NAME = "rpc.sock"
#: Where a container sees its backend's directory, and the endpoint its llama.cpp dials.
CONTAINER_DIR = "/run/apirctl-rpc"
CONTAINER_ENDPOINT = f"{rpc_client.UNIX_PREFIX}{CONTAINER_DIR}/{SOCKET_NAME}"
#: What the patched server logs when a client's connection moved to shared memory.
SHM_LOG_LINE = "RPC: shared-memory transport"
READY_TIMEOUT = 60.0
#: The patched server's cap on the host memory one client shares with it (and that it may pin).
SHM_CAP_ENV = "GGML_RPC_SHM_CAP"
STOP_TIMEOUT = 10.0

# Popen objects of backends this process started, so that their exit is reaped (no zombies
# while a long-lived caller, such as a test session, keeps running).
_children: list[subprocess.Popen[bytes]] = []


# --- processes (shared with the host backend) ---------------------------------------------------


def _reap() -> None:
    for child in list(_children):
        if child.poll() is not None:
            _children.remove(child)


def proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process, or None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def is_backend_process(pid: int, binary: str = BINARY) -> bool:
    """True when `pid` is a live (not zombie) `binary` (ggml-rpc-server): a recycled pid is not ours."""
    _reap()
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    state = proc_state(pid)
    return (state is not None and state[0] not in ("Z", "X") and bool(cmdline)
            and Path(os.fsdecode(cmdline[0])).name == binary)


def terminate(pid: int, timeout: float = STOP_TIMEOUT, binary: str = BINARY) -> None:
    """SIGTERM, then SIGKILL after `timeout`; polls, never a fixed sleep. Only a `binary` process."""
    if not is_backend_process(pid, binary):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_backend_process(pid, binary):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.05)


#: Words of a ggml-rpc-server line that says why it stopped.
FAILURE_WORDS = ("error", "failed", "unknown", "invalid", "abort", "refus")


def failure_line(path: Path) -> str:
    """The most telling line of a failed start (an error line, else the last one) among the log's last 40,
    apirctl's own `--- apirctl:` start lines left out."""
    server_lines = [line for line in tail(path, 40).splitlines() if not line.startswith("--- apirctl")]
    return tail("\n".join(server_lines), telling=FAILURE_WORDS, default="no output")


def cache_dir() -> Path:
    """The servers' weight cache (the server appends `rpc/` to LLAMA_CACHE)."""
    return dirs().cache / "llama-cache"


def spawn(build: Build, listen: list[str], log: Path, device: str | None, threads: int | None,
          cache: bool, shm_cap: int | None = None) -> subprocess.Popen[bytes]:
    """Start the server in its own session with its output appended to `log`.

    `listen` is its address flags (`-H 127.0.0.1 -p PORT`, or `-H unix:PATH`). `shm_cap` bounds the
    bytes of host memory its client may share with it (None: the server's default, 4 GiB).
    """
    args = [str(build.binary(BINARY)), *listen]
    if device:
        args += ["-d", device]
    if threads:
        args += ["-t", str(threads)]
    env = dict(os.environ)
    env.pop(SHM_CAP_ENV, None)
    if shm_cap is not None:
        env[SHM_CAP_ENV] = str(shm_cap)
    if cache:
        args.append("-c")
        env["LLAMA_CACHE"] = str(ensure(cache_dir()))
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
    return child


def wait_ready(child: subprocess.Popen[bytes], host: str, port: int | None, log: Path,
               timeout: float = READY_TIMEOUT) -> None:
    """Wait for a protocol answer (never just an open socket); a server that exits or stays silent
    is stopped and becomes a one-line error with its most telling log line."""
    where = rpc_client.endpoint(host, port)
    deadline = time.monotonic() + timeout
    while True:
        if child.poll() is not None:
            raise ApirctlError(f"{BINARY} exited with code {child.returncode} at start: {failure_line(log)}",
                               hint="see `apirctl machine logs`")
        try:
            rpc_client.probe(host, port, timeout=2.0)
            return
        except (OSError, rpc_client.RpcError) as exc:
            if time.monotonic() > deadline:
                terminate(child.pid)
                raise ApirctlError(f"{BINARY} did not answer on {where} within {timeout:.0f}s ({exc})",
                                   hint="see `apirctl machine logs`") from None
        time.sleep(0.05)


def used_shm(log: Path, since: int = 0) -> bool:
    """Whether the server logged a shared-memory upgrade after byte `since` of its log."""
    try:
        with log.open("rb") as fh:
            fh.seek(since)
            return SHM_LOG_LINE.encode() in fh.read()
    except OSError:
        return False


# --- per-container instances ---------------------------------------------------------------------


class Instance(BaseModel):
    """One backend of one remoting container (state dir, JSON)."""

    id: str  # 8 hex digits: the container's `apirctl.rpc-instance` label
    pid: int
    directory: str  # the private directory holding the socket (mounted into the container)
    log: str
    started_at: float
    owner_pid: int = 0  # the apirctl process setting it up: while it lives, the backend is not stale
    owner_start: str = ""  # that process's start time (a recycled pid is not the owner)
    container: str = ""  # the container's id once it exists
    name: str = ""  # the container's (or the bench run's) name
    device: str | None = None
    link: str = "unix"  # "shm" once the server logged the shared-memory upgrade

    @property
    def socket(self) -> Path:
        return Path(self.directory) / SOCKET_NAME

    @property
    def endpoint(self) -> str:
        """The endpoint on this host (`unix:PATH`), for a host client."""
        return f"{rpc_client.UNIX_PREFIX}{self.socket}"


def records_dir() -> Path:
    return dirs().state / "rpc-backends"


_records: RecordStore[Instance] = RecordStore(Instance, records_dir)


def _write(instance: Instance) -> None:
    _records.write(instance.id, instance)


def get(instance_id: str) -> Instance | None:
    return _records.get(instance_id)


def instances() -> list[Instance]:
    """Every recorded instance, oldest first (stale ones too: `clean` removes those)."""
    return sorted(_records.all(), key=lambda i: i.started_at)


def alive(instance: Instance) -> bool:
    return is_backend_process(instance.pid)


def _owner_alive(instance: Instance) -> bool:
    if not instance.owner_pid:
        return False
    state = proc_state(instance.owner_pid)
    return state is not None and state[0] not in ("Z", "X") and (not instance.owner_start
                                                                 or state[1] == instance.owner_start)


def shm_cap(memory_limit: int | None) -> int | None:
    """The cap on the host memory a container's backend maps and pins for it: the container's own
    memory limit in bytes (Podman's `--memory`; 0 or None is no limit, and keeps the server's default).
    The memory is the container's, but the server maps it, and pinned it is charged to the host."""
    return memory_limit if memory_limit and memory_limit > 0 else None


def start(build: Build, name: str, device: str | None = None, threads: int | None = None,
          cache: bool = True, memory_limit: int | None = None) -> Instance:
    """Start a backend for the container (or bench run) `name` and wait until it answers; a container
    with a memory limit shares at most that much host memory with it (`shm_cap`)."""
    base = private_dir(dirs().runtime)
    instance_id = secrets.token_hex(4)
    directory = base / f"rpc-{instance_id}"
    sock = socket_path(directory, SOCKET_NAME)
    log = dirs().logs / f"rpc-backend-{instance_id}.log"
    own = proc_state(os.getpid())
    instance = Instance(id=instance_id, pid=0, directory=str(directory), log=str(log), started_at=time.time(),
                        owner_pid=os.getpid(), owner_start=own[1] if own else "", name=name, device=device)
    try:
        directory.mkdir(mode=0o700)
        child = spawn(build, ["-H", f"{rpc_client.UNIX_PREFIX}{sock}"], log, device, threads, cache,
                      shm_cap(memory_limit))
        instance.pid = child.pid
        _write(instance)
        wait_ready(child, instance.endpoint, None, log)
    except BaseException:
        stop(instance)
        raise
    return instance


def attach(instance: Instance, container_id: str) -> Instance:
    """Record the container the backend serves (from then on the container decides staleness)."""
    instance.container = container_id
    _write(instance)
    return instance


def confirm_link(instance: Instance, release: bool = True) -> Instance:
    """Record whether the client's connection moved to shared memory (read from the server's log);
    with `release`, its container alone decides from now on whether it is stale."""
    instance.link = "shm" if used_shm(Path(instance.log)) else "unix"
    if release:
        instance.owner_pid, instance.owner_start = 0, ""
    _write(instance)
    return instance


def stop(instance: Instance | str) -> None:
    """Stop the backend, remove its directory (socket included), its record and its log."""
    found = get(instance) if isinstance(instance, str) else instance
    if found is None:
        return
    if found.pid:
        terminate(found.pid)
    directory = Path(found.directory)
    if directory.parent == dirs().runtime and directory.name == f"rpc-{found.id}":
        shutil.rmtree(directory, ignore_errors=True)
    _records.remove(found.id)
    Path(found.log).unlink(missing_ok=True)


def stale(instance: Instance, running: Iterable[str]) -> bool:
    """No apirctl process is setting it up, and its container does not run (a backend that died
    under a running container stays listed: `problem` reports it until the server is stopped)."""
    if _owner_alive(instance):
        return False
    return not instance.container or instance.container not in set(running)


def clean(running: Iterable[str]) -> list[str]:
    """Stop the stale instances, given the ids of the containers that run now; returns their names."""
    running = set(running)
    removed = []
    for instance in instances():
        if stale(instance, running):
            stop(instance)
            removed.append(instance.name or instance.id)
    return removed


def problem(instance_id: str) -> str | None:
    """Why a container on this backend cannot work now, or None (cheap: `ps` asks for each server)."""
    instance = get(instance_id)
    if instance is None:
        return "rpc backend gone"
    if not alive(instance):
        return "rpc backend down"
    return None
