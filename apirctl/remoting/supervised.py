"""Host processes that serve one container each, supervised the same way: an RPC backend per rpc
container (`apirctl.remoting.backends`) and an apir-host per APIR container
(`apirctl.remoting.apir_hosts`).

Each is recorded in the state directory (never in the directory mounted into its container: a
container must not be able to point apirctl at another process to stop), with the apirctl process
that sets it up (`owner_pid`, and that process's start time, so a recycled pid is not the owner)
until its container exists, then the container's id. A process is stale when no owner sets it up
and its container no longer keeps it: the `keep` rule of its `Registry` says which containers do.
An RPC backend is kept by a *running* container (a stopped container reconnects to a new backend
on restart); an apir-host by an *existing* one (Podman's restart policy, or `apirctl restart`, starts
the container again against the same host, and a host that died stays recorded so `ps` can say why).

The process helpers (`is_process`, `terminate`, `proc_state`, `failure_line`) are shared with the
host backend of `machine restart --remoting` (`apirctl.remoting.rpc_server`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel

from apirctl.errors import tail
from apirctl.paths import dirs
from apirctl.remoting.records import RecordStore

STOP_TIMEOUT = 10.0
#: Words of a server's log line that says why it stopped.
FAILURE_WORDS = ("error", "failed", "unknown", "invalid", "abort", "refus", "corrupt")


class Inherited(Protocol):
    """A descriptor a host process inherits, with the environment that names it to the process (a VM's
    shared memory, `apirctl.vm.region`): `backend_env` for ggml-rpc-server, `fd` for `apir-host --region-fd`."""

    fd: int

    def backend_env(self) -> dict[str, str]: ...


# Popen objects of processes this process started, so that their exit is reaped (no zombies while a
# long-lived caller, such as a test session, keeps running).
_children: list[subprocess.Popen[bytes]] = []


# --- processes -------------------------------------------------------------------------------------


def adopt(child: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Keep a started child so that `reap` collects its exit."""
    _children.append(child)
    return child


def reap() -> None:
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


def is_process(pid: int, binary: str) -> bool:
    """True when `pid` is a live (not zombie) `binary`: a recycled pid is not ours."""
    reap()
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    state = proc_state(pid)
    return (state is not None and state[0] not in ("Z", "X") and bool(cmdline)
            and Path(os.fsdecode(cmdline[0])).name == binary)


def terminate(pid: int, binary: str, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after `timeout`; polls, never a fixed sleep. Only a `binary` process."""
    if not is_process(pid, binary):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_process(pid, binary):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.05)


def failure_line(path: Path) -> str:
    """The most telling line of a failed start (an error line, else the last one) among the log's last 40,
    apirctl's own `--- apirctl:` start lines left out."""
    server_lines = [line for line in tail(path, 40).splitlines() if not line.startswith("--- apirctl")]
    return tail("\n".join(server_lines), telling=FAILURE_WORDS, default="no output")


def owner() -> tuple[int, str]:
    """(pid, start time) of this process, recorded as the owner of what it sets up."""
    own = proc_state(os.getpid())
    return os.getpid(), own[1] if own else ""


# --- records ---------------------------------------------------------------------------------------


class Supervised(BaseModel):
    """What every supervised process records (state dir, JSON)."""

    id: str  # 8 hex digits: named by the container's label
    pid: int = 0
    directory: str  # the private directory holding its socket (mounted into the container)
    log: str
    started_at: float
    owner_pid: int = 0  # the apirctl process setting it up: while it lives, the process is not stale
    owner_start: str = ""  # that process's start time (a recycled pid is not the owner)
    container: str = ""  # the container's id once it exists
    name: str = ""  # the container's (or the bench run's) name


class Container(Protocol):
    """What the staleness rule reads of a container (a `Server` has both)."""

    @property
    def id(self) -> str: ...

    @property
    def running(self) -> bool: ...


#: Which containers keep their process from being stale: those that run, or those that exist at all.
Keep = Literal["running", "existing"]
R = TypeVar("R", bound=Supervised)


class Registry(Generic[R]):
    """The records of one kind of supervised process and their lifecycle: written, attached to a
    container, released by their owner, stale by the `keep` rule, removed with their directory."""

    def __init__(self, model: type[R], records_dir: Callable[[], Path], prefix: str, keep: Keep) -> None:
        self.store: RecordStore[R] = RecordStore(model, records_dir)
        self.prefix = prefix  # its directory under the runtime directory is PREFIX-ID
        self.keep = keep

    def write(self, record: R) -> None:
        self.store.write(record.id, record)

    def get(self, record_id: str) -> R | None:
        return self.store.get(record_id)

    def all(self) -> list[R]:
        """Every recorded process, oldest first (stale ones too: `clean` removes those)."""
        return sorted(self.store.all(), key=lambda r: r.started_at)

    def attach(self, record: R, container_id: str) -> R:
        """Record the container it serves (from then on the container decides staleness)."""
        record.container = container_id
        self.write(record)
        return record

    def release(self, record: R) -> R:
        """The container is up: its state alone decides from now on whether the process is stale."""
        record.owner_pid, record.owner_start = 0, ""
        self.write(record)
        return record

    def remove(self, record: R) -> None:
        """Its private directory (only the one named after it), its record and its log."""
        directory = Path(record.directory)
        if directory.parent == dirs().runtime and directory.name == f"{self.prefix}-{record.id}":
            shutil.rmtree(directory, ignore_errors=True)
        self.store.remove(record.id)
        Path(record.log).unlink(missing_ok=True)

    def stale(self, record: R, keeping: Iterable[str]) -> bool:
        """No apirctl process is setting it up, and its container is not among `keeping` (the ids of
        the containers that keep it, by the `keep` rule: see `keepers`)."""
        if owner_alive(record):
            return False
        return not record.container or record.container not in set(keeping)

    def keepers(self, containers: Iterable[Container]) -> list[str]:
        """The ids of the containers that keep a process of this kind: running ones, or all."""
        return [c.id for c in containers if self.keep == "existing" or c.running]

    def clean(self, keeping: Iterable[str], stop: Callable[[R], None]) -> list[str]:
        """Stop the stale processes with `stop`, given the ids of the containers that keep them (see
        `keepers`); returns their names."""
        keeping = set(keeping)
        removed = []
        for record in self.all():
            if self.stale(record, keeping):
                stop(record)
                removed.append(record.name or record.id)
        return removed


def owner_alive(record: Supervised) -> bool:
    if not record.owner_pid:
        return False
    state = proc_state(record.owner_pid)
    return state is not None and state[0] not in ("Z", "X") and (not record.owner_start
                                                                 or state[1] == record.owner_start)
