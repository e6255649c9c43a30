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
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from apirctl import host
from apirctl.errors import MISSING, ApirctlError, tail
from apirctl.paths import dirs, ensure, exclusive

if TYPE_CHECKING:
    from podman import PodmanClient

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
    if host.is_macos():
        return "install it with `brew install podman`, then `podman machine init`"
    return (
        "install it with your package manager: `sudo apt-get install podman runc` (Debian, Ubuntu) "
        "or `sudo dnf install podman` (Fedora)"
    )


def podman_binary() -> str:
    """The podman executable, or a one-line error saying how to install it."""
    found = shutil.which("podman")
    if not found:
        raise ApirctlError("podman is not installed", exit_code=MISSING, hint=install_hint())
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
    if host.is_macos():  # containers run in the podman machine, not here
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
                    f"default_ulimits = [] (podman said: {tail(output, default='(no output)')})",
                )
            conf = write_restricted_conf()
            ok2, output2 = probe_runtime(conf)
            if not ok2:
                raise ApirctlError(
                    f"containers cannot start on this host: {tail(output2, default='(no output)')}",
                    hint="run `apirctl doctor` for the checks and their fixes",
                )
            decision = RuntimeDecision(
                restricted=True,
                conf=str(conf),
                reason=f"default settings fail here ({tail(output, default='(no output)')}); "
                "using runtime runc and default_ulimits = []",
            )
        else:
            raise ApirctlError(
                f"podman cannot start a container: {tail(output, default='(no output)')}",
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
        if not host.os_is_macos():
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
    raise ApirctlError(f"`podman system service` did not start: {tail(log_path, default='(no output)')}",
                       hint=f"full log: {log_path}")


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
    if host.is_macos():
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


def _service_lock() -> contextlib.AbstractContextManager[None]:
    """Two apirctl processes in one home start one Podman service, not two."""
    return exclusive(ensure(dirs().state) / "podman-service.lock")


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


def restart_own_service() -> bool:
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


def revive(url: str) -> bool:
    """Start apirctl's own Podman service again if it is the one at `url` and has died under a
    command (killed, or idled out while a model loaded); True when it answers there again.
    Containers run on without the service, so the command can go on."""
    if url != _socket_url(service_socket_path()):  # its record names no live process once it died
        return False
    with _service_lock():
        if not answers(url):
            _clients.clear()
            start_service()
    return True


def api_error_message(exc: Exception) -> str:
    """The useful line of a podman-py APIError (its `explanation`), else the exception text."""
    text = getattr(exc, "explanation", None) or str(exc)
    return tail(str(text), default=type(exc).__name__)
