"""Inference containers: create one, wait until it serves, list, read logs, stop.

A server is a Podman container running llama-server with the model mounted read-only and
its port published on the host's loopback by default (the upstream extension publishes on
every interface; an inference API without a key should not be reachable from the network).
Containers carry the labels Podman AI Lab and Podman Desktop read to list an inference
service, plus apirctl's own, so `ps`, `chat` and `bench` find servers from labels alone, and
servers started by the upstream extension are found too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from apirctl import __version__
from apirctl.errors import ApirctlError

if TYPE_CHECKING:
    from podman.domain.containers import Container

    from apirctl.engine import ContainerSpec
    from apirctl.transport import Plan

CONTAINER_PORT = 8000
MODELS_DIR = "/models"
LOG_TAIL_LINES = 20
STOP_TIMEOUT = 10
DOCS_URL = "https://github.com/ggml-org/llama.cpp/tree/master/tools/server"

# Our labels (the key `apirctl.version` marks a container as ours).
L_VERSION = "apirctl.version"
L_MODEL = "apirctl.model"
L_TRANSPORT = "apirctl.transport"
L_HOST_IP = "apirctl.host-ip"
L_RPC_BACKENDS = "apirctl.rpc-backends"  # --rpc-backend addresses, comma-separated, as given
L_RPC_TARGET = "apirctl.rpc-target"  # the --rpc address(es) llama-server was given, as the container sees them
L_VIA_SSH = "apirctl.via-ssh"
L_TUNNELS = "apirctl.ssh-tunnels"  # pids of the SSH tunnels this server uses (closed by `stop`)
# Labels of the upstream Podman Desktop extension and Podman AI Lab.
L_APIR = "llama-cpp.apir"
L_API = "api"
L_AI_LAB = "ai-lab-inference-server"
L_GPU = "gpu"
L_DOCS = "docs"
L_TRACKING = "trackingId"

GPU_LABELS = {"virtgpu": "llama.cpp API Remoting", "rpc": "llama.cpp RPC remoting", "none": "none (container CPU)"}
_RUNNING = ("running",)
_STARTING = ("created", "configured", "initialized")


class ServeOptions(BaseModel):
    """Everything `apirctl serve` takes; defaults come from `apirctl.config`."""

    model: str
    port: int = 1234
    name: str | None = None
    transport: str = "auto"
    image: str | None = None
    ctx_size: int = 4096
    ngl: int = 999
    threads: int | None = None
    api_key: str | None = None
    host_ip: str = "127.0.0.1"
    keep: bool = False
    timeout: float = 300.0
    rpc_port: int = 50052
    rpc_backends: list[str] = Field(default_factory=list)  # explicit backends; implies transport rpc
    via_ssh: str | None = None  # USER@HOST[:PORT] that tunnels every backend
    insecure_network: bool = False  # allow plain non-loopback backends
    ssh_options: list[str] = Field(default_factory=list)  # extra `ssh -o` options (IdentityFile=...)
    llama_args: list[str] = Field(default_factory=list)


class Server(BaseModel):
    """One inference server as `ps`, `chat` and `bench` see it."""

    name: str
    id: str
    model: str
    transport: str
    url: str  # the OpenAI base URL, .../v1
    state: str  # podman's: running, exited, created...
    health: str  # ok, loading, error, unreachable, or "-" when not running
    port: int | None
    created: datetime | None = None
    image: str = ""
    managed: bool = True  # False for servers of the upstream extension
    rpc_backends: list[str] = Field(default_factory=list)  # explicit --rpc-backend addresses
    tunnels: list[int] = Field(default_factory=list)  # pids of its SSH tunnels
    rpc_target: str = ""  # the --rpc value it runs with (which backend it holds)

    @property
    def base(self) -> str:
        """The server root (without /v1), where /health lives."""
        return self.url.removesuffix("/v1")


class Phase(BaseModel):
    """One step of `start` and how long it took (shown by the CLI, used by the benchmark)."""

    name: str  # model, image, container, loading model
    seconds: float


class Started(BaseModel):
    """What `start` returns: the server, each phase's duration and the transport notice."""

    server: Server
    phases: list[Phase]
    notice: str | None = None


class ServeFailed(ApirctlError):
    """The server did not become ready; `log_tail` holds the container's last lines."""

    def __init__(self, message: str, log_tail: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.log_tail = log_tail


ProgressFn = Callable[[str], None]


# --- options -----------------------------------------------------------------------------------


def options(model: str, **flags: Any) -> ServeOptions:
    """ServeOptions from the effective settings (config file, environment) and the given flags."""
    from apirctl import config

    keys = ("port", "host_ip", "transport", "image", "ctx_size", "ngl", "threads", "rpc_port")
    if flags.get("rpc_backends"):
        if flags.get("transport") not in (None, "rpc"):
            raise ApirctlError(f"--rpc-backend uses the rpc transport, not --transport {flags['transport']}")
        flags = {**flags, "transport": "rpc"}
    elif flags.get("via_ssh") or flags.get("insecure_network"):
        raise ApirctlError("--via-ssh and --insecure-network only apply with --rpc-backend HOST:PORT")
    known = {k: v for k, v in flags.items() if k in keys}
    settings = config.load(known).settings
    values: dict[str, Any] = {k: getattr(settings, k) for k in keys}
    values["timeout"] = settings.health_timeout
    values.update({k: v for k, v in flags.items() if k not in keys and v is not None})
    return ServeOptions(model=model, **values)


def _connect_host(host_ip: str) -> str:
    """Where the host reaches a port published on `host_ip` (any-address means loopback)."""
    if host_ip in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host_ip == "::":
        return "::1"
    return host_ip


def _publish_ip(host_ip: str) -> str:
    """The host address to ask Podman for: "" for every IPv4 interface. Netavark before 1.6 (Podman 4)
    turns an explicit 0.0.0.0 into a rule for the literal address 0.0.0.0, which no connection has,
    so `--host-ip 0.0.0.0` published a port nothing could reach."""
    return "" if host_ip == "0.0.0.0" else host_ip


def _url(host_ip: str, port: int) -> str:
    host = _connect_host(host_ip)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def check_port(host_ip: str, port: int) -> None:
    """A clear error for a privileged or busy port, before anything is created."""
    if not 1024 < port < 65536:
        raise ApirctlError(f"port {port} is not allowed: choose one from 1025 to 65535")
    try:
        address = ipaddress.ip_address(host_ip)
    except ValueError:
        raise ApirctlError(f"--host-ip {host_ip!r} is not an IP address (default 127.0.0.1)") from None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As a server binds: connections of a server that just stopped (TIME_WAIT, a minute) do not
        # make the port busy; a listening socket still does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host_ip, port))
        except OSError as exc:
            owner = next((s.name for s in list_servers() if s.port == port), None)
            by = f" by apirctl server {owner}" if owner else ""
            hint = f"stop it with `apirctl stop {owner}`" if owner else "pick another one with --port"
            raise ApirctlError(f"port {port} on {host_ip} is in use{by} ({exc.strerror})", hint=hint) from None


# --- model -------------------------------------------------------------------------------------


class ModelFile(BaseModel):
    """The GGUF file to mount, the name it gets inside the container, and a short display name."""

    path: Path
    filename: str
    name: str


def resolve_model(ref: str) -> ModelFile:
    """Resolve a reference through the model store (which fetches what is missing).

    Store blobs are named by digest, so the container sees the file under its original name.
    """
    from apirctl import models

    found = models.resolve(ref, pull=True, quiet=True)
    name = Path(found.filename).stem if found.source == "file" else found.name
    return ModelFile(path=found.path, filename=found.filename, name=name)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "model"


# --- listing -----------------------------------------------------------------------------------


def _containers(all_: bool) -> list[Container]:
    from apirctl import engine

    seen: dict[str, Container] = {}
    for label in (L_VERSION, L_APIR):
        for container in engine.client().containers.list(all=all_, filters={"label": label}):
            seen.setdefault(container.id, container)
    return list(seen.values())


def _created(attrs: dict[str, Any]) -> datetime | None:
    value = attrs.get("Created")
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    if isinstance(value, str) and value:
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", value).replace("Z", "+00:00"))
    return None


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


def _server(container: Container, probe_health: bool = True) -> Server:
    labels: dict[str, str] = container.labels or {}
    attrs = container.attrs
    ours = L_VERSION in labels
    url = labels.get(L_API, "")
    port_match = re.search(r":(\d+)(?:/|$)", url)
    port = int(port_match.group(1)) if port_match else None
    model = labels.get(L_MODEL)
    if not model:
        with contextlib.suppress(ValueError, TypeError, IndexError):
            model = Path(json.loads(labels.get(L_AI_LAB, "[]"))[0]).name
    transport = labels.get(L_TRANSPORT) or ("virtgpu" if labels.get(L_APIR) == "true" else "none")
    state = str(attrs.get("State") if isinstance(attrs.get("State"), str) else container.status)
    running = state in _RUNNING
    names = attrs.get("Names")
    name = names[0] if isinstance(names, list) and names else container.name
    image = attrs.get("Image") or ""
    backends = [b for b in labels.get(L_RPC_BACKENDS, "").split(",") if b]
    tunnel_pids = [int(p) for p in labels.get(L_TUNNELS, "").split(",") if p.isdigit()]
    rpc_target = labels.get(L_RPC_TARGET, "")
    state_of_health = "-"
    if running and probe_health:  # 3 s: a server on a starved CPU is slow, not down
        state_of_health = health(url.removesuffix("/v1"), timeout=3.0) if url else "unreachable"
    if transport == "rpc" and running and probe_health:  # its /health says ok until its next request
        state_of_health = _rpc_problem(backends, tunnel_pids) or state_of_health
    return Server(
        name=str(name).lstrip("/"),
        id=container.id,
        model=model or "?",
        transport=transport,
        url=url,
        state=state,
        health=state_of_health,
        port=port,
        created=_created(attrs),
        image=str(image),
        managed=ours,
        rpc_backends=backends,
        tunnels=tunnel_pids,
        rpc_target=rpc_target,
    )


def _rpc_problem(backends: list[str], tunnel_pids: list[int]) -> str | None:
    """Why an rpc server cannot work now: its SSH tunnel is gone, or (no explicit backends) the
    host backend is down."""
    if backends:
        if tunnel_pids:
            from apirctl import tunnel

            alive = {t.pid for t in tunnel.tunnels()}
            if not set(tunnel_pids) <= alive:
                return "ssh tunnel down"
        return None
    from apirctl.machine import linux

    return linux.backend_problem()


def list_servers(all: bool = False, probe_health: bool = True) -> list[Server]:  # noqa: A002
    """apirctl's servers (and the upstream extension's), newest first; `all` adds stopped ones."""
    servers = [_server(c, probe_health) for c in _containers(all)]
    epoch = datetime.fromtimestamp(0, tz=timezone.utc)
    return sorted(servers, key=lambda s: s.created or epoch, reverse=True)


def find_server(name: str | None = None, all: bool = False) -> Server:  # noqa: A002
    """The server called `name` (name or id prefix); without a name, the only one running."""
    servers = list_servers(all=all or name is not None)
    if name:
        for server in servers:
            if name in (server.name, server.id) or (len(name) >= 6 and server.id.startswith(name)):
                return server
        known = ", ".join(s.name for s in servers) or "none"
        raise ApirctlError(f"no inference server named {name!r} (servers: {known})", hint="see `apirctl ps -a`")
    running = [s for s in servers if s.state in _RUNNING]
    if not running:
        raise ApirctlError("no inference server is running", hint="start one with `apirctl serve MODEL`")
    if len(running) > 1:
        names = ", ".join(s.name for s in running)
        raise ApirctlError(f"several inference servers are running ({names})", hint="name one of them")
    return running[0]


def _container(server: Server) -> Container:
    from podman.errors import NotFound

    from apirctl import engine

    try:
        return engine.client().containers.get(server.id)
    except NotFound:
        raise ApirctlError(f"inference server {server.name} no longer exists") from None


# --- starting ----------------------------------------------------------------------------------


class _Api:
    """serve's hot path on the Podman API: exists, create, start, inspect through `apirctl.libpod`
    (no podman-py import), or through podman-py where the service URL needs it (ssh://)."""

    def __init__(self) -> None:
        from apirctl import engine, libpod

        self.url = engine.discover().url
        self.direct = libpod.supported(self.url)

    def exists(self, kind: str, name: str) -> bool:
        from apirctl import engine, libpod

        if self.direct:
            return libpod.exists(self.url, kind, name)
        if kind == "images":
            return engine.image_exists(name)
        return bool(engine.client().containers.exists(name))

    def create(self, spec: ContainerSpec) -> str:
        from apirctl import engine, libpod

        if not self.direct:
            return str(engine.create(spec).id)
        try:
            return libpod.create(self.url, spec)
        except libpod.LibpodError as exc:
            if exc.status == 404 or re.search(r"image not known|no such image", exc.message, re.IGNORECASE):
                local = spec.image.startswith("localhost/")
                hint = "run `apirctl setup` to build it" if local else f"pull it with `podman pull {spec.image}`"
                raise ApirctlError(f"image {spec.image} not found", hint=hint) from exc
            raise engine.start_failure(exc, "podman refused to create the container") from exc

    def start(self, container_id: str, name: str) -> None:
        from apirctl import engine, libpod

        try:
            if self.direct:
                libpod.start(self.url, container_id)
            else:
                container_by_id(container_id).start()
        except Exception as exc:  # podman-py's APIError or libpod's refusal: keep the message, drop the trace
            raise engine.start_failure(exc, f"cannot start {name}") from exc

    def inspect(self, container_id: str) -> dict[str, Any]:
        """The container's inspect data (libpod's shape: State.Status, Config.Labels, ...)."""
        from apirctl import libpod

        if self.direct:
            return libpod.inspect(self.url, container_id)
        return dict(container_by_id(container_id).attrs)  # podman-py's get() is the same inspect call


def _image_for(opts: ServeOptions, plan: Plan, on_status: ProgressFn | None, api: _Api) -> str:
    """The image to run: --image, else the transport's, else apirctl's local build."""
    from apirctl import engine

    chosen = opts.image or plan.image
    if chosen:
        if not api.exists("images", chosen):
            if chosen.startswith("localhost/"):
                raise ApirctlError(f"image {chosen} does not exist", hint="build it with `apirctl setup`")
            engine.pull(chosen, on_status)
        return chosen
    from apirctl import image, llamacpp

    build = llamacpp.container_build()
    if build is None:
        raise ApirctlError("the inference image is not built yet", exit_code=127, hint="run `apirctl setup`")
    tag = image.tag_for(build)
    if api.exists("images", tag):  # one API call instead of a podman process: serve's hot path
        return tag
    if on_status:
        on_status(f"building {tag}")
    return image.ensure(build)


def _labels(opts: ServeOptions, plan: Plan, model_path: Path, model_name: str) -> dict[str, str]:
    remote = {L_RPC_BACKENDS: ",".join(opts.rpc_backends)} if opts.rpc_backends else {}
    if opts.via_ssh:
        remote[L_VIA_SSH] = opts.via_ssh
    if plan.tunnels:
        remote[L_TUNNELS] = ",".join(str(pid) for pid in plan.tunnels)
    if "--rpc" in plan.llama_args[:-1]:
        remote[L_RPC_TARGET] = plan.llama_args[plan.llama_args.index("--rpc") + 1]
    return {
        **remote,
        L_VERSION: __version__,
        L_MODEL: model_name,
        L_TRANSPORT: plan.transport,
        L_HOST_IP: opts.host_ip,
        L_APIR: "true" if plan.transport == "virtgpu" else "false",
        L_API: _url(opts.host_ip, opts.port),
        L_AI_LAB: json.dumps([str(model_path.parent)]),
        L_GPU: GPU_LABELS[plan.transport],
        L_DOCS: DOCS_URL,
        L_TRACKING: secrets.token_hex(8),
    }


def _llama_command(opts: ServeOptions, model_file: str, model_name: str) -> list[str]:
    command = [
        "--model", f"{MODELS_DIR}/{model_file}",
        "--host", "0.0.0.0",  # inside the container; the host side is published on --host-ip only
        "--port", str(CONTAINER_PORT),
        "--ctx-size", str(opts.ctx_size),
        "--alias", model_name,
    ]
    if opts.threads:
        command += ["--threads", str(opts.threads)]
    if opts.api_key:
        command += ["--api-key", opts.api_key]
    return command


def _pick_name(opts: ServeOptions, model_name: str, api: _Api) -> str:
    def exists(candidate: str) -> bool:
        return api.exists("containers", candidate)

    if opts.name:
        if not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", opts.name):
            raise ApirctlError(f"invalid server name {opts.name!r}: use letters, digits, '_', '.' and '-'")
        if exists(opts.name):
            raise ApirctlError(f"a container named {opts.name} already exists",
                               hint=f"stop it with `apirctl stop {opts.name}` or pick another --name")
        return opts.name
    base = f"apirctl-{_slug(model_name)}"
    for candidate in (base, f"{base}-{opts.port}"):
        if not exists(candidate):
            return candidate
    raise ApirctlError(f"containers {base} and {base}-{opts.port} already exist", hint="pass --name")


def _one_virtgpu_at_a_time(plan: Plan) -> None:
    if plan.transport != "virtgpu":
        return
    for server in list_servers(probe_health=False):
        if server.transport == "virtgpu" and server.state in _RUNNING:
            raise ApirctlError(
                f"an API-remoting server is already running: {server.name} ({server.url})",
                hint=f"only one virtgpu container can run at a time; stop it with `apirctl stop {server.name}`",
            )


def _check_remote(opts: ServeOptions) -> None:
    """Refuse bad --rpc-backend/--via-ssh input before anything is fetched, created or opened."""
    from apirctl import transport, tunnel
    from apirctl.engine import on_macos

    if on_macos():
        raise ApirctlError("--rpc-backend is for Linux hosts", hint="on macOS use `--transport virtgpu`")
    if opts.via_ssh:
        for text in opts.rpc_backends:
            transport.parse_endpoint(text)
        tunnel.split_via(opts.via_ssh)
    else:  # no tunnels are opened without --via-ssh: this only decides the refusal
        transport.remote_rpc_plan(opts.rpc_backends, opts.ngl, insecure_network=opts.insecure_network)


def _remote_plan(opts: ServeOptions) -> Plan:
    """The rpc wiring of explicit backends; with --via-ssh this opens (and records) the tunnels."""
    from apirctl import transport

    ssh_args = [arg for option in opts.ssh_options for arg in ("-o", option)]
    return transport.remote_rpc_plan(opts.rpc_backends, opts.ngl, via_ssh=opts.via_ssh,
                                     insecure_network=opts.insecure_network, ssh_args=ssh_args)


def start(opts: ServeOptions, progress: ProgressFn | None = None) -> Started:
    """Create the container, start it and wait until /health says ok.

    `progress` is called with each phase's name as it begins. On failure the container's last
    log lines come with the error (`ServeFailed.log_tail`), the container is removed unless
    `opts.keep`, and SSH tunnels opened for it are closed.
    """
    from apirctl import transport

    phases: list[Phase] = []
    current: list[tuple[str, float]] = []

    def phase(name: str) -> None:
        """Close the running phase and open `name` (the CLI shows it with elapsed time)."""
        now = time.monotonic()
        if current:
            phases.append(Phase(name=current[0][0], seconds=now - current[0][1]))
        current[:] = [(name, now)]
        if progress:
            progress(name)

    check_port(opts.host_ip, opts.port)
    if opts.rpc_backends:
        _check_remote(opts)
        plan = None
    else:
        plan = transport.plan(opts.transport, ngl=opts.ngl, rpc_port=opts.rpc_port)
        _one_virtgpu_at_a_time(plan)
    phase("model")
    model = resolve_model(opts.model)
    api = _Api()
    name = _pick_name(opts, model.name, api)
    if plan is None:
        if opts.via_ssh:
            phase("ssh tunnels")
        plan = _remote_plan(opts)
    try:
        server = _start_container(opts, plan, model, name, phase, progress, api)
    except BaseException:
        if plan.tunnels:  # a kept container cannot use them either: it has exited
            from apirctl import tunnel

            tunnel.close(plan.tunnels)
        raise
    return Started(server=server, phases=phases, notice=plan.notice)


def _start_container(opts: ServeOptions, plan: Plan, model: ModelFile, name: str,
                     phase: ProgressFn, progress: ProgressFn | None, api: _Api) -> Server:
    """Image, container, start, wait for /health; a failed container is removed (unless --keep)."""
    from apirctl import engine
    from apirctl.engine import BindMount, ContainerSpec

    phase("image")
    image_ref = _image_for(opts, plan, progress, api)
    spec = ContainerSpec(
        image=image_ref,
        name=name,
        command=_llama_command(opts, model.filename, model.name),
        entrypoint=None if image_ref.startswith("localhost/apirctl/") else ["llama-server"],
        labels=_labels(opts, plan, model.path, model.name),
        mounts=[BindMount(source=model.path, target=f"{MODELS_DIR}/{model.filename}", read_only=True)],
        ports={CONTAINER_PORT: (_publish_ip(opts.host_ip), opts.port)},
    )
    spec = plan.apply(spec)
    spec.command += opts.llama_args

    phase("container")
    container_id = api.create(spec)
    try:
        api.start(container_id, name)
        phase("loading model")
        base = _url(opts.host_ip, opts.port).removesuffix("/v1")
        attrs = _wait_ready(api, container_id, base, opts.timeout)
        phase("ready")
    except BaseException as exc:
        tail = ""
        with contextlib.suppress(Exception):  # podman-py only on the failure path
            container = container_by_id(container_id)
            tail = _safe_tail(container)
            if not opts.keep:
                engine.remove(container, timeout=2)
        if isinstance(exc, ServeFailed):
            exc.log_tail = exc.log_tail or tail
            raise
        if isinstance(exc, ApirctlError):
            raise ServeFailed(exc.message, tail, hint=exc.hint) from exc
        raise
    return Server(
        name=name, id=container_id, model=model.name, transport=plan.transport, url=_url(opts.host_ip, opts.port),
        state="running", health="ok", port=opts.port, created=_created(attrs), image=image_ref,
        rpc_backends=list(opts.rpc_backends), tunnels=list(plan.tunnels),
    )


def container_by_id(container_id: str) -> Container:
    from apirctl import engine

    return engine.client().containers.get(container_id)


def _safe_tail(container: Container) -> str:
    from apirctl import engine

    try:
        return engine.container_logs(container, tail=LOG_TAIL_LINES).rstrip()
    except Exception:  # the container may be gone already; the error matters more than its log
        return ""


def _wait_ready(api: _Api, container_id: str, base: str, timeout: float) -> dict[str, Any]:
    """Poll /health until ok, often at first (each interval adds to time-to-ready: 5 ms in the first
    second, then 20 ms, then 100 ms after 10 s, for models that load for minutes); returns the last
    inspect data. The container's state is asked every 250 ms only while /health does not answer
    (a server that answers "loading" is alive; an exited one stops answering), failing fast when
    it stops: on a small machine each inspect takes CPU from the model load."""
    started = time.monotonic()
    deadline = started + timeout
    next_state_check = 0.0
    attrs: dict[str, Any] = {}
    while True:
        state = health(base, timeout=2.0)
        if state == "ok":
            return attrs or api.inspect(container_id)
        now = time.monotonic()
        if state != "loading" and now >= next_state_check:
            attrs = api.inspect(container_id)
            status = (attrs.get("State") or {}).get("Status", "")
            if status not in _RUNNING + _STARTING:
                code = (attrs.get("State") or {}).get("ExitCode")
                raise ServeFailed(
                    f"the server exited (code {code}) before it was ready",
                    hint="its last log lines are above; fix the model or flags and retry",
                )
            next_state_check = now + 0.25
        if time.monotonic() > deadline:
            raise ServeFailed(
                f"the server was not ready after {timeout:g} s (health: {state})",
                hint="raise the limit with --timeout or APIRCTL_HEALTH_TIMEOUT, or see the log lines above",
            )
        waited = time.monotonic() - started
        time.sleep(0.005 if waited < 1 else 0.02 if waited < 10 else 0.1)


# --- logs and stop -----------------------------------------------------------------------------


def logs(
    name: str | None = None, tail: int | None = None, follow: bool = False, since: int | None = None
) -> Iterator[str]:
    """A server's log lines (stopped servers too); with `follow`, until it stops.

    `since` (Unix seconds, with `follow`) starts the stream at a moment instead of a line count.
    """
    from apirctl import engine

    server = find_server(name, all=True) if name else find_server(None)
    container = _container(server)
    if follow:
        yield from engine.follow_logs(container, tail=tail, since=since)
        return
    text = engine.container_logs(container, tail=tail)
    yield from text.splitlines()


def stop(name: str | None = None, all: bool = False) -> list[str]:  # noqa: A002
    """Stop and remove servers; returns their names. Without a name, the only server there is."""
    from apirctl import engine

    if all:
        targets = [s for s in list_servers(all=True, probe_health=False) if s.managed]
    elif name:
        targets = [find_server(name, all=True)]
    else:
        servers = list_servers(all=True, probe_health=False)
        running = [s for s in servers if s.state in _RUNNING]
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
            engine.remove(_container(server), timeout=STOP_TIMEOUT)
            stopped.append(server.name)
        if server.tunnels and server.name in stopped:
            from apirctl import tunnel

            tunnel.close(server.tunnels)
    return stopped
