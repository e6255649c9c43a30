"""Linux remoting: llama.cpp's RPC server on the host GPU, owned by apirctl.

There is no krunkit on Linux; the same idea (the container's GGML calls run on the host GPU)
is served by `ggml-rpc-server` from apirctl's own (patched) llama.cpp build. apirctl starts it in
the background and keeps its pid, endpoint, device, log file, start time and a random instance id
in the state directory. Readiness is a protocol answer (`rpc_client.probe`), never just an open
port. The RPC protocol has no authentication and lets a client read and write host memory it
allocated, so the backend listens where only this user can reach it:

- `unix` (the default): a Unix socket in apirctl's runtime directory (0700, checked at start; the
  socket 0600, and the server refuses peers of another uid). Local remoting containers do not
  share it: each gets a backend of its own with these settings (`apirctl.remoting.backends`).
- `tcp` (`--listen tcp`, or `--port`): 127.0.0.1:PORT, for SSH tunnels from other hosts
  (`--rpc-backend` / `--via-ssh` there), and for containers through the host-loopback door
  (`apirctl.remoting.hostloopback`), one at a time.

States (the exit codes of `apirctl machine status`): 127 no build, 11 not running,
0 ready, 1 an rpc inference server uses it (or a backend of its own runs for one).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from apirctl import config, durations
from apirctl.build import llamacpp
from apirctl.errors import ApirctlError, tail
from apirctl.gpu import nvidia
from apirctl.machine import MachineState, MachineStatus, RestartOptions
from apirctl.paths import dirs, ensure, private_dir, socket_path
from apirctl.podman import servers as podman_servers
from apirctl.podman.servers import Server
from apirctl.remoting import apir_hosts, backends, rpc_client
from apirctl.remoting.backends import BINARY, is_backend_process

if TYPE_CHECKING:
    from apirctl.build.llamacpp import Build

PLATFORM = "linux"
LOOPBACK = "127.0.0.1"
SOCKET_NAME = "rpc.sock"
LISTENS = ("unix", "tcp")
Listen = Literal["unix", "tcp"]
RESTART_HINT = "start it with `apirctl machine restart --remoting`"


class BackendRecord(BaseModel):
    """What apirctl remembers about the backend it started (state dir, JSON)."""

    pid: int
    listen: Listen = "tcp"  # records written before the Unix socket existed are TCP
    socket: str | None = None  # the socket path when listen is unix
    instance: str = ""  # random per start: servers label it, so a restarted backend is told apart
    host: str = LOOPBACK
    port: int = 0
    device: str | None = None  # as asked (--device); None = the server's own choice (all GPUs, else CPU)
    threads: int | None = None
    cache: bool = True
    cache_dir: str | None = None
    log: str
    started_at: float
    binary: str
    source_version: str = ""
    apir: str = ""  # what the apir-host check of the last restart found ("ready", or why not)

    @property
    def address(self) -> tuple[str, int | None]:
        """(host, port) for `rpc_client.probe`: (`unix:PATH`, None) for the socket."""
        if self.listen == "unix" and self.socket:
            return f"{rpc_client.UNIX_PREFIX}{self.socket}", None
        return self.host, self.port

    @property
    def endpoint(self) -> str:
        return rpc_client.endpoint(*self.address)


def record_file() -> Path:
    return dirs().state / "rpc-backend.json"


def log_file() -> Path:
    return dirs().logs / "rpc-backend.log"


def socket_file() -> Path:
    """The host backend's socket (in the runtime directory, which `private_dir` checks)."""
    return dirs().runtime / SOCKET_NAME


cache_dir = backends.cache_dir


def read_record() -> BackendRecord | None:
    path = record_file()
    if not path.exists():
        return None
    try:
        return BackendRecord.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None


def instances_file() -> Path:
    """The instance ids of the host backends this home started, newest last (kept after `machine
    stop`): a server labelled with one of them was started here, against an earlier one."""
    return dirs().state / "rpc-backend-instances"


def _earlier_list() -> list[str]:
    try:
        return instances_file().read_text().split()
    except OSError:
        return []


def _earlier_instances() -> set[str]:
    return set(_earlier_list())


def remember_instance(instance: str, keep: int = 64) -> None:
    """Add `instance` to this home's list (the last `keep`)."""
    path = instances_file()
    ensure(path.parent)
    known = [i for i in _earlier_list() if i != instance][-(keep - 1):] + [instance]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(known) + "\n")
    tmp.replace(path)


def _write_record(record: BackendRecord) -> None:
    if record.instance:
        remember_instance(record.instance)
    path = record_file()
    ensure(path.parent)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(path)


def _clear_record() -> None:
    with contextlib.suppress(FileNotFoundError):
        record_file().unlink()


# --- processes and ports ---------------------------------------------------------------------


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
    return tail(log_file(), lines).splitlines()


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
    return backends.failure_line(log_file())


def _listing() -> list[Server] | None:
    """apirctl's servers, stopped ones too (a server that exited with its backend needs a restart)."""
    try:
        return podman_servers.list_servers(all=True)
    except Exception:  # noqa: BLE001 - status must answer even when Podman does not
        return None


def _on_host_backend(server: Server) -> bool:
    """Started against an instance of this home's host TCP backend (its label names which), on
    whatever port or socket that backend listens now; not another home's (homes may share a Podman)."""
    return (server.transport == "rpc" and server.rpc_link == "tcp" and not server.rpc_backends
            and bool(server.rpc_instance) and server.rpc_instance in _earlier_instances())


def rpc_servers(port: int | None = None, found: list[Server] | None = None) -> list[Server]:
    """Running inference servers that use this host's remoting: those with a backend of their own
    (`apirctl.remoting.backends`, or an apir-host: `apirctl.remoting.apir_hosts`), those started
    against any instance of this home's host TCP backend (their label says so, whatever port it
    had), and unlabelled ones on `port` when given.

    Servers of other backends (`--rpc-backend`, another home's, or an unlabelled one on another
    port) are not its users. Empty when Podman cannot be asked.
    """
    found = _listing() if found is None else found
    return [s for s in found or [] if s.state == "running" and not s.rpc_backends and _uses_remoting(s, port)]


def _own_apir_host(server: Server) -> bool:
    """A Linux APIR server with an apir-host this home knows (another home's, on a shared Podman,
    is not ours to count, list or restart)."""
    return bool(server.apir_host) and apir_hosts.get(server.apir_host) is not None


def _uses_remoting(server: Server, port: int | None) -> bool:
    if server.transport == "virtgpu":
        return _own_apir_host(server)
    if server.transport != "rpc":
        return False
    if server.rpc_link in ("unix", "shm"):  # a backend of its own: one this home started (homes may share a Podman)
        return backends.get(server.rpc_instance) is not None
    if server.rpc_instance:  # labelled: an instance of this home's backend, or another home's
        return _on_host_backend(server)
    return port is None or not server.rpc_target or server.rpc_target.rsplit(":", 1)[-1] == str(port)


def moved(server: Server, record: BackendRecord) -> str | None:
    """How the host backend changed under a server started against an earlier instance of it, when
    restarting its container cannot reconnect it (its `--rpc` address is fixed at create, so a
    restart makes it again): the backend now listens on another port, or on a Unix socket. None
    when only the instance changed."""
    old = server.rpc_target.rsplit(":", 1)[-1]
    if record.listen == "unix":
        return f"the backend moved from tcp port {old} to a Unix socket"
    if old != str(record.port):
        return f"the backend moved from tcp port {old} to {record.port}"
    return None


def backend_problem(instance: str = "", link: str = "", started: float | None = None) -> str | None:
    """Why an rpc container cannot work now, or None; cheap (no probe, no Podman) so `ps` can ask.

    `instance` and `link` are the container's labels: a backend of its own (unix/shm) is checked
    by itself; on the shared TCP backend, an instance other than the running one means that the
    backend was restarted under the server, whose connection died with the old one, unless the
    container itself started (`started`) after the backend did.
    llama-server only notices a dead backend at its next request, so its own /health keeps
    saying ok until then; `apirctl ps` shows this reason instead.
    """
    if link in ("unix", "shm") and instance:
        return backends.problem(instance)
    record = read_record()
    if record is None:
        return "rpc backend not running"
    if not is_backend_process(record.pid):
        return "rpc backend down"
    if _restarted_under(instance, started, record):
        return "rpc backend restarted: restart this server"
    return None


def _restarted_under(instance: str, started: float | None, record: BackendRecord) -> bool:
    """A server labelled with an earlier instance of this home's TCP backend (not another home's:
    homes may share one Podman), started before this one (Podman gives whole seconds: a container
    started in the backend's own second counts as after it)."""
    return bool(instance and record.instance and instance != record.instance and instance in _earlier_instances()
                and (started is None or started < int(record.started_at)))


def _split(servers: list[Server], record: BackendRecord | None) -> tuple[list[Server], list[Server]]:
    """(users, orphans): orphans were connected to a TCP backend that has been restarted since,
    so their connection is dead and they hold nothing (they need a restart)."""
    if record is None:
        return servers, []
    orphans = [s for s in servers if s.rpc_link == "tcp" and _restarted_under(s.rpc_instance, s.started, record)]
    return [s for s in servers if s not in orphans], orphans


def _st(state: MachineState, summary: str, next_step: str | None = None, **details: Any) -> MachineStatus:
    return MachineStatus(platform=PLATFORM, state=state, summary=summary, next_step=next_step,
                         details={k: v for k, v in details.items() if v is not None})


def _find_build() -> tuple[Build | None, str | None]:
    """The host build and its server binary's problem, if any."""
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


def _shared_users(servers: list[Server]) -> list[Server]:
    """The servers connected to the host backend itself (TCP): the others have backends of their own."""
    return [s for s in servers if s.transport == "rpc" and s.rpc_link not in ("unix", "shm")]


def own_backends(found: list[Server] | None = None, gpu: dict[int, int] | None = None) -> list[str]:
    """One line per backend of its own that runs for a container (stale ones stopped first, when
    Podman answers): the container, pid, link and socket, and the GPU memory it holds (`gpu`, from
    `nvidia.memory_by_process`)."""
    found = _listing() if found is None else found
    if found is not None:
        backends.clean(backends.keepers(found))
    names = {s.id: s.name for s in found or []}
    lines = []
    for instance in backends.instances():
        owner = names.get(instance.container) or instance.name or "?"
        down = "" if backends.alive(instance) else " (down)"
        lines.append(f"{owner}: pid {instance.pid}, rpc-{instance.link}, {instance.socket}"
                     f"{_gpu_memory(instance.pid, gpu)}{down}")
    return lines


def own_apir_hosts(found: list[Server] | None = None, gpu: dict[int, int] | None = None) -> list[str]:
    """One line per apir-host (Linux virtgpu containers): the container, pid, socket, trace, the GPU
    memory its client's child holds, and why it is down (hosts of containers that are gone are stopped
    first; `found` lists every container)."""
    if not apir_hosts.hosts():
        return []
    if found is not None:
        apir_hosts.clean(apir_hosts.keepers(found))
    names = {s.id: s.name for s in found or []}
    return [apir_hosts.describe(h, names.get(h.container)) + _gpu_memory(apir_hosts.current_pid(h), gpu)
            for h in apir_hosts.hosts()]


def _gpu_memory(pid: int | None, gpu: dict[int, int] | None) -> str:
    used = nvidia.memory_of(pid, gpu) if pid and gpu else None
    return f", GPU memory {used // 2**20} MiB" if used is not None else ""


def gpu_sharing() -> str | None:
    """How the containers' backends share an NVIDIA GPU (None without one): each is a CUDA process of its
    own, which take turns on the GPU unless CUDA MPS runs (docs/linux.md)."""
    if not nvidia.find_driver(ldconfig_text="", smi="").gpus:
        return None
    mps = nvidia.mps_state()
    if mps.running:
        return f"CUDA MPS (pid {', '.join(map(str, mps.pids))}): the backends compute at once"
    return "time-sliced (no CUDA MPS): the backends take turns; `nvidia-cuda-mps-control -d` lets them run at once"


def _apir_state(record: BackendRecord | None, build: Build | None) -> str:
    """Whether virtgpu containers can get an apir-host here: the build's, checked by the last restart."""
    problem = apir_hosts.host_problem(build)
    if problem:
        return f"unavailable: {problem}"
    if record is not None and record.apir and record.apir != "ready":
        return f"failed its check at the last restart: {record.apir}"
    backend = "CUDA" if build is not None and build.backend == "cuda" else "CPU"
    return f"ready: an apir-host of its own per virtgpu container ({backend} backend)"


def _where(record: BackendRecord) -> dict[str, Any]:
    if record.listen == "unix":
        return {"transport": "unix socket (local containers: a backend each, shared memory)",
                "socket": record.socket}
    return {"transport": "tcp", "host": record.host, "port": record.port}


def status(name: str | None = None, *, gpu_memory: bool = False) -> MachineStatus:
    """Not installed (127) / not running (11) / ready (0) / serving (1), with the facts."""
    build, problem = _find_build()
    if problem:
        return _st(MachineState.NOT_INSTALLED, f"remoting is not installed: {problem}", "run `apirctl setup`")
    record = read_record()
    # Podman is asked only when there is something to match (serve's `auto` asks this on its hot path)
    found = _listing() if record is not None or backends.instances() or apir_hosts.hosts() else []
    # each container's backend is a GPU context of its own: what each holds, when asked (the driver's
    # tool takes tens of milliseconds; serve's planning reads this status too)
    asked = gpu_memory and bool(backends.instances() or apir_hosts.hosts())
    gpu = nvidia.memory_by_process() if asked else {}
    own = own_backends(found, gpu) or None
    apir = {"apir": _apir_state(record, build), "apir_hosts": own_apir_hosts(found, gpu) or None,
            "gpu_sharing": gpu_sharing() if asked else None}
    if record is None:  # APIR servers do not need it: each has its apir-host (say so, they are not in trouble)
        apir_serving = ", ".join(s.name for s in found or [] if s.running and s.transport == "virtgpu" and s.apir_host)
        also = f" (virtgpu servers run on apir-hosts of their own: {apir_serving})" if apir_serving else ""
        return _st(MachineState.NOT_RUNNING, f"the host RPC backend is not running{also}", RESTART_HINT,
                   backends=own, **apir)
    common = {"pid": record.pid, "listen": record.listen, **_where(record), "endpoint": record.endpoint,
              "instance": record.instance or None, "log": record.log, "backends": own, **apir}
    common["servers"] = server_lines(found or [], record) or None
    if not is_backend_process(record.pid):
        return _st(MachineState.NOT_RUNNING,
                   f"the host RPC backend is down: pid {record.pid} was killed or exited "
                   f"(last log line: {_failure_line()})", RESTART_HINT, **common,
                   note="rpc inference servers on it abort at their next request; restart them after the backend")

    uptime = durations.short(time.time() - record.started_at)
    devices = _devices_from_log()
    servers, orphans = _split(rpc_servers(record.port if record.listen == "tcp" else None, found), record)
    orphans += [s for s in found or [] if s.state == "exited" and _on_host_backend(s)
                and _restarted_under(s.rpc_instance, s.started, record)]
    serving = ", ".join(s.name for s in servers) or None
    if orphans:
        common["restart"] = ", ".join(s.name for s in orphans)
        common["note"] = ("the backend was restarted under these servers: restart them "
                          "(`apirctl machine restart --remoting --restart-servers`)")
    cache = record.cache_dir if record.cache else "off"
    state = MachineState.SERVING if servers else MachineState.READY
    if _shared_users(servers):  # its one connection belongs to them: a probe would only queue behind it
        return _st(state, f"the host RPC backend is serving: {serving}", None,
                   device=", ".join(devices) or record.device, uptime=uptime, serving=serving, cache=cache, **common)
    try:
        info = rpc_client.probe(*record.address, timeout=2.0)
    except rpc_client.RpcBusy:
        return _st(state, "the host RPC backend runs (busy with a client now)", None,
                   device=", ".join(devices) or record.device, uptime=uptime, serving=serving, **common)
    except (OSError, rpc_client.RpcError) as exc:
        return _st(MachineState.NOT_RUNNING,
                   f"the host RPC backend (pid {record.pid}) does not answer on {record.endpoint}: {exc}",
                   RESTART_HINT, **common)
    memory = [f"{d.free // 2**20} MiB free of {d.total // 2**20} MiB" for d in info.devices]
    details = dict(device=", ".join(devices) or record.device or "server default", memory="; ".join(memory),
                   memory_bytes=[{"index": d.index, "free": d.free, "total": d.total} for d in info.devices],
                   protocol=info.version, uptime=uptime, cache=cache, serving=serving, **common)
    summary = (f"the host RPC backend is serving: {serving}" if servers
               else f"the host RPC backend is ready on {record.endpoint}")
    return _st(state, summary, None, **details)


def server_lines(found: list[Server], record: BackendRecord) -> list[str]:
    """One line per server of this host's remoting, running or exited: "NAME: serving (rpc-tcp)",
    "NAME: rpc backend restarted: restart this server", "NAME: exited (code 134): ..." (`machine
    status` shows them; its --json has them under `servers`)."""
    alive = is_backend_process(record.pid)
    lines = []
    for server in found:
        if server.transport == "virtgpu" and _own_apir_host(server):  # Linux APIR: an apir-host of its own
            exited = f"exited (code {server.exit_code})" if server.exit_code is not None else server.state
            said = "serving (virtgpu-socket, an apir-host of its own)" if server.running else exited
            problem = apir_hosts.problem(server.apir_host)
            lines.append(f"{server.name}: {said}" + (f"; {problem}: restart it" if problem else ""))
            continue
        own = server.rpc_link in ("unix", "shm") and bool(server.rpc_instance)
        if server.transport != "rpc" or server.rpc_backends or not (own or _on_host_backend(server)):
            continue
        exited = f"exited (code {server.exit_code})" if server.exit_code is not None else server.state
        if own:
            problem = backends.problem(server.rpc_instance) if server.running else None
            said = f"serving (rpc-{server.rpc_link}, a backend of its own)" if server.running else exited
            lines.append(f"{server.name}: {problem or said}")
        elif not alive:
            down = "rpc backend down: it aborts at its next request" if server.running else exited
            lines.append(f"{server.name}: {down}; restart it after the backend")
        elif _restarted_under(server.rpc_instance, server.started, record):
            where = moved(server, record)
            fix = f"{where}: restart this server (in a new container)" if where else "restart this server"
            lines.append(f"{server.name}: {'' if server.running else exited + ': '}rpc backend restarted: {fix}")
        else:
            lines.append(f"{server.name}: {'serving (rpc-tcp)' if server.running else exited}")
    return lines


def servers(name: str | None = None) -> list[Server]:
    """The running inference servers that use this host's remoting (`machine stop --force` stops them
    first): those on the host backend and those with a backend of their own."""
    record = read_record()
    return _split(rpc_servers(record.port if record and record.listen == "tcp" else None), record)[0]


def stale_servers() -> list[Server]:
    """APIR servers whose apir-host died (Linux virtgpu), and servers started against an earlier
    instance of the TCP host backend, running (their link is
    dead) or exited (llama-server aborts at its first request after the backend went away), with
    `why` saying so: what `machine restart --remoting --restart-servers` restarts. The backend may
    have come back on another port or on a Unix socket: such servers are stale too. Empty when no
    backend runs."""
    record = read_record()
    if (record is None or not is_backend_process(record.pid)) and not apir_hosts.hosts():
        return []
    try:
        found = podman_servers.list_servers(all=True)
    except Exception:  # noqa: BLE001 - as status: no Podman, nothing to restart
        return []
    orphans = []
    for server in found:
        problem = apir_hosts.problem(server.apir_host) if server.managed and _own_apir_host(server) else None
        if problem and server.state in ("running", "exited"):
            server.why = f"{problem}{' (it exited)' if server.state == 'exited' else ''}: restart it"
            orphans.append(server)
    if record is None or not is_backend_process(record.pid):
        return orphans
    stale = [s for s in found if s.managed and _on_host_backend(s) and s.state in ("running", "exited")
             and _restarted_under(s.rpc_instance, s.started, record)]
    for server in stale:
        server.why = _stale_why(server, record)
    return orphans + stale


def _stale_why(server: Server, record: BackendRecord) -> str:
    exited = " (it exited)" if server.state == "exited" else ""
    why = f"started against the previous backend, its connection is dead{exited}"
    where = moved(server, record)
    return f"{why}; {where}: restart it (in a new container)" if where else f"{why}: restart it"


def _refuse_if_used(action: str) -> None:
    """Refuse while servers hold a connection to the host backend (a backend of their own is not
    touched by restarting or stopping this one)."""
    users = _shared_users(servers())
    if users:
        names = ", ".join(s.name for s in users)
        raise ApirctlError(f"cannot {action} the host RPC backend: inference servers use it ({names})",
                           hint="stop them with `apirctl stop NAME`, or pass --force to stop them first")


def stop(name: str | None = None) -> MachineStatus:
    """Stop the backend; refuses while an rpc inference server uses it."""
    record = read_record()
    if record is not None and is_backend_process(record.pid):
        _refuse_if_used("stop")
        backends.terminate(record.pid)
    _clear_record()
    if record is not None and record.listen == "unix" and record.socket:
        Path(record.socket).unlink(missing_ok=True)
    return status(name)


def _spawn(build: Build, listen: Listen, port: int, device: str | None, threads: int | None,
           cache: bool) -> BackendRecord:
    """Start the server on the socket or the port; wait for a protocol answer."""
    log = log_file()
    sock = None
    if listen == "unix":
        sock = socket_path(private_dir(dirs().runtime), SOCKET_NAME)
        address: list[str] = ["-H", f"{rpc_client.UNIX_PREFIX}{sock}"]
    else:
        address = ["-H", LOOPBACK, "-p", str(port)]
    child = backends.spawn(build, address, log, device, threads, cache)
    record = BackendRecord(pid=child.pid, listen=listen, socket=str(sock) if sock else None,
                           instance=secrets.token_hex(4), port=port if listen == "tcp" else 0, device=device,
                           threads=threads, cache=cache, cache_dir=str(cache_dir() / "rpc") if cache else None,
                           log=str(log), started_at=time.time(), binary=str(build.binary(BINARY)),
                           source_version=build.source_version)
    backends.wait_ready(child, *record.address, log)
    return record


def start_own_backend(name: str, memory_limit: int | None = None,
                      region: backends.Inherited | None = None) -> backends.Instance:
    """A backend of its own for the container (or bench run) `name`, with the host backend's
    settings (device, threads, weight cache): what local rpc containers run against. The container's
    memory limit (bytes), if it has one, caps the host memory it shares with the backend; a VM's
    `region` is the shared memory its guest reaches the backend through."""
    record = read_record()
    build = llamacpp.require_build()
    if record is None:
        settings = config.settings()
        return backends.start(build, name, threads=settings.threads, cache=settings.rpc_cache,
                              memory_limit=memory_limit, region=region)
    return backends.start(build, name, device=record.device, threads=record.threads, cache=record.cache,
                          memory_limit=memory_limit, region=region)


def restart(options: RestartOptions, progress: Callable[[str], None] | None = None) -> MachineStatus:
    """(Re)start the backend with `--remoting`; without it, stop the backend (plain containers stay).

    It listens on a Unix socket in the runtime directory unless `options.listen` (or a `port`)
    asks for TCP on 127.0.0.1. On a failed start the previous backend, if one ran, is started again
    with its old settings. `progress(step)` is told each step as it starts.
    """
    say = progress or (lambda _step: None)
    if not options.remoting:
        say("stopping the host RPC backend")
        return stop(options.name)

    settings = config.settings()
    asked = options.listen or ("tcp" if options.port else settings.rpc_listen)
    if asked not in LISTENS:
        raise ApirctlError(f"--listen {asked!r}: choose unix or tcp")
    listen: Listen = "unix" if asked == "unix" else "tcp"
    if listen == "unix":
        socket_path(private_dir(dirs().runtime), SOCKET_NAME)  # refuse a bad runtime directory first
    build = llamacpp.current_build()
    if build is None:  # the machine's "not installed" state: its exit code is the status's
        raise ApirctlError("llama.cpp is not built yet", exit_code=MachineState.NOT_INSTALLED,
                           hint="run `apirctl setup`")
    build.binary(BINARY)
    port = options.port or settings.rpc_port
    cache = settings.rpc_cache if options.cache is None else options.cache
    threads = options.threads or settings.threads
    old = read_record()
    old_running = old is not None and is_backend_process(old.pid)
    if listen == "tcp" and not (old_running and old is not None and old.listen == "tcp" and old.port == port):
        check_port_free(port)
    if old_running and old is not None:
        _refuse_if_used("restart")
        say(f"stopping the running {BINARY} (pid {old.pid})")
        backends.terminate(old.pid)
    _clear_record()
    try:
        where = socket_file() if listen == "unix" else f"{LOOPBACK}:{port}"
        say(f"starting {BINARY} on {where}")
        record = _spawn(build, listen, port, options.device, threads, cache)
    except ApirctlError:
        if old_running and old is not None:
            say(f"starting the previous {BINARY} again")
            with contextlib.suppress(ApirctlError):
                _write_record(_spawn(build, old.listen, old.port, old.device, old.threads, old.cache))
        raise
    record.apir = _check_apir(build, say)
    _write_record(record)
    return status(options.name)


def _check_apir(build: Build, say: Callable[[str], None]) -> str:
    """Start an apir-host on a socket of its own and stop it (what serve does per virtgpu container),
    so a broken host program or library is found now; "ready", or why not. Never fails the restart:
    rpc remoting works without it."""
    problem = apir_hosts.host_problem(build)
    if problem:
        return problem
    say(f"checking {apir_hosts.BINARY}")
    try:
        host = apir_hosts.start(build, "machine-check")
    except ApirctlError as exc:
        return exc.message
    apir_hosts.stop(host)
    return "ready"


def logs(follow: bool = False, tail: int = 50) -> Iterator[str]:
    """The last `tail` lines of the backend's log; with `follow`, then what it appends, as it comes."""
    path = log_file()
    if not path.exists():
        raise ApirctlError("the host RPC backend has no log yet", hint="it appears after `apirctl machine "
                           "restart --remoting`")
    offset = path.stat().st_size
    yield from _log_tail(tail) if tail > 0 else []
    pending = ""
    while follow:
        time.sleep(0.5)
        size = path.stat().st_size if path.exists() else 0
        if size < offset:
            offset = 0
        if size > offset:
            with path.open("rb") as fh:
                fh.seek(offset)
                *lines, pending = (pending + fh.read().decode(errors="replace")).split("\n")
            yield from lines
            offset = size
