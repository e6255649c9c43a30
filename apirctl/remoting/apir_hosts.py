"""One `apir-host` per APIR container (Linux): the ggml-virtgpu backend, without a VM.

On macOS the ggml-virtgpu frontend in a container talks to virglrenderer inside krunkit. On Linux
apirctl's llama.cpp build gives the frontend a local transport instead (a Unix socket for control,
shared memory for commands, replies and data), and `apir-host` plays virglrenderer's part: it
answers HANDSHAKE and LOADLIBRARY and hands FORWARD commands to the real
`libggml-virtgpu-backend`, which runs them on the host build's GGML backend (CUDA, else CPU).

Why one process per container: a crash in the backend library (docs/apir.md lists many a hostile
or buggy client can cause) takes down that container's host only, and several APIR containers run
at once (upstream allows one per VM). Each host listens on `apir.sock` in a directory of its own
under apirctl's runtime directory (0700, checked); that directory alone is bind-mounted into the
container at `CONTAINER_DIR`, and `GGML_VIRTGPU_SOCKET` points the frontend at it, so the
container needs no network route to the host.

The host runs under a small `sh` watcher (its process group leader) that logs how it ended: the
exit status, or the signal that killed it. `problem()` quotes that line, so `ps` and `machine
status` can say *why* a host is gone, which a pid alone cannot tell after the fact. Records live in
the state directory (never in the mounted one: a container must not be able to point apirctl at
another process); records, owners and staleness follow `apirctl.remoting.supervised`: a host is kept
by an *existing* container. `_command` alone builds the host's command line.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, ensure, private_dir, socket_path
from apirctl.remoting import supervised
from apirctl.remoting.supervised import Inherited, Registry, Supervised, failure_line, reap

if TYPE_CHECKING:
    from apirctl.build.llamacpp import Build

BINARY = "apir-host"
SOCKET_NAME = "apir.sock"
#: Where a container sees its host's directory, and the variable that points the frontend at the socket.
CONTAINER_DIR = "/run/apirctl-apir"
CONTAINER_SOCKET = f"{CONTAINER_DIR}/{SOCKET_NAME}"
SOCKET_ENV = "GGML_VIRTGPU_SOCKET"
#: The frontend's library in a build (its presence says the build can be an APIR client).
FRONTEND_LIBRARY = "ggml-virtgpu"
BACKEND_LIBRARY = "ggml-virtgpu-backend"
READY_LINE = "apir-host: listening on"
#: The backend library's cap on the host memory one client holds, shared and allocated (bytes).
MEM_CAP_ENV = "GGML_VIRTGPU_HOST_MEM_CAP"
EXIT_MARK = "--- apirctl: apir-host"
READY_TIMEOUT = 60.0

# The watcher: runs the host, forwards SIGTERM/SIGINT to it, and logs how it ended. With respawn
# (a server with a Podman restart policy) it starts a host that died again at once, so the
# container Podman restarts finds one; a host that exits 0 or is stopped is not started again, nor
# one that died RESPAWN_LIMIT times.
_WATCHER = r"""
pidfile=$1; respawn=$2; limit=$3; shift 3
stopping=; runs=0
trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM INT
while :; do
  "$@" </dev/null &
  child=$!
  echo "$child" > "$pidfile"
  wait "$child"; rc=$?
  while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
  if [ "$rc" -gt 128 ]; then
    echo "--- apirctl: apir-host (pid $child) was killed by signal $((rc - 128)) (SIG$(kill -l $((rc - 128))))"
  else
    echo "--- apirctl: apir-host (pid $child) exited with status $rc"
  fi
  runs=$((runs + 1))
  if [ "$respawn" != 1 ] || [ -n "$stopping" ] || [ "$rc" -eq 0 ] || [ "$runs" -ge "$limit" ]; then break; fi
  sleep 0.2
  [ -n "$stopping" ] && break
  echo "--- apirctl: starting apir-host again (restart $runs of $((limit - 1)), the server's restart policy)"
done
"""
RESPAWN_LIMIT = 10


class Host(Supervised):
    """One apir-host of one APIR container (state dir, JSON); `id` is the container's `apirctl.apir-host`
    label, `pid` the apir-host process."""

    watcher: int = 0  # the sh that runs it (its process group)
    trace: str | None = None  # the trace file (`apir-host --trace`), when tracing is on
    binary: str = ""
    backend_library: str = ""
    ggml_library: str = ""
    reg: str = ""
    respawn: bool = False  # its server has a restart policy: the watcher starts a host that died again
    mem_cap: int | None = None  # bytes of host memory each client may hold (the container's memory limit)
    threads: int = 0  # a CPU backend's threads (`apir-host --threads`; 0: ggml's default)

    @property
    def socket(self) -> Path:
        return Path(self.directory) / SOCKET_NAME


def records_dir() -> Path:
    return dirs().state / "apir-hosts"


def traces_dir() -> Path:
    """Traces outlive their host (read them after the server stopped): `apirctl apir trace`."""
    return dirs().logs / "apir-traces"


#: A host is kept by an existing container: Podman's restart policy (or `apirctl restart`) starts the
#: container again against it, and a host that died stays recorded, so `ps` can say why.
_registry: Registry[Host] = Registry(Host, records_dir, "apir", keep="existing")
_write = _registry.write
get = _registry.get
hosts = _registry.all
attach = _registry.attach
keepers = _registry.keepers
release = _registry.release


def _pid_file(host_id: str) -> Path:
    return _registry.store.path(host_id, ".pid")


def current_pid(host: Host) -> int:
    """The host's pid now: the watcher writes each run's (a respawned host has a new one)."""
    try:
        return int(_pid_file(host.id).read_text().strip())
    except (OSError, ValueError):
        return host.pid


def alive(host: Host) -> bool:
    pid = current_pid(host)
    return bool(pid) and supervised.is_process(pid, BINARY)


# --- what a build offers ------------------------------------------------------------------------


def libraries(build: Build) -> tuple[Path, Path, str]:
    """(backend library, GGML library, registration symbol) of the host build: its GPU backend
    (CUDA) where it has one, else the CPU backend."""
    backend = "cuda" if build.backend == "cuda" else "cpu"
    return build.library(BACKEND_LIBRARY), build.library(f"ggml-{backend}"), f"ggml_backend_{backend}_reg"


def host_problem(build: Build | None) -> str | None:
    """Why this host build cannot run apir-host, or None."""
    if build is None:
        return "llama.cpp is not built on this host"
    if not (build.bin_dir / BINARY).exists():
        return f"the llama.cpp build has no {BINARY} (a build from before APIR on Linux: run `apirctl setup`)"
    try:
        libraries(build)
    except ApirctlError as exc:
        return exc.message
    return None


def frontend_problem(build: Build | None) -> str | None:
    """Why a (container or host) build has no ggml-virtgpu frontend with the socket transport, or None."""
    if build is None:
        return "the inference image's llama.cpp is not built"
    if not any(build.bin_dir.glob(f"lib{FRONTEND_LIBRARY}.so*")):
        return "the inference image's llama.cpp has no ggml-virtgpu frontend (run `apirctl setup`)"
    return None


# --- starting and stopping ------------------------------------------------------------------------


def start(build: Build, name: str, trace: bool = False, respawn: bool = False, mem_cap: int | None = None,
          region: Inherited | None = None, threads: int | None = None) -> Host:
    """Start an apir-host for the container (or bench run) `name` and wait until it listens.

    `respawn` (a server with a Podman restart policy): a host that dies is started again, so that
    the container Podman restarts after it finds one. `region`: a VM's shared memory, whose ranges
    its frontend names its resources by (`apir-host --region-fd`; llama_patches/ 0025). `threads`: a CPU
    backend's (default: half the CPUs, as ggml-rpc-server's default; ggml's own is 4 whatever the
    host has, llama_patches/ 0026)."""
    backend_library, ggml_library, reg = libraries(build)
    binary = build.binary(BINARY)
    base = private_dir(dirs().runtime)
    host_id = secrets.token_hex(4)
    directory = base / f"apir-{host_id}"
    socket_path(directory, SOCKET_NAME)
    owner_pid, owner_start = supervised.owner()
    trace_file = None
    if trace:
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:60] or "apir"
        trace_file = str(ensure(traces_dir()) / f"{safe}-{host_id}.trace")
    host = Host(id=host_id, directory=str(directory), log=str(dirs().logs / f"apir-host-{host_id}.log"),
                trace=trace_file, started_at=time.time(), owner_pid=owner_pid, owner_start=owner_start,
                name=name, binary=str(binary), backend_library=str(backend_library), ggml_library=str(ggml_library),
                reg=reg, respawn=respawn, mem_cap=mem_cap, threads=threads or max(1, (os.cpu_count() or 2) // 2))
    try:
        directory.mkdir(mode=0o700)
        _launch(host, region=region)
    except BaseException:
        stop(host)
        raise
    return host


def _command(host: Host, region: Inherited | None = None) -> list[str]:
    args = [host.binary, "--socket", str(host.socket), "--backend-library", host.backend_library,
            "--ggml-library", host.ggml_library, "--ggml-reg", host.reg]
    args += ["--trace", host.trace] if host.trace else []
    args += ["--threads", str(host.threads)] if host.threads else []
    return args + (["--region-fd", str(region.fd)] if region is not None else [])


def _launch(host: Host, timeout: float = READY_TIMEOUT, region: Inherited | None = None) -> None:
    """Run the host under its watcher, record it, and wait for its ready line."""
    log = Path(host.log)
    ensure(log.parent)
    ensure(records_dir())
    pid_file = _pid_file(host.id)
    pid_file.unlink(missing_ok=True)
    since = log.stat().st_size if log.exists() else 0
    command = _command(host, region)
    with log.open("ab") as fh:
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        fh.write(f"--- apirctl: {stamp} starting {' '.join(command)}\n".encode())
        fh.flush()
        since = fh.tell()
        # restore_signals=False keeps SIGPIPE ignored: a container that vanishes costs a failed write only.
        env = {k: v for k, v in os.environ.items() if k != MEM_CAP_ENV}
        if host.mem_cap:
            env[MEM_CAP_ENV] = str(host.mem_cap)
        watcher = subprocess.Popen(["sh", "-c", _WATCHER, "apir-watch", str(pid_file), "1" if host.respawn else "0",
                                    str(RESPAWN_LIMIT), *command], env=env,
                                   stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                   start_new_session=True, restore_signals=False,
                                   pass_fds=(region.fd,) if region is not None else ())
    supervised.adopt(watcher)
    host.watcher = watcher.pid
    _write(host)
    deadline = time.monotonic() + timeout
    while True:
        if not host.pid:
            with contextlib.suppress(OSError, ValueError):
                host.pid = int(pid_file.read_text().strip())
                _write(host)
        text = _log_since(log, since)
        if READY_LINE in text and host.pid and alive(host):
            return
        if watcher.poll() is not None or EXIT_MARK in text:
            raise ApirctlError(f"{BINARY} did not start: {failure_line(log)}",
                               hint=f"its log: {log}")
        if time.monotonic() > deadline:
            raise ApirctlError(f"{BINARY} did not listen on {host.socket} within {timeout:.0f}s",
                               hint=f"its log: {log}")
        time.sleep(0.02)


def _log_since(log: Path, offset: int) -> str:
    try:
        with log.open("rb") as fh:
            fh.seek(offset)
            return fh.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""


def revive(host_id: str) -> Host:
    """Start a host that died again, on the same socket directory (its container keeps the mount),
    with the same libraries and trace; a host that runs is left alone."""
    host = get(host_id)
    if host is None:
        raise ApirctlError(f"the apir host {host_id} of this server is gone (its record was removed)",
                           hint="stop the server and serve it again")
    if alive(host):
        return host
    if host.watcher:
        supervised.terminate(host.watcher, "sh", 2.0)
    _pid_file(host.id).unlink(missing_ok=True)
    directory = Path(host.directory)
    private_dir(directory.parent)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    Path(host.socket).unlink(missing_ok=True)
    host.pid = 0
    host.started_at = time.time()
    _launch(host)
    return host


def stop(host: Host | str) -> None:
    """Stop the host (SIGTERM: it removes its socket), then its directory, record, pid file and log.
    The trace stays, for `apirctl apir trace` after the server is gone."""
    found = get(host) if isinstance(host, str) else host
    if found is None:
        return
    reap()
    if found.watcher and supervised.is_process(found.watcher, "sh"):  # first, so that it starts no new host
        with contextlib.suppress(ProcessLookupError):
            os.kill(found.watcher, signal.SIGTERM)
    pid = current_pid(found)
    if pid:
        supervised.terminate(pid, BINARY)
    if found.watcher:
        supervised.terminate(found.watcher, "sh", 2.0)
    reap()
    _pid_file(found.id).unlink(missing_ok=True)
    _registry.remove(found)


def stale(host: Host, existing: Iterable[str]) -> bool:
    """No apirctl process is setting it up, and its container no longer exists. A host outlives
    its container's exit on purpose (see `_registry`)."""
    return _registry.stale(host, existing)


def clean(existing: Iterable[str]) -> list[str]:
    """Stop the hosts whose containers are gone (`existing`: the ids of the containers that exist,
    running or not); returns their names."""
    return _registry.clean(existing, stop)


# --- why a host is gone -----------------------------------------------------------------------------


def ending(host: Host) -> str | None:
    """How the host's last run ended, from its watcher's line ("was killed by signal 9 (SIGKILL)"),
    with the host's own last telling line when it said something before dying."""
    lines = tail(Path(host.log), 60).splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(EXIT_MARK)]
    if not marks:
        return None
    last = marks[-1]
    how = lines[last].removeprefix("--- apirctl: ").strip()
    before = [line.strip() for line in lines[:last] if line.strip() and not line.startswith("--- apirctl")]
    telling = [line for line in before if any(w in line.lower() for w in ("error", "abort", "assert", "fail",
                                                                          "fatal", "segmentation"))]
    return f"{how}: {telling[-1]}" if telling else how


def problem(host_id: str) -> str | None:
    """Why a container on this host cannot work now, or None (cheap: `ps` asks for each server)."""
    host = get(host_id)
    if host is None:
        return "apir host gone"
    if alive(host):
        return None
    how = ending(host)
    deadline = time.monotonic() + 1.0
    while how is None and host.watcher and supervised.is_process(host.watcher, "sh") and time.monotonic() < deadline:
        time.sleep(0.02)  # the host has just died: its watcher is writing how
        how = ending(host)
    return f"apir host down: {how}" if how else f"apir host down (pid {current_pid(host)} is gone; see {host.log})"


def describe(host: Host, owner: str | None = None) -> str:
    """One line for `machine status`: the container, pid, socket, trace, and why it is down."""
    how = ending(host)  # of a host that runs: the one before it, which the watcher replaced
    after = f" (started again after: {how})" if how else ""
    state = after if alive(host) else f" (down: {how or 'pid gone'})"
    trace = f", trace {host.trace}" if host.trace else ""
    return f"{owner or host.name or '?'}: pid {current_pid(host)}, {host.socket}{trace}{state}"


# --- traces ------------------------------------------------------------------------------------------


def trace_of(server: str | None = None) -> Path:
    """The trace of a server's host (by container name or id prefix); without a name, that of the
    only traced host, else the newest trace file."""
    found = hosts()
    if server:
        for host in found:
            if server in (host.name, host.container) or (len(server) >= 6 and host.container.startswith(server)):
                if not host.trace:
                    raise ApirctlError(f"the apir host of {server} does not trace",
                                       hint="serve it with --apir-trace, or turn tracing on for every server "
                                       "with `apirctl config`")
                return Path(host.trace)
        raise ApirctlError(f"no apir host serves {server!r}",
                           hint="`apirctl ps` lists servers; APIR servers run with --transport virtgpu")
    traced = [h for h in found if h.trace]
    if len(traced) == 1:
        return Path(traced[0].trace or "")
    if len(traced) > 1:
        names = ", ".join(h.name for h in traced)
        raise ApirctlError(f"several apir hosts trace ({names})", hint="name one with --server, or give a file")
    files = sorted(traces_dir().glob("*.trace"), key=lambda p: p.stat().st_mtime) if traces_dir().exists() else []
    if not files:
        raise ApirctlError("no APIR trace found", hint="serve with `--transport virtgpu --apir-trace`, or give a file")
    return files[-1]
