"""The libpod REST calls of apirctl's container operations, on the standard library.

Why: `serve` is measured against `podman run` (benchmarks/serve_ready.py), and importing
podman-py (with requests and urllib3) is a tenth of a second of every serve. Its hot path only
needs exists, create, start and inspect, so those (and listing, stop and removal) speak HTTP/1.1 to
the Podman service directly with `http.client`; logs and pulls stay on podman-py. Both sit behind
one seam, `apirctl.podman.containers.PodmanApi`. The create body is what podman-py renders for the
same `ContainerSpec` (tests/podman/test_libpod.py compares the two).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from apirctl.errors import ApirctlError

if TYPE_CHECKING:
    from apirctl.podman.containers import ContainerSpec

API = "/v4.0.0/libpod"  # the oldest libpod API apirctl supports (Podman 4); newer services accept it
TIMEOUT = 120.0
SERVICE_STOPPED = ("the Podman service stopped: start it again (or unset CONTAINER_HOST, and apirctl runs a "
                   "service of its own); `apirctl doctor` checks")


class LibpodError(Exception):
    """A refusal of the Podman service: its HTTP status and its `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ServiceGone(ApirctlError):
    """Nothing answers at the service's address (its socket is gone or refuses), or it went away
    during a question: the request may be sent again once a service answers there."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("d", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def supported(url: str) -> bool:
    """True for the service URLs spoken here (unix:// and tcp://); ssh:// stays on podman-py."""
    return url.startswith(("unix://", "tcp://", "http://"))


_connections: dict[str, http.client.HTTPConnection] = {}


def _connection(url: str) -> http.client.HTTPConnection:
    """One keep-alive connection per service URL and process."""
    conn = _connections.get(url)
    if conn is None:
        if url.startswith("unix://"):
            conn = _UnixConnection(url[len("unix://"):], TIMEOUT)
        else:
            host, _, port = url.split("://", 1)[1].split("/", 1)[0].rpartition(":")
            conn = http.client.HTTPConnection(host or "127.0.0.1", int(port or 80), timeout=TIMEOUT)
        _connections[url] = conn
    return conn


def _discard(url: str) -> None:
    """Forget a connection whose state is unknown (closing alone keeps what was half-written to it)."""
    conn = _connections.pop(url, None)
    if conn is not None:
        conn.close()


def request(url: str, method: str, path: str, body: Any = None, timeout: float = TIMEOUT) -> tuple[int, Any]:
    """One API call: (status, decoded JSON or None). Retries once on a connection the service closed or
    an interrupted call left half-used."""
    payload = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if payload is not None else {}
    resent = False  # a change sent again after its connection closed: the first may have taken effect
    for attempt in (1, 2):
        conn = _connection(url)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            conn.request(method, API + path, body=payload, headers=headers)
            response = conn.getresponse()
            data = response.read()
            break
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
            conn.close()
            resent = method != "GET"
            if attempt == 2:  # not a keep-alive connection it had closed: the service went away mid-call
                # a question (GET) may be asked again of a new service; a change's outcome is unknown
                lost = ServiceGone if method == "GET" else ApirctlError
                raise lost(f"the Podman API at {url} went away during the call ({exc})",
                           hint=SERVICE_STOPPED) from exc
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            conn.close()
            raise ServiceGone(f"the Podman API at {url} is gone ({exc.strerror or exc})",
                              hint=SERVICE_STOPPED) from exc
        except OSError as exc:
            conn.close()
            raise ApirctlError(f"the Podman API at {url} did not answer ({exc})") from exc
        except http.client.ImproperConnectionState as exc:
            # left half-used by a call that was interrupted: a fresh connection asks again
            _discard(url)
            if attempt == 2:
                raise ApirctlError(f"the Podman API at {url} did not answer ({type(exc).__name__})") from exc
        except BaseException:
            # interrupted mid-call (Ctrl-C): the reply may still come on this connection, so no later
            # call may use it (every one would fail with "Request-sent", the removal of a container too)
            _discard(url)
            raise
    decoded = None
    if data:
        try:
            decoded = json.loads(data)
        except ValueError:
            decoded = data.decode(errors="replace")
    if response.status >= 400:
        message = decoded.get("message") if isinstance(decoded, dict) else str(decoded or "")
        if resent and (response.status == 409 or "already in use" in str(message)):  # what the first send made
            raise ApirctlError(f"the Podman API at {url} went away during the call, and the call sent again "
                               f"conflicts with what the first made ({message or response.reason})",
                               hint=SERVICE_STOPPED)
        raise LibpodError(response.status, str(message or response.reason))
    return response.status, decoded


def exists(url: str, kind: str, name: str) -> bool:
    """Whether a container or image (`kind`: "containers" or "images") of that name or id exists."""
    try:
        status, _ = request(url, "GET", f"/{kind}/{quote(name, safe='/:@')}/exists")
    except LibpodError as exc:
        if exc.status == 404:
            return False
        raise
    return status == 204


def create_body(spec: ContainerSpec) -> dict[str, Any]:
    """The libpod SpecGenerator for `spec`, as podman-py renders `spec.create_kwargs()`."""
    body: dict[str, Any] = {
        "image": spec.image,
        "command": spec.command,
        "labels": spec.labels,
        "env": spec.environment,
        "mounts": [
            {"destination": m.target, "options": ["ro"] if m.read_only else [], "source": str(m.source),
             "type": "bind"}
            for m in spec.mounts
        ],
        "devices": [{"path": device} for device in spec.devices],
        "portmappings": [
            {"container_port": int(port), "protocol": "tcp", "host_ip": host_ip, "host_port": int(host_port)}
            for port, (host_ip, host_port) in spec.ports.items()
        ],
    }
    if spec.entrypoint is not None:
        body["entrypoint"] = spec.entrypoint
    if spec.name:
        body["name"] = spec.name
    if spec.network_mode:
        kind, _, value = spec.network_mode.partition(":")
        body["netns"] = {"nsmode": "path", "value": value} if kind == "ns" and value else {"nsmode": spec.network_mode}
    if spec.network_options:
        body["network_options"] = spec.network_options
    if spec.security_opt:  # the libpod API takes SELinux options without the CLI's "label=" prefix
        body["selinux_opts"] = [opt.removeprefix("label=") for opt in spec.security_opt]
    restart = spec.restart()
    if restart:
        body["restart_policy"] = restart[0]
        if restart[1]:
            body["restart_tries"] = restart[1]
    if spec.healthcheck:
        body["healthconfig"] = spec.healthcheck.config()
    if spec.mem_limit:
        body["resource_limits"] = {"memory": {"limit": spec.mem_limit}}
    return {key: value for key, value in body.items() if value not in ([], {})}  # podman-py drops empties too


def create(url: str, spec: ContainerSpec) -> str:
    """Create (not start) the container; returns its id."""
    _, answer = request(url, "POST", "/containers/create", create_body(spec))
    return str(answer["Id"])


def start(url: str, container_id: str) -> None:
    request(url, "POST", f"/containers/{container_id}/start")


EXIT_RACE_SECONDS = 2.0


def inspect(url: str, container_id: str) -> dict[str, Any]:
    """A container's inspect data. Podman reads the container's /proc entries to answer, and fails with
    "no such process" when the process exits during the read; asked again, it reports the exit."""
    deadline = time.monotonic() + EXIT_RACE_SECONDS
    while True:
        try:
            _, answer = request(url, "GET", f"/containers/{container_id}/json")
            return dict(answer)
        except LibpodError as exc:
            if "no such process" not in exc.message or time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def list_containers(url: str, label: str, all_: bool = False) -> list[dict[str, Any]]:
    """Containers carrying `label` (a key, or KEY=VALUE), in libpod's list shape (Id, Names, State...)."""
    query = f"all={'true' if all_ else 'false'}&filters={quote(json.dumps({'label': [label]}))}"
    _, answer = request(url, "GET", f"/containers/json?{query}")
    return list(answer or [])


def stop(url: str, container_id: str, timeout: int) -> None:
    """Stop a container (SIGTERM, then SIGKILL after `timeout` seconds); one already stopped is fine."""
    with contextlib.suppress(LibpodError):  # 304: not running; 404: gone; both leave nothing to stop
        request(url, "POST", f"/containers/{container_id}/stop?timeout={int(timeout)}", timeout=timeout + TIMEOUT)


def delete(url: str, container_id: str) -> None:
    """Remove a container (forcibly, with its anonymous volumes); raises LibpodError but for 404."""
    try:
        request(url, "DELETE", f"/containers/{container_id}?force=true&v=true")
    except LibpodError as exc:
        if exc.status != 404:
            raise
