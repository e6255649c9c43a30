"""One `ggml-rpc-server` per remoting container, each on its own Unix socket.

Why one each: the RPC server serves one client at a time, so a shared backend allows one
remoting container (the upstream limit); with a process per container, GPU memory is the only
limit. Each backend listens on `rpc.sock` in a directory of its own under apirctl's runtime
directory (`paths.private_dir`: 0700, checked at each start). That directory, and nothing else,
is bind-mounted read-only into the container at `CONTAINER_DIR`, so the container needs no
network route to the host: it works with `--network none`, slirp4netns, pasta or a bridge. On
Linux the patched llama.cpp upgrades the connection to shared-memory rings (a memfd passed over
the socket); the backend logs it, and `Instance.link` records it ("shm", else "unix").

Records, owners and staleness follow `apirctl.remoting.supervised` (one rule for both kinds of host
process, with the containers that keep it as a parameter): a backend is kept by a *running*
container; one whose owner is gone and whose container no longer runs is stale, and `clean` stops it
and removes its directory (a container that died, or a serve that was killed between its steps).

`spawn` and `wait_ready` are shared with the host backend of `machine restart --remoting`
(`apirctl.remoting.rpc_server`); `_command` alone builds the server's command line and environment.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from apirctl.errors import ApirctlError
from apirctl.paths import dirs, ensure, private_dir, socket_path
from apirctl.remoting import rpc_client, supervised
from apirctl.remoting.supervised import STOP_TIMEOUT, Inherited, Registry, Supervised

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


# --- processes (shared with the host backend) ---------------------------------------------------


def is_backend_process(pid: int, binary: str = BINARY) -> bool:
    """True when `pid` is a live (not zombie) `binary` (ggml-rpc-server): a recycled pid is not ours."""
    return supervised.is_process(pid, binary)


def terminate(pid: int, timeout: float = STOP_TIMEOUT, binary: str = BINARY) -> None:
    """SIGTERM, then SIGKILL after `timeout`; polls, never a fixed sleep. Only a `binary` process."""
    supervised.terminate(pid, binary, timeout)


failure_line = supervised.failure_line


def cache_dir() -> Path:
    """The servers' weight cache (the server appends `rpc/` to LLAMA_CACHE)."""
    return dirs().cache / "llama-cache"


def spawn(build: Build, listen: list[str], log: Path, device: str | None, threads: int | None,
          cache: bool, shm_cap: int | None = None, region: Inherited | None = None) -> subprocess.Popen[bytes]:
    """Start the server in its own session with its output appended to `log`.

    `listen` is its address flags (`-H 127.0.0.1 -p PORT`, or `-H unix:PATH`). `shm_cap` bounds the
    bytes of host memory its client may share with it (None: the server's default, 4 GiB). `region`
    is a descriptor it inherits, named in its environment (a VM's shared memory).
    """
    args, env = _command(build, listen, device, threads, cache, shm_cap)
    if region is not None:
        env.update(region.backend_env())
    ensure(log.parent)
    with log.open("ab") as fh:
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        fh.write(f"--- apirctl: {stamp} starting {' '.join(args)}\n".encode())
        fh.flush()
        # restore_signals=False keeps SIGPIPE ignored (Python's own setting) in the server: a client
        # that vanishes mid-reply (a killed container) then costs the server a failed write, not its life.
        child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, restore_signals=False,
                                 pass_fds=(region.fd,) if region is not None else ())
    return supervised.adopt(child)


def _command(build: Build, listen: list[str], device: str | None, threads: int | None, cache: bool,
             shm_cap: int | None) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment (what `spawn` runs), apart from how it is run."""
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
    return args, env


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


class Instance(Supervised):
    """One backend of one remoting container (state dir, JSON); `id` is the container's
    `apirctl.rpc-instance` label."""

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


#: A backend is kept by a running container: a stopped one connects to a new backend when it starts again.
_registry: Registry[Instance] = Registry(Instance, records_dir, "rpc", keep="running")
_write = _registry.write
get = _registry.get
instances = _registry.all
attach = _registry.attach
keepers = _registry.keepers


def alive(instance: Instance) -> bool:
    return is_backend_process(instance.pid)


def shm_cap(memory_limit: int | None) -> int | None:
    """The cap on the host memory a container's backend maps and pins for it: the container's own
    memory limit in bytes (Podman's `--memory`; 0 or None is no limit, and keeps the server's default).
    The memory is the container's, but the server maps it, and pinned it is charged to the host."""
    return memory_limit if memory_limit and memory_limit > 0 else None


def start(build: Build, name: str, device: str | None = None, threads: int | None = None,
          cache: bool = True, memory_limit: int | None = None, region: Inherited | None = None) -> Instance:
    """Start a backend for the container (or bench run) `name` and wait until it answers; a container
    with a memory limit shares at most that much host memory with it (`shm_cap`); a VM's backend maps
    the VM's `region`."""
    base = private_dir(dirs().runtime)
    instance_id = secrets.token_hex(4)
    directory = base / f"rpc-{instance_id}"
    sock = socket_path(directory, SOCKET_NAME)
    log = dirs().logs / f"rpc-backend-{instance_id}.log"
    owner_pid, owner_start = supervised.owner()
    instance = Instance(id=instance_id, pid=0, directory=str(directory), log=str(log), started_at=time.time(),
                        owner_pid=owner_pid, owner_start=owner_start, name=name, device=device)
    try:
        directory.mkdir(mode=0o700)
        child = spawn(build, ["-H", f"{rpc_client.UNIX_PREFIX}{sock}"], log, device, threads, cache,
                      shm_cap(memory_limit), region)
        instance.pid = child.pid
        _write(instance)
        wait_ready(child, instance.endpoint, None, log)
    except BaseException:
        stop(instance)
        raise
    return instance


def confirm_link(instance: Instance, release: bool = True) -> Instance:
    """Record whether the client's connection moved to shared memory (read from the server's log);
    with `release`, its container alone decides from now on whether it is stale."""
    instance.link = "shm" if used_shm(Path(instance.log)) else "unix"
    if release:
        return _registry.release(instance)
    _write(instance)
    return instance


def hand_over(instance: Instance, pid: int) -> Instance:
    """Process `pid` owns the backend from now on (a VM's relay, which outlives the serve that started
    it): while it runs, the backend is not stale; once it is gone, `clean` stops the backend."""
    state = supervised.proc_state(pid)
    instance.owner_pid, instance.owner_start = pid, state[1] if state else ""
    _write(instance)
    return instance


def stop(instance: Instance | str) -> None:
    """Stop the backend, remove its directory (socket included), its record and its log."""
    found = get(instance) if isinstance(instance, str) else instance
    if found is None:
        return
    if found.pid:
        terminate(found.pid)
    _registry.remove(found)


def stale(instance: Instance, running: Iterable[str]) -> bool:
    """No apirctl process is setting it up, and its container does not run (a backend that died
    under a running container stays listed: `problem` reports it until the server is stopped)."""
    return _registry.stale(instance, running)


def clean(running: Iterable[str]) -> list[str]:
    """Stop the stale instances, given the ids of the containers that run now; returns their names."""
    return _registry.clean(running, stop)


def problem(instance_id: str) -> str | None:
    """Why a container on this backend cannot work now, or None (cheap: `ps` asks for each server)."""
    instance = get(instance_id)
    if instance is None:
        return "rpc backend gone"
    if not alive(instance):
        return "rpc backend down"
    return None
