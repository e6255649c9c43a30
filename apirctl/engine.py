"""The Podman connection: one place that finds (or starts) the Podman API and runs containers.

Everything that talks to Podman goes through here, so socket discovery, the restricted-host
`containers.conf` fix and the one-line errors live in one module. The order of discovery is
`CONTAINER_HOST`, then on macOS the podman machine's socket, on Linux the rootful and rootless
default sockets, then a `podman system service` that apirctl starts itself on a socket under
its state directory (recorded, so `stop_service` stops only what apirctl started).

Restricted hosts (containers inside containers, CI sandboxes) refuse the default
`nofile` ulimit or crun's cgroup setup. apirctl probes once with a tiny container made of the
host's own `true` binary and, when the probe fails with those signatures but passes with a
`containers.conf` of `runtime = "runc"` and `default_ulimits = []`, keeps using that file
(through `CONTAINERS_CONF`) for the service it starts and for podman commands it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError
from apirctl.paths import dirs, ensure

if TYPE_CHECKING:
    from podman import PodmanClient
    from podman.domain.containers import Container

MIN_PODMAN = (4, 0)
# Our own service exits after this many idle seconds; the next apirctl call starts it again
# (about a second), so an abandoned APIRCTL_HOME never leaves a process behind for long.
SERVICE_IDLE_SECONDS = 600
SERVICE_START_TIMEOUT = 30.0
_UNIX_PATH_MAX = 100  # sun_path is 108 bytes; keep a margin

RESTRICTED_CONF = """\
# Written by apirctl: this host refuses the default ulimits (setrlimit) or crun's cgroup setup.
# apirctl selects this file with CONTAINERS_CONF for the podman it runs; delete it to re-probe.
[engine]
runtime = "runc"

[containers]
default_ulimits = []
"""
# Output of a container start refused by a restricted host (ulimits or cgroups).
_RESTRICTED = re.compile(
    r"setting rlimit|setrlimit|rlimit type|cgroup.*(permission denied|read-only|operation not permitted)"
    r"|crun: .*(cgroup|permission)|OCI permission denied",
    re.IGNORECASE,
)


def install_hint() -> str:
    """How to get podman on this host, for the one-line error."""
    if on_macos():
        return "install it with `brew install podman`, then `podman machine init`"
    return (
        "install it with your package manager: `sudo apt-get install podman runc` (Debian, Ubuntu) "
        "or `sudo dnf install podman` (Fedora)"
    )


def on_macos() -> bool:
    """True on macOS, where containers run in the podman machine; `APIRCTL_PLATFORM` overrides
    it like `apirctl.machine.platform()` (tests drive the macOS path on Linux with fakes)."""
    chosen = os.environ.get("APIRCTL_PLATFORM", "").strip().lower()
    return chosen in ("macos", "darwin") if chosen else sys.platform == "darwin"


# --- the podman binary -------------------------------------------------------------------------


def podman_binary() -> str:
    """The podman executable, or a one-line error saying how to install it."""
    found = shutil.which("podman")
    if not found:
        raise ApirctlError("podman is not installed", exit_code=127, hint=install_hint())
    return found


@lru_cache(maxsize=4)
def _version_of(binary: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ApirctlError(f"cannot run {binary} --version: {exc}", hint=install_hint()) from exc
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    if not match:
        raise ApirctlError(f"cannot read the podman version from {out.strip()!r}", hint=install_hint())
    return tuple(int(part) for part in match.groups(default="0"))


def podman_version() -> tuple[int, ...]:
    """The installed podman's version, checked against `MIN_PODMAN`."""
    version = _version_of(podman_binary())
    if version < MIN_PODMAN:
        want = ".".join(map(str, MIN_PODMAN))
        have = ".".join(map(str, version))
        raise ApirctlError(f"podman {have} is too old (apirctl needs {want} or newer)", hint=install_hint())
    return version


# --- the restricted-host containers.conf -------------------------------------------------------


class RuntimeDecision(BaseModel):
    """Whether podman here needs apirctl's containers.conf, and why (shown by doctor)."""

    restricted: bool
    reason: str
    conf: str | None = None


def _decision_file() -> Path:
    return dirs().state / "engine.json"


def restricted_conf_path() -> Path:
    return dirs().state / "containers.conf"


def write_restricted_conf() -> Path:
    """Write apirctl's containers.conf (runtime runc, no default ulimits) and return its path."""
    path = restricted_conf_path()
    ensure(path.parent)
    path.write_text(RESTRICTED_CONF)
    return path


def is_restricted_failure(text: str) -> bool:
    """Does this container-start error come from a host that refuses ulimits or cgroups?"""
    return bool(_RESTRICTED.search(text))


def _probe_rootfs(root: Path) -> str:
    """Fill `root` with the host's `true` and the libraries it loads; return its path inside."""
    true = shutil.which("true") or "/bin/true"
    files = [Path(true)]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["ldd", true], capture_output=True, text=True, timeout=30).stdout
        files += [Path(p) for p in re.findall(r"(/\S+)", out) if Path(p).is_file()]
    for src in files:
        dest = root / src.relative_to("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.resolve(), dest)
    return true


def probe_runtime(conf: Path | None) -> tuple[bool, str]:
    """Start one throw-away container with the podman CLI; return (it worked, podman's output).

    The container is a root filesystem holding only the host's `true`, so no image is needed.
    """
    env = dict(os.environ)
    if conf is not None:
        env["CONTAINERS_CONF"] = str(conf)
    with tempfile.TemporaryDirectory(prefix="apirctl-probe-") as tmp:
        true = _probe_rootfs(Path(tmp))
        cmd = [podman_binary(), "run", "--rm", "--network", "none", "--rootfs", tmp, true]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            return False, "the probe container did not finish in 120 s"
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def runtime_decision(refresh: bool = False) -> RuntimeDecision:
    """Decide once per apirctl home whether podman needs the restricted containers.conf.

    A user's own `CONTAINERS_CONF` always wins and is never probed or overridden.
    """
    if os.environ.get("CONTAINERS_CONF"):
        return RuntimeDecision(restricted=False, reason="CONTAINERS_CONF is set by the user")
    path = _decision_file()
    if not refresh and path.exists():
        with contextlib.suppress(ValueError, OSError):
            decision = RuntimeDecision.model_validate_json(path.read_text())
            if not decision.restricted or (decision.conf and Path(decision.conf).exists()):
                return decision
    if on_macos():  # containers run in the podman machine, not here
        decision = RuntimeDecision(restricted=False, reason="macOS: containers run in the podman machine")
    else:
        ok, output = probe_runtime(None)
        if ok:
            decision = RuntimeDecision(restricted=False, reason="containers start with the default settings")
        elif is_restricted_failure(output):
            if not shutil.which("runc"):
                raise ApirctlError(
                    "containers cannot start with the default settings and runc is not installed",
                    hint="install runc (`sudo apt-get install runc`); apirctl then uses it with "
                    f"default_ulimits = [] (podman said: {_last_line(output)})",
                )
            conf = write_restricted_conf()
            ok2, output2 = probe_runtime(conf)
            if not ok2:
                raise ApirctlError(
                    f"containers cannot start on this host: {_last_line(output2)}",
                    hint="run `apirctl doctor` for the checks and their fixes",
                )
            decision = RuntimeDecision(
                restricted=True,
                conf=str(conf),
                reason=f"default settings fail here ({_last_line(output)}); "
                "using runtime runc and default_ulimits = []",
            )
        else:
            raise ApirctlError(
                f"podman cannot start a container: {_last_line(output)}",
                hint="run `apirctl doctor` for the checks and their fixes",
            )
    ensure(path.parent)
    path.write_text(decision.model_dump_json())
    return decision


def podman_env() -> dict[str, str]:
    """Environment for podman commands apirctl runs (adds CONTAINERS_CONF on restricted hosts)."""
    env = dict(os.environ)
    decision = runtime_decision()
    if decision.restricted and decision.conf:
        env["CONTAINERS_CONF"] = decision.conf
    return env


def podman_cli(*args: str) -> list[str]:
    """A podman command line (run it with `env=podman_env()`), for what podman-py lacks: build."""
    podman_version()
    return [podman_binary(), *args]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# --- finding the API socket --------------------------------------------------------------------


class Endpoint(BaseModel):
    """A Podman API address and how apirctl found it."""

    url: str
    source: str  # CONTAINER_HOST, machine, rootful, rootless, apirctl service
    started_by_apirctl: bool = False


class ServiceRecord(BaseModel):
    """The `podman system service` apirctl started: enough to find it again and stop it."""

    pid: int
    url: str
    socket: str
    containers_conf: str | None = None
    started: float = Field(default_factory=time.time)


def _socket_url(path: Path | str) -> str:
    return f"unix://{path}"


def answers(url: str, timeout: float = 3.0) -> bool:
    """True when a Podman API answers `_ping` at `url` (unix:// or tcp://; others are trusted).

    A bare HTTP/1.0 request on a socket: this runs on every command, and an HTTP client costs
    more to set up than the ping itself.
    """
    if url.startswith("unix://"):
        path = url[len("unix://") :]
        if not Path(path).exists():
            return False
        family, address = socket.AF_UNIX, path
    elif url.startswith(("tcp://", "http://")):
        host, _, port = url.split("://", 1)[1].split("/", 1)[0].rpartition(":")
        family, address = socket.AF_INET, (host or "127.0.0.1", int(port or 80))  # type: ignore[assignment]
    else:  # ssh:// and others: podman-py connects itself
        return True
    try:
        with socket.socket(family, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(address)
            conn.sendall(b"GET /_ping HTTP/1.0\r\nHost: d\r\n\r\n")
            head = conn.recv(64)
    except (OSError, ValueError):
        return False
    return head.startswith(b"HTTP/1.") and head[9:12] == b"200"


def machine_socket(name: str | None = None) -> str | None:
    """macOS: the API socket of the podman machine, from `podman machine inspect`."""
    cmd = [podman_binary(), "machine", "inspect"] + ([name] if name else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        data = json.loads(done.stdout or "null")
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    if not data:
        return None
    info = data[0] if isinstance(data, list) else data
    path = ((info.get("ConnectionInfo") or {}).get("PodmanSocket") or {}).get("Path")
    return _socket_url(path) if path else None


def default_sockets() -> list[Endpoint]:
    """The system's own sockets, in the order podman's tools try them."""
    found: list[Endpoint] = []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        found.append(Endpoint(url=_socket_url("/run/podman/podman.sock"), source="rootful"))
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or (f"/run/user/{os.getuid()}" if hasattr(os, "getuid") else "")
    if runtime_dir:
        found.append(Endpoint(url=_socket_url(Path(runtime_dir) / "podman" / "podman.sock"), source="rootless"))
    return found


def _service_record_file() -> Path:
    return dirs().state / "podman-service.json"


def service_socket_path() -> Path:
    """Where apirctl's own service listens: under the state dir, or a short temp path if too long."""
    path = dirs().state / "podman" / "podman.sock"
    if len(str(path)) <= _UNIX_PATH_MAX:
        return path
    digest = hashlib.sha256(str(dirs().state).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"apirctl-{os.getuid()}-{digest}" / "podman.sock"


def service_record() -> ServiceRecord | None:
    """The service apirctl started, if its process is still alive."""
    path = _service_record_file()
    try:
        record = ServiceRecord.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None
    return record if _is_our_service(record) else None


def _is_our_service(record: ServiceRecord) -> bool:
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        if sys.platform == "linux":
            return False
        try:
            os.kill(record.pid, 0)
        except OSError:
            return False
        return True
    return b"service" in cmdline and record.url.encode() in cmdline


def start_service() -> Endpoint:
    """Start `podman system service` on apirctl's socket and wait until it answers."""
    binary = podman_binary()
    podman_version()
    env = podman_env()
    sock = service_socket_path()
    ensure(sock.parent)
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    url = _socket_url(sock)
    log_path = ensure(dirs().logs) / "podman-service.log"
    cmd = [binary, "system", "service", f"--time={SERVICE_IDLE_SECONDS}", url]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
        )
    record = ServiceRecord(pid=proc.pid, url=url, socket=str(sock), containers_conf=env.get("CONTAINERS_CONF"))
    deadline = time.monotonic() + SERVICE_START_TIMEOUT
    while time.monotonic() < deadline:
        if answers(url, timeout=1.0):
            _service_record_file().write_text(record.model_dump_json())
            return Endpoint(url=url, source="apirctl service", started_by_apirctl=True)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        proc.terminate()
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    raise ApirctlError(f"`podman system service` did not start: {tail[0]}", hint=f"full log: {log_path}")


def stop_service() -> bool:
    """Stop the service apirctl started (never one it found); True if one was stopped."""
    record = service_record()
    _service_record_file().unlink(missing_ok=True)
    if record is None:
        return False
    with contextlib.suppress(OSError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _is_our_service(record):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(record.pid, os.WNOHANG)
        time.sleep(0.05)
    with contextlib.suppress(FileNotFoundError):
        Path(record.socket).unlink()
    return True


def discover(start: bool = True) -> Endpoint:
    """Find a Podman API that answers; on Linux start apirctl's own service when none does.

    On a restricted host the system sockets are skipped: a service started by systemd reads
    the system containers.conf and could not start our containers, while ours reads the fix.
    """
    explicit = os.environ.get("CONTAINER_HOST")
    if explicit:
        if not answers(explicit):
            raise ApirctlError(
                f"CONTAINER_HOST={explicit} does not answer",
                hint="start the service it names, or unset CONTAINER_HOST to let apirctl find one",
            )
        return Endpoint(url=explicit, source="CONTAINER_HOST")
    if on_macos():
        podman_version()
        url = machine_socket()
        if url and answers(url):
            return Endpoint(url=url, source="machine")
        raise ApirctlError(
            "the podman machine is not running", hint="start it with `apirctl machine restart --remoting`"
        )
    record = service_record()
    if record and answers(record.url):
        return Endpoint(url=record.url, source="apirctl service", started_by_apirctl=True)
    if not runtime_decision().restricted:
        for endpoint in default_sockets():
            if answers(endpoint.url):
                return endpoint
    if not start:
        raise ApirctlError("no Podman API answers", hint="run any apirctl command that needs podman to start one")
    with _service_lock():  # two apirctl processes in one home start one service, not two
        record = service_record()
        if record and answers(record.url):
            return Endpoint(url=record.url, source="apirctl service", started_by_apirctl=True)
        return start_service()


@contextlib.contextmanager
def _service_lock() -> Iterator[None]:
    import fcntl

    path = ensure(dirs().state) / "podman-service.lock"
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# One client per process and environment: discovery pings sockets, which serve's hot path must
# not repeat for every call. Entries are re-checked after a while, as our service may idle out.
_clients: dict[tuple[str, ...], tuple[PodmanClient, str, float]] = {}
_CLIENT_TTL = 30.0


def _client_key() -> tuple[str, ...]:
    names = ("CONTAINER_HOST", "XDG_RUNTIME_DIR", "CONTAINERS_CONF", "APIRCTL_HOME")
    return (*(os.environ.get(name, "") for name in names), str(dirs().state))


def client() -> PodmanClient:
    """A podman-py client on the discovered API (discovered once per process and environment)."""
    from podman import PodmanClient

    key = _client_key()
    cached = _clients.get(key)
    if cached and time.monotonic() - cached[2] < _CLIENT_TTL:
        return cached[0]
    url = discover().url
    made = cached[0] if cached and cached[1] == url else PodmanClient(base_url=url, timeout=600)
    _clients[key] = (made, url, time.monotonic())
    return made


# --- containers --------------------------------------------------------------------------------


class BindMount(BaseModel):
    source: Path
    target: str
    read_only: bool = True


class ContainerSpec(BaseModel):
    """What apirctl asks Podman for; `transport.Plan.apply` and `serve` fill it in."""

    image: str
    command: list[str] = Field(default_factory=list)
    entrypoint: list[str] | None = None
    name: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    environment: dict[str, str] = Field(default_factory=dict)
    mounts: list[BindMount] = Field(default_factory=list)
    devices: list[str] = Field(default_factory=list)
    ports: dict[int, tuple[str, int]] = Field(default_factory=dict)  # container port -> (host ip, port)
    network_mode: str | None = None
    network_options: dict[str, list[str]] = Field(default_factory=dict)
    security_opt: list[str] = Field(default_factory=list)

    def create_kwargs(self) -> dict[str, Any]:
        """The podman-py `containers.create` arguments for this spec."""
        kwargs: dict[str, Any] = {
            "image": self.image,
            "command": self.command,
            "labels": self.labels,
            "environment": self.environment,
            "mounts": [
                {"type": "bind", "source": str(m.source), "target": m.target, "read_only": m.read_only}
                for m in self.mounts
            ],
            "devices": self.devices,
            "ports": {f"{port}/tcp": host for port, host in self.ports.items()},
            "detach": True,
        }
        if self.entrypoint is not None:
            kwargs["entrypoint"] = self.entrypoint
        if self.name:
            kwargs["name"] = self.name
        if self.network_mode:
            kwargs["network_mode"] = self.network_mode
        if self.network_options:
            kwargs["network_options"] = self.network_options
        if self.security_opt:
            # the libpod API takes SELinux options without the CLI's "label=" prefix
            kwargs["security_opt"] = [opt.removeprefix("label=") for opt in self.security_opt]
        return kwargs


def api_error_message(exc: Exception) -> str:
    """The useful line of a podman-py APIError (its `explanation`), else the exception text."""
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text).strip().splitlines()[-1] if str(text).strip() else type(exc).__name__


def start_failure(exc: Exception, what: str) -> ApirctlError:
    """Turn a refused container start into a one-line error, explaining restricted hosts."""
    message = api_error_message(exc)
    if is_restricted_failure(message):
        return ApirctlError(
            f"{what}: the host refused the container's ulimits or cgroups ({message})",
            hint="this host needs runtime runc and default_ulimits = []: unset CONTAINER_HOST so apirctl "
            "runs its own podman service with that containers.conf, or see `apirctl doctor`",
        )
    return ApirctlError(f"{what}: {message}")


def create(spec: ContainerSpec) -> Container:
    """Create (not start) a container from the spec, with one-line errors for Podman's refusals."""
    from podman.errors import APIError, ImageNotFound

    def missing(exc: Exception) -> ApirctlError:
        local = spec.image.startswith("localhost/")
        hint = "run `apirctl setup` to build it" if local else f"pull it with `podman pull {spec.image}`"
        return ApirctlError(f"image {spec.image} not found", hint=hint)

    try:
        return client().containers.create(**spec.create_kwargs())
    except ImageNotFound as exc:
        raise missing(exc) from exc
    except APIError as exc:
        if re.search(r"image not known|no such image", api_error_message(exc), re.IGNORECASE):
            raise missing(exc) from exc
        raise start_failure(exc, "podman refused to create the container") from exc


def image_exists(ref: str) -> bool:
    from podman.errors import APIError

    try:
        return bool(client().images.exists(ref))
    except APIError:
        return False


# Podman's pull errors that mean "this registry speaks plain HTTP (or TLS we cannot verify)":
# registries.conf's `insecure = true` for that registry is the fix.
_NOT_TLS = re.compile(
    r"server gave HTTP response to HTTPS client|does not look like a TLS handshake|x509: |tls: ", re.IGNORECASE
)
_AUTH = re.compile(r"unauthorized|authentication required|requested access to the resource is denied", re.IGNORECASE)
_UNREACHABLE = re.compile(
    r"connection refused|no such host|i/o timeout|network is unreachable|no route to host|connection reset",
    re.IGNORECASE,
)


def registry_of(ref: str) -> str:
    """The registry host of an image reference (`docker.io` when the reference names none)."""
    first, sep, _ = ref.partition("/")
    return first if sep and ("." in first or ":" in first or first == "localhost") else "docker.io"


def pull_failure(ref: str, error: str) -> ApirctlError:
    """Podman's pull error as one line naming the image, with what to do about it."""
    reason = " ".join(error.split())
    reason = re.sub(r"^initializing source \S+: ", "", reason)  # podman repeats the reference
    host = registry_of(ref)
    if re.search(r"manifest unknown", reason, re.IGNORECASE):
        repo = ref.split("@", 1)[0]
        if ":" in repo.rsplit("/", 1)[-1]:
            repo = repo.rsplit(":", 1)[0]
        return ApirctlError(f"cannot pull {ref}: the registry has no such tag or digest (manifest unknown)",
                            hint=f"check the tag: `podman search --list-tags {repo}` lists them")
    if re.search(r"name unknown|repository name not known", reason, re.IGNORECASE):
        return ApirctlError(f"cannot pull {ref}: the registry has no such repository (name unknown)")
    if _AUTH.search(reason):
        return ApirctlError(f"cannot pull {ref}: {reason}", hint=f"log in first: `podman login {host}`")
    if _NOT_TLS.search(reason):
        return ApirctlError(
            f"cannot pull {ref}: {host} does not speak verifiable HTTPS ({reason.rsplit(': ', 1)[-1]})",
            hint=f'for a plain-HTTP or self-signed private registry add `[[registry]] location = "{host}" '
            "insecure = true` to the registries.conf the Podman service reads (/etc/containers/, "
            "~/.config/containers/ rootless, or $CONTAINERS_REGISTRIES_CONF; in the podman machine on macOS)",
        )
    if _UNREACHABLE.search(reason):
        return ApirctlError(f"cannot pull {ref}: the registry {host} does not answer "
                            f"({reason.rsplit(': ', 1)[-1]})",
                            hint="check the registry address and that it is up and reachable from the Podman service")
    return ApirctlError(f"cannot pull {ref}: {reason}")


def _pull_once(ref: str, on_status: Callable[[str], None] | None) -> str | None:
    """One pull through the Podman service; None when it worked, else Podman's error text."""
    from podman.errors import APIError

    try:
        # tls_verify=None leaves tlsVerify out of the request (requests drops None parameters):
        # podman-py's default, an explicit tlsVerify=true, overrides a registries.conf entry's
        # `insecure = true`, so a private plain-HTTP registry could never be pulled from.
        # compatMode=False asks every Podman version for libpod's own stream: {"stream": line}...,
        # then {"id": ...} or {"error": ...}.
        stream: Any = client().images.pull(ref, stream=True, decode=True, tls_verify=None, compatMode=False)
        for line in stream:
            if not isinstance(line, dict):
                continue
            if line.get("error"):
                return str(line["error"])
            status = str(line.get("stream") or line.get("status") or "").strip()
            if on_status and status:
                on_status(status)
    except APIError as exc:
        return api_error_message(exc)
    return None


def _restart_own_service() -> bool:
    """Restart the Podman service apirctl started, if that is the one in use; True if it was.

    Podman reads registries.conf once per service process, so an entry added after our service
    started is ignored until it restarts. Containers run on without the API service.
    """
    record = service_record()
    explicit = os.environ.get("CONTAINER_HOST")
    if record is None or (explicit and explicit != record.url):
        return False
    with _service_lock():
        stop_service()
        _clients.clear()
        start_service()
    return True


def pull(ref: str, on_status: Callable[[str], None] | None = None) -> None:
    """Pull a remote image through the Podman service, reporting Podman's progress lines.

    TLS follows the registries.conf of the service, as `podman pull` does. When a registry is
    refused for speaking plain HTTP and the service is apirctl's own, it is restarted once (it may
    predate the registries.conf entry that allows it) and the pull is tried again.
    """
    error = _pull_once(ref, on_status)
    if error is not None and _NOT_TLS.search(error) and _restart_own_service():
        if on_status:
            on_status("restarted apirctl's Podman service to read registries.conf again")
        error = _pull_once(ref, on_status)
    if error is not None:
        raise pull_failure(ref, error)


def container_logs(container: Container, tail: int | None = None) -> str:
    """A container's stdout and stderr, interleaved, as text."""
    kwargs: dict[str, Any] = {"stdout": True, "stderr": True}
    if tail is not None:
        kwargs["tail"] = tail
    data = container.logs(**kwargs)
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return b"".join(data).decode(errors="replace")


def follow_logs(container: Container, tail: int | None = None, since: int | None = None) -> Iterator[str]:
    """Stream a container's log lines as they come (until it stops or the caller stops reading).

    `since` (Unix seconds) starts at a moment rather than a line count, so nothing written
    between that moment and the start of the stream is lost.
    """
    kwargs: dict[str, Any] = {"stdout": True, "stderr": True, "stream": True, "follow": True}
    if tail is not None:
        kwargs["tail"] = tail
    if since is not None:
        kwargs["since"] = since
    pending = b""
    for chunk in container.logs(**kwargs):
        pending += chunk if isinstance(chunk, bytes) else str(chunk).encode()
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode(errors="replace")
    if pending:
        yield pending.decode(errors="replace")


def remove(container: Container, timeout: int = 10) -> None:
    """Stop (politely, then by force after `timeout`) and remove a container; absent is fine."""
    from podman.errors import APIError, NotFound

    with contextlib.suppress(NotFound, APIError):
        container.reload()
        if container.status in ("running", "paused", "stopping"):
            container.stop(timeout=timeout)
    with contextlib.suppress(NotFound):
        try:
            container.remove(force=True)
        except APIError as exc:
            raise ApirctlError(f"cannot remove container {container.name}: {api_error_message(exc)}") from exc


class RunResult(BaseModel):
    exit_code: int
    output: str


def run_once(
    spec: ContainerSpec, timeout: float | None = None, on_line: Callable[[str], None] | None = None
) -> RunResult:
    """Run a container to completion and return its exit code and output; it is always removed.

    `on_line` receives output lines as they appear (bench shows llama-bench's progress with it).
    """
    from podman.errors import APIError

    container = create(spec)
    try:
        try:
            container.start()
        except APIError as exc:
            raise start_failure(exc, f"cannot start {spec.image}") from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        shown: list[str] = []
        pump = None
        if on_line is not None:
            # Follow in a thread while this one watches the state: a follow on a container that
            # exits at once can block in some podman versions, and the deadline must hold anyway.
            def follow() -> None:
                for line in follow_logs(container):
                    shown.append(line)
                    on_line(line)

            pump = threading.Thread(target=follow, daemon=True)
            pump.start()
        while True:
            container.reload()
            if container.status not in ("running", "created", "configured", "initialized", "stopping"):
                break
            if deadline is not None and time.monotonic() > deadline:
                output = container_logs(container, tail=20)
                raise ApirctlError(f"{spec.image} did not finish in {timeout:g} s: {_last_line(output)}")
            time.sleep(0.05)
        output = container_logs(container)
        if pump is not None and on_line is not None:
            pump.join(timeout=5)
            if pump.is_alive():  # the follow hung: hand over the lines it did not deliver
                for line in output.splitlines()[len(shown):]:
                    on_line(line)
        code = int(container.attrs.get("State", {}).get("ExitCode", 0))
        return RunResult(exit_code=code, output=output)
    finally:
        remove(container, timeout=2)
