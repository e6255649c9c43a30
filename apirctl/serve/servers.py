"""The inference servers that run: listed from their containers' labels with their health, found
by name, their logs, stopped.

Containers carry the labels Podman AI Lab and Podman Desktop read to list an inference service,
plus apirctl's own, so `ps`, `chat` and `bench` find servers from labels alone (`apirctl.podman.servers`),
and servers started by the upstream extension are found too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from apirctl import vm
from apirctl.errors import ApirctlError
from apirctl.podman import containers
from apirctl.podman import servers as podman_servers
from apirctl.podman.servers import (
    RUNNING,
    Server,
)
from apirctl.remoting import apir_hosts, backends, rpc_server, tunnel

if TYPE_CHECKING:
    pass


STOP_TIMEOUT = 10


# --- listing -----------------------------------------------------------------------------------


def health(base: str, timeout: float = 1.0) -> str:
    """llama-server's /health: ok, loading (503 while the model loads), error, or unreachable.

    The standard library's http.client, not httpx: serve polls this every 20 ms right after its
    own start, where importing httpx alone would cost more than the poll interval several times.
    """
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", f"{parts.path.rstrip('/')}/health")
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return "unreachable"
    finally:
        conn.close()
    if status == 200:
        return "ok"
    if status == 503:
        return "loading"
    return "error"


def router_models(base: str, timeout: float = 3.0) -> dict[str, str]:
    """A router server's models and the state of each (loaded, loading, unloaded, sleeping), from its
    GET /models, which loads nothing and wakes no model; {} when it does not answer as a router does."""
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", f"{parts.path.rstrip('/')}/models")
        response = conn.getresponse()
        data = json.loads(response.read()) if response.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return {}
    finally:
        conn.close()
    found: dict[str, str] = {}
    for entry in (data.get("data") if isinstance(data, dict) else None) or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            status = entry.get("status")
            found[entry["id"]] = str(status.get("value", "?")) if isinstance(status, dict) else "?"
    return found


def _rpc_problem(server: Server) -> str | None:
    """Why an rpc server cannot work now: its SSH tunnel is gone, or (no explicit backends) its
    backend is down or was restarted under it."""
    if server.rpc_backends:
        if server.tunnels:
            alive = {t.pid for t in tunnel.tunnels()}
            if not set(server.tunnels) <= alive:
                return "ssh tunnel down"
        return None

    return rpc_server.backend_problem(server.rpc_instance, server.rpc_link, server.started)


def _own_backends(servers: list[Server]) -> None:
    """Stop the backends of containers that no longer run (a container that died leaves nothing
    behind)."""
    backends.clean(backends.keepers(servers))


def _show_links(servers: list[Server]) -> None:
    """Show which links moved to shared memory (the backend's record knows), a container's or a VM's."""
    for server in servers:
        if server.rpc_link == "unix" and server.rpc_instance:
            instance = backends.get(server.rpc_instance)
            if instance is not None:
                server.rpc_link = instance.link


def list_servers(all: bool = False, probe_health: bool = True) -> list[Server]:  # noqa: A002
    """apirctl's servers (and the upstream extension's), newest first; `all` adds stopped ones.

    With `probe_health`, each running server's /health is asked (and an rpc server's backend or
    tunnel checked: its /health says ok until its next request). Backends of containers that no
    longer run are stopped on the way.
    """
    servers = podman_servers.list_servers(all)
    _own_backends(servers)
    if vm.records():  # micro-VMs (`--isolation vm`): listed from their records, with a container's labels
        servers = sorted(servers + vm.servers(all), key=_created, reverse=True)
    _show_links(servers)
    _own_apir_hosts(servers, all)
    if probe_health:
        for server in servers:
            if server.running:
                server.health = _health_of(server)
                if server.router:
                    server.models = router_models(server.base)
            server.why = _why(server)
    return servers


def _created(server: Server) -> float:
    return server.created.timestamp() if server.created else 0.0


def _why(server: Server) -> str:
    """Why a server does not serve, in one line (`ps --json` has it; `ps` shows it for stopped ones):
    its health problem while it runs; what it exited with, and for rpc what became of its backend."""
    if server.running:
        return "" if server.health in ("ok", "loading") else server.health
    said = f"exited (code {server.exit_code})" if server.exit_code is not None else server.state
    problem = _rpc_problem(server) if server.transport == "rpc" and server.rpc_link == "tcp" else None
    if server.apir_host:  # an exited APIR server: whether its apir-host died, and how
        problem = apir_hosts.problem(server.apir_host)
    if server.isolation == "vm":  # a VM its relay ended, its backend gone (`vm.relay`): the reason it noted
        problem = vm.ended(server.name) or problem
    return f"{said}: {problem}" if problem else said


def _own_apir_hosts(servers: list[Server], listed_all: bool) -> None:
    """Stop the apir-hosts of containers that are gone. A host outlives its container's exit
    (a restart policy starts the container again against it), so exited containers count."""
    if not apir_hosts.hosts():
        return
    existing = servers if listed_all else podman_servers.list_servers(True) + vm.servers(True)
    apir_hosts.clean(apir_hosts.keepers(existing))


def _health_of(server: Server) -> str:
    # 3 s: a server on a starved CPU is slow, not down
    found = health(server.base, timeout=3.0) if server.url else "unreachable"
    if server.transport == "rpc":
        found = _rpc_problem(server) or found
    elif server.apir_host:  # llama-server's /health says ok until its next request reaches the dead host
        found = apir_hosts.problem(server.apir_host) or found
    return found


def find_server(name: str | None = None, all: bool = False) -> Server:  # noqa: A002
    """The server called `name` (name or id prefix); without a name, the only one running."""
    servers = list_servers(all=all or name is not None)
    if name:
        for server in servers:
            if name in (server.name, server.id) or (len(name) >= 6 and server.id.startswith(name)):
                return server
        known = ", ".join(s.name for s in servers) or "none"
        raise ApirctlError(f"no inference server named {name!r} (servers: {known})", hint="see `apirctl ps -a`")
    running = [s for s in servers if s.state in RUNNING]
    if not running:
        raise ApirctlError("no inference server is running", hint="start one with `apirctl serve MODEL`")
    if len(running) > 1:
        names = ", ".join(s.name for s in running)
        raise ApirctlError(f"several inference servers are running ({names})", hint="name one of them")
    return running[0]


# --- logs and stop -----------------------------------------------------------------------------


def logs(
    name: str | None = None, tail: int | None = None, follow: bool = False, since: int | None = None
) -> Iterator[str]:
    """A server's log lines (stopped servers too); with `follow`, until it stops.

    `since` (Unix seconds, with `follow`) starts the stream at a moment instead of a line count.
    """
    server = find_server(name, all=True) if name else find_server(None)
    if server.isolation == "vm":
        yield from vm.logs(server.name, tail_lines=tail, follow=follow)
        if vm.ended(server.name):
            yield f"--- apirctl: the VM was ended: {vm.ended(server.name)}"
        if not follow:
            yield from _vm_backend_lines(server, tail or VM_BACKEND_LINES)
        return
    api = containers.connect()
    if follow:
        yield from api.follow_logs(server.id, tail=tail, since=since)
        return
    yield from api.logs(server.id, tail=tail).splitlines()


#: The lines of a remoting VM's host backend that `logs` adds after the console.
VM_BACKEND_LINES = 20


def _vm_backend_lines(server: Server, lines: int) -> Iterator[str]:
    """A remoting VM's graphs run in its backend on the host: after the console, the last lines of that
    backend's log (its sessions and the relay's notes), under a line naming it."""
    instance = backends.get(server.rpc_instance) if server.rpc_instance else None
    if instance is None:
        return
    with contextlib.suppress(OSError):
        text = Path(instance.log).read_text(errors="replace").splitlines()
        yield f"--- host backend of {server.name}: {backends.BINARY} pid {instance.pid}, {instance.log}"
        yield from text[-lines:]


def stop(name: str | None = None, all: bool = False) -> list[str]:  # noqa: A002
    """Stop and remove servers; returns their names. Without a name, the only server there is."""
    if all:
        targets = [s for s in list_servers(all=True, probe_health=False) if s.managed]
    elif name:
        targets = [find_server(name, all=True)]
    else:
        servers = list_servers(all=True, probe_health=False)
        running = [s for s in servers if s.state in RUNNING]
        if not servers:
            raise ApirctlError("no inference server to stop", hint="`apirctl ps -a` lists them")
        candidates = running if running else servers  # the one running server, else the only one left
        if len(candidates) > 1:
            names = ", ".join(s.name for s in candidates)
            raise ApirctlError(f"several inference servers exist ({names})", hint="name one, or use --all")
        targets = candidates[:1]
    stopped = []
    for server in targets:
        with contextlib.suppress(ApirctlError):
            if server.isolation == "vm":
                vm.remove(server.name, timeout=STOP_TIMEOUT)  # QEMU, its folder and console log
            else:
                podman_servers.remove(server, timeout=STOP_TIMEOUT)
            stopped.append(server.name)
        if server.tunnels and server.name in stopped:
            tunnel.close(server.tunnels)
        if server.rpc_instance and server.rpc_link in ("unix", "shm") and server.name in stopped:
            backends.stop(server.rpc_instance)  # the container's own backend, socket and directory
        if server.apir_host and server.name in stopped:
            apir_hosts.stop(server.apir_host)  # its apir-host, socket and directory (the trace stays)
    return stopped
