"""Starting a server, top to bottom: the plan, the model, the image, the container spec, create,
start, wait until /health says ok.

A server is a Podman container running llama-server with the model mounted read-only and its port
published on the host's loopback by default (the upstream extension publishes on every interface;
an inference API without a key should not be reachable from the network).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from apirctl import __version__, config, gpu, host, models
from apirctl.build import image, llamacpp
from apirctl.errors import MISSING, ApirctlError
from apirctl.podman import containers
from apirctl.podman.containers import BindMount, ContainerSpec, HealthCheck, PodmanApi
from apirctl.podman.servers import (
    GPU_LABELS,
    L_AI_LAB,
    L_API,
    L_APIR,
    L_APIR_HOST,
    L_DEFAULT_MODEL,
    L_DOCS,
    L_GPU,
    L_HOST_IP,
    L_KIND,
    L_MODEL,
    L_MODELS_DIR,
    L_ROUTER,
    L_RPC_BACKENDS,
    L_RPC_INSTANCE,
    L_RPC_LINK,
    L_RPC_TARGET,
    L_TRACKING,
    L_TRANSPORT,
    L_TUNNELS,
    L_VERSION,
    L_VIA_SSH,
    RUNNING,
    STARTING,
    Server,
    created_at,
)
from apirctl.remoting import apir_hosts, backends, rpc_server, transport, tunnel
from apirctl.serve.inputs import (
    ModelFile,
    ModelSet,
    ServeOptions,
    claim_port,
    publish_ip,
    resolve_model,
    resolve_models,
    server_url,
)
from apirctl.serve.servers import STOP_TIMEOUT, find_server, health, list_servers, router_models
from apirctl.serve.units import FORMATS, check_restart
from apirctl.serve.units import kube as kube_yaml
from apirctl.serve.units import quadlet as quadlet_unit

if TYPE_CHECKING:
    from apirctl.remoting.apir_hosts import Host
    from apirctl.remoting.backends import Instance
    from apirctl.remoting.transport import Plan


CONTAINER_PORT = 8000
#: Where a router listens inside its container behind apirctl-front, which holds CONTAINER_PORT.
ROUTER_PORT = 8001
MODELS_DIR = "/models"
LOG_TAIL_LINES = 20
DOCS_URL = "https://github.com/ggml-org/llama.cpp/tree/master/tools/server"


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
#: What a server serves: one model, or (router mode) a set of them.
Served = ModelFile | ModelSet


# --- starting ----------------------------------------------------------------------------------


def _image_for(opts: ServeOptions, plan: Plan, on_status: ProgressFn | None, api: PodmanApi) -> str:
    """The image to run: --image, else the transport's, else apirctl's local build."""
    chosen = opts.image or plan.image
    if chosen:
        if not api.exists("images", chosen):
            if chosen.startswith("localhost/"):
                raise ApirctlError(f"image {chosen} does not exist", hint="build it with `apirctl setup`")
            api.pull(chosen, on_status)
        return chosen

    if plan.image_backend:  # passthrough: the image with that GPU backend
        build = gpu.gpu_builds().get(plan.image_backend)
        if build is None:
            raise ApirctlError(f"no llama.cpp build with the {plan.image_backend} backend",
                               hint="run `apirctl setup --vulkan`" if plan.image_backend == "vulkan"
                               else "run `apirctl setup` on this host with the CUDA toolkit installed")
    else:
        build = llamacpp.container_build()
    if build is None:
        raise ApirctlError("the inference image is not built yet", exit_code=MISSING, hint="run `apirctl setup`")
    tag = image.tag_for(build)
    if api.exists("images", tag):  # one API call instead of a podman process: serve's hot path
        return tag
    if on_status:
        on_status(f"building {tag}")
    return image.ensure(build)


#: Where a Prometheus that discovers containers or pods by annotation finds the metrics (the port inside
#: the container: a pod's; on the host the server's own URL serves /metrics too).
SCRAPE_LABELS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(CONTAINER_PORT),
                 "prometheus.io/path": "/metrics"}


def _labels(opts: ServeOptions, plan: Plan, model_path: Path, model_name: str, kind: str = "chat",
            default_model: str | None = None) -> dict[str, str]:
    remote = {L_RPC_BACKENDS: ",".join(opts.rpc_backends)} if opts.rpc_backends else {}
    if opts.router:
        remote[L_ROUTER] = "true"
    if default_model:
        remote[L_DEFAULT_MODEL] = default_model
    if opts.models_dir is not None:
        remote[L_MODELS_DIR] = str(opts.models_dir)
    if opts.via_ssh:
        remote[L_VIA_SSH] = opts.via_ssh
    if plan.tunnels:
        remote[L_TUNNELS] = ",".join(str(pid) for pid in plan.tunnels)
    if "--rpc" in plan.llama_args[:-1]:
        remote[L_RPC_TARGET] = plan.llama_args[plan.llama_args.index("--rpc") + 1]
    if plan.rpc_link:
        remote[L_RPC_LINK] = plan.rpc_link
    if plan.rpc_instance:
        remote[L_RPC_INSTANCE] = plan.rpc_instance
    if plan.apir_host:
        remote[L_APIR_HOST] = plan.apir_host
    return {
        **remote,
        L_VERSION: __version__,
        L_MODEL: model_name,
        L_KIND: kind,
        L_TRANSPORT: plan.transport,
        L_HOST_IP: opts.host_ip,
        L_APIR: "true" if plan.transport == "virtgpu" else "false",
        L_API: server_url(opts.host_ip, opts.port),
        L_AI_LAB: json.dumps([str(model_path.parent)]),
        L_GPU: GPU_LABELS[plan.transport],
        L_DOCS: DOCS_URL,
        L_TRACKING: secrets.token_hex(8),
        **(SCRAPE_LABELS if opts.metrics else {}),
    }


def _llama_command(opts: ServeOptions, model_file: str, model_name: str) -> list[str]:
    command = [
        "--model", f"{MODELS_DIR}/{model_file}",
        "--host", "0.0.0.0",  # inside the container; the host side is published on --host-ip only
        "--port", str(CONTAINER_PORT),
        "--ctx-size", str(opts.ctx_size),
        "--alias", model_name,
    ]
    return command + _shared_flags(opts)


def _shared_flags(opts: ServeOptions) -> list[str]:
    """The flags a one-model server and a router's children take alike."""
    flags: list[str] = []
    if opts.threads:
        flags += ["--threads", str(opts.threads)]
    if opts.api_key:
        flags += ["--api-key", opts.api_key]
    if opts.metrics:
        flags.append("--metrics")
    if opts.idle_unload:
        flags += ["--sleep-idle-seconds", str(opts.idle_unload)]
    return flags


def models_max(opts: ServeOptions, plan: Plan) -> tuple[int | None, str | None]:
    """How many models a router server keeps loaded (None: llama-server's default), and why when the
    transport decides it: a backend that serves one client at a time holds one model's instance."""
    if not plan.one_client:
        return opts.models_max, None
    if opts.models_max not in (None, 1):
        raise ApirctlError(f"--transport {plan.transport} keeps one model loaded at a time, not --models-max "
                           f"{opts.models_max}",
                           hint="leave --models-max out, or serve with --transport none or gpu")
    why = ("the rpc backend serves one client" if plan.transport == "rpc" else
           "each loaded model is a backend of its own on the host, beside the router's own connection")
    return 1, f"one model loaded at a time: {why}, so a request for another model unloads the loaded one"


def _router_command(opts: ServeOptions, plan: Plan, behind_front: bool = False) -> list[str]:
    """llama-server's router: no model of its own; it lists MODELS_DIR (a directory per model) and
    starts a child llama-server per model on its first request, each with these flags. Behind
    apirctl-front (a default model) it listens on ROUTER_PORT inside the container only."""
    listen = ["--host", "127.0.0.1", "--port", str(ROUTER_PORT)] if behind_front else \
        ["--host", "0.0.0.0", "--port", str(CONTAINER_PORT)]
    command = ["--models-dir", MODELS_DIR, *listen, "--ctx-size", str(opts.ctx_size), *_shared_flags(opts)]
    limit, _ = models_max(opts, plan)
    if limit is not None:
        command += ["--models-max", str(limit)]
    given = {"--temp": opts.temperature, "--seed": opts.seed, "--n-predict": opts.max_tokens}
    for flag, value in given.items():
        if value is not None:
            command += [flag, str(value)]
    return command


def _router_mounts(chosen: ModelSet) -> list[BindMount]:
    """A directory per model under MODELS_DIR, named as the router lists it: a single file as
    `model.gguf` (a name the router takes for neither a projector nor a draft), split parts under
    their own names, the projector under a name with "mmproj" in it. A --models-dir is mounted whole."""
    if chosen.directory is not None:
        return [BindMount(source=chosen.directory, target=MODELS_DIR, read_only=True)]
    mounts = []
    for model in chosen.models:
        files = model.files or [models.ModelFile(path=model.path, filename=model.filename)]
        parts = [f for f in files if f.filename != model.mmproj]
        for f in files:
            if f.filename == model.mmproj:
                target = f.filename if "mmproj" in f.filename else f"mmproj-{f.filename}"
            else:
                target = "model.gguf" if len(parts) == 1 else f.filename
            mounts.append(BindMount(source=f.path, target=f"{MODELS_DIR}/{model.name}/{target}", read_only=True))
    return mounts


#: Ollama's params that have a llama-server flag of the same meaning.
_OLLAMA_PARAMS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "seed": "--seed"}


def _model_args(opts: ServeOptions, model: ModelFile) -> list[str]:
    """llama-server flags the model implies (its kind, projector, source defaults) and the sampling flags."""
    args: list[str] = []
    if model.mmproj:
        args += ["--mmproj", f"{MODELS_DIR}/{model.mmproj}"]
    if model.kind == "embedding":
        args.append("--embeddings")
    elif model.kind == "reranking":
        args.append("--reranking")
    given = {"--temp": opts.temperature, "--seed": opts.seed, "--n-predict": opts.max_tokens}
    for key, flag in _OLLAMA_PARAMS.items():
        value = model.params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and given.get(flag) is None:
            given[flag] = value
    for flag, value in given.items():
        if value is not None:
            args += [flag, str(value)]
    return args


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "model"


def _pick_name(opts: ServeOptions, model_name: str, api: PodmanApi) -> str:
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
    """macOS: one API-remoting container per VM (upstream's limit); on Linux each has its own host."""
    if plan.transport != "virtgpu" or plan.apir_link:
        return
    for server in list_servers(probe_health=False):
        if server.transport == "virtgpu" and server.state in RUNNING:
            raise ApirctlError(
                f"an API-remoting server is already running: {server.name} ({server.url})",
                hint=f"only one virtgpu container can run at a time; stop it with `apirctl stop {server.name}`",
            )


def _check_remote(opts: ServeOptions) -> None:
    """Refuse bad --rpc-backend/--via-ssh input before anything is fetched, created or opened."""
    if host.is_macos():
        raise ApirctlError("--rpc-backend is for Linux hosts", hint="on macOS use `--transport virtgpu`")
    if opts.via_ssh:
        for text in opts.rpc_backends:
            transport.parse_endpoint(text)
        tunnel.split_via(opts.via_ssh)
    else:  # no tunnels are opened without --via-ssh: this only decides the refusal
        transport.remote_rpc_plan(opts.rpc_backends, opts.ngl, insecure_network=opts.insecure_network)


def _remote_plan(opts: ServeOptions) -> Plan:
    """The rpc wiring of explicit backends; with --via-ssh this opens (and records) the tunnels."""
    ssh_args = [arg for option in opts.ssh_options for arg in ("-o", option)]
    return transport.remote_rpc_plan(opts.rpc_backends, opts.ngl, via_ssh=opts.via_ssh,
                                     insecure_network=opts.insecure_network, ssh_args=ssh_args)


def start(opts: ServeOptions, progress: ProgressFn | None = None) -> Started:
    """Create the container, start it and wait until /health says ok.

    `progress` is called with each phase's name as it begins. On failure the container's last
    log lines come with the error (`ServeFailed.log_tail`), the container is removed unless
    `opts.keep`, and SSH tunnels opened for it are closed.
    """
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

    if opts.restart:
        check_restart(opts.restart)
    moved = None
    port, claim = claim_port(opts.host_ip, opts.port, given=opts.port_given)  # held until ready or failed
    try:
        if port != opts.port:
            moved = f"port {opts.port} is in use: serving on {port} (--port picks one)"
        opts = opts.model_copy(update={"port": port})
        started = _start_on_port(opts, phase, progress, phases)
    finally:
        claim.release()
    notice = "; ".join(n for n in (moved, started.notice) if n) or None
    return started.model_copy(update={"notice": notice})


def _start_on_port(opts: ServeOptions, phase: ProgressFn, progress: ProgressFn | None,
                   phases: list[Phase]) -> Started:
    """`start` once the port is claimed: the plan, the model, tunnels or backend, the container."""
    if opts.rpc_backends:
        _check_remote(opts)
        plan = None
    else:
        plan = transport.plan(opts.transport, ngl=opts.ngl, rpc_port=opts.rpc_port, gpu_devices=opts.gpu_devices,
                              own_image=opts.image is not None)
        _one_virtgpu_at_a_time(plan)
    phase("model")
    model: Served = resolve_models(opts) if opts.router else resolve_model(opts.model)
    api = containers.connect()
    name = _pick_name(opts, _display_name(model), api)
    instance = None
    apir = None
    try:  # every resource below is made inside the scope that removes it on any failure or Ctrl-C
        if plan is None:
            if opts.via_ssh:
                phase("ssh tunnels")
            plan = _remote_plan(opts)
        if plan.needs_backend:  # a backend of its own, on its own socket
            phase("rpc backend")
            instance = rpc_server.start_own_backend(name, opts.memory)  # the cap on what it shares and pins
            plan = transport.with_backend(plan, instance)
        if plan.needs_apir_host:  # Linux APIR: an apir-host of its own, on its own socket
            phase("apir host")
            apir = apir_hosts.start(llamacpp.require_build(), name, trace=opts.apir_trace,
                                    respawn=opts.restart not in (None, "no"))
            plan = transport.with_apir_host(plan, apir)
        server = _start_container(opts, plan, model, name, phase, progress, api, instance, apir)
    except BaseException:
        with _uninterrupted():
            if plan is not None and plan.tunnels:  # a kept container cannot use them either: it has exited
                tunnel.close(plan.tunnels)
            if instance is not None:
                backends.stop(instance)
            if apir is not None:
                apir_hosts.stop(apir)
        raise
    _, router_notice = models_max(opts, plan) if opts.router else (None, None)
    return Started(server=server, phases=phases, notice="; ".join(n for n in (plan.notice, router_notice) if n) or None)


def _display_name(model: Served) -> str:
    """The name a container is called after: the model's; for a router, its directory's or `models`."""
    if isinstance(model, ModelSet):
        return model.directory.name if model.directory is not None else "models"
    return model.name


def _own_image(image_ref: str) -> bool:
    """apirctl's image, which carries its health check and apirctl-front."""
    return image_ref.startswith(image.IMAGE_REPO + ":")


def _entrypoint(image_ref: str, default_model: str | None) -> list[str] | None:
    """What the container runs: the image's own entry point (apirctl's image: llama-server), or
    llama-server by name in another image; a router with a default model starts behind apirctl-front."""
    if default_model:
        return [image.FRONT, "--listen", str(CONTAINER_PORT), "--upstream", str(ROUTER_PORT),
                "--model", default_model, "--", "llama-server"]
    return None if image_ref.startswith("localhost/apirctl/") else ["llama-server"]


def _router_default(opts: ServeOptions, model: ModelSet, image_ref: str) -> str | None:
    """The router's default model, where its image can serve one (apirctl's carries apirctl-front)."""
    if _own_image(image_ref):
        return model.default
    if opts.router_default is not None:
        raise ApirctlError(f"--default-model needs apirctl's image, not {image_ref}",
                           hint="leave --image out, or have each request name its model")
    return None


def _spec(opts: ServeOptions, plan: Plan, model: Served, name: str, image_ref: str) -> ContainerSpec:
    """The container `serve` runs (also what `--generate` writes down): one model, or the router over a set."""
    default = None
    if isinstance(model, ModelSet):
        default = _router_default(opts, model, image_ref)
        command = _router_command(opts, plan, behind_front=default is not None)
        first = model.directory / "model.gguf" if model.directory is not None else model.models[0].path
        labels = _labels(opts, plan, first, model.label, default_model=default)
        mounts = _router_mounts(model)
    else:
        command = _llama_command(opts, model.filename, model.name) + _model_args(opts, model)
        labels = _labels(opts, plan, model.path, model.name, model.kind)
        mounts = [BindMount(source=f.path, target=f"{MODELS_DIR}/{f.filename}", read_only=True)
                  for f in model.files or [models.ModelFile(path=model.path, filename=model.filename)]]
    spec = ContainerSpec(
        image=image_ref,
        name=name,
        command=command,
        entrypoint=_entrypoint(image_ref, default),
        labels=labels,
        mounts=mounts,
        ports={CONTAINER_PORT: (publish_ip(opts.host_ip), opts.port)},
        restart_policy=check_restart(opts.restart) if opts.restart else None,
        healthcheck=_healthcheck(opts, image_ref),
        mem_limit=opts.memory,
    )
    spec = plan.apply(spec)
    spec.command += opts.llama_args
    return spec


def _healthcheck(opts: ServeOptions, image_ref: str) -> HealthCheck | None:
    """Podman's health check of our own image (which carries the program it runs): ready when
    llama-server's /health answers 200; the model's loading time (serve's --timeout) is its start
    period. Another image (--image) may lack the program: it gets none."""
    if not _own_image(image_ref):
        return None
    port = str(CONTAINER_PORT)
    return HealthCheck(command=[image.HEALTH_CHECK, port], live_command=[image.HEALTH_CHECK, "--live", port],
                       start_period_s=int(opts.timeout))


def generate(opts: ServeOptions, fmt: str) -> str:
    """The server `start` would run, as a quadlet unit (`fmt` "quadlet") or Kubernetes YAML ("kube").

    Nothing is created or started; the model is fetched and the image built, as they must exist
    where the unit runs."""
    if fmt not in FORMATS:
        raise ApirctlError(f"--generate {fmt!r}: one of {', '.join(FORMATS)}")
    if opts.rpc_backends:
        raise ApirctlError("--generate does not take --rpc-backend: SSH tunnels end with this command",
                           hint="generate with the host's own backend (--transport rpc) instead")
    if opts.restart:
        check_restart(opts.restart)
    plan = transport.plan(opts.transport, ngl=opts.ngl, rpc_port=opts.rpc_port, gpu_devices=opts.gpu_devices,
                          own_image=opts.image is not None)
    if plan.needs_backend:  # a backend of its own is apirctl's process, started by serve: a unit outlives it
        raise ApirctlError("--generate cannot give the unit a backend of its own: the host backend listens on "
                           "a Unix socket, and apirctl starts one backend per container it serves",
                           hint="generate against a TCP host backend (`apirctl machine restart --remoting "
                           "--listen tcp`), or with --transport none")
    if plan.needs_apir_host:
        raise ApirctlError("--generate cannot give the unit an apir-host: apirctl starts one per container it serves",
                           hint="serve it with `apirctl serve --transport virtgpu` instead")
    model: Served = resolve_models(opts) if opts.router else resolve_model(opts.model)
    api = containers.connect()
    name = opts.name or f"apirctl-{_slug(_display_name(model))}"
    spec = _spec(opts, plan, model, name, _image_for(opts, plan, None, api))
    if fmt == "kube":
        return kube_yaml(spec, opts.restart)
    shown = model.label if isinstance(model, ModelSet) else model.name
    return quadlet_unit(spec, opts.restart, description=f"apirctl llama-server: {shown}")


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Clean-up that a second Ctrl-C (or `kill`) must not cut short: SIGINT and SIGTERM wait until
    it is done (they are delivered then)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _start_container(opts: ServeOptions, plan: Plan, model: Served, name: str,
                     phase: ProgressFn, progress: ProgressFn | None, api: PodmanApi,
                     instance: Instance | None = None, apir: Host | None = None) -> Server:
    """Image, container, start, wait for /health; a failed container is removed (unless --keep)."""
    phase("image")
    image_ref = _image_for(opts, plan, progress, api)
    spec = _spec(opts, plan, model, name, image_ref)

    phase("container")
    container_id = ""
    try:
        with _uninterrupted():  # podman finishes a create its client gave up on: Ctrl-C waits for the id
            container_id = api.create(spec)
        if instance is not None:
            backends.attach(instance, container_id)
        if apir is not None:
            apir_hosts.attach(apir, container_id)
        api.start(container_id, name)
        phase("loading model")
        base = server_url(opts.host_ip, opts.port).removesuffix("/v1")
        attrs = _wait_ready(api, container_id, base, opts.timeout)
        if isinstance(model, ModelSet):
            _check_router(base, model.names, opts.port, spec.labels.get(L_DEFAULT_MODEL))
        else:
            _check_ours(base, f"{MODELS_DIR}/{model.filename}", opts.port)
        if instance is not None:
            backends.confirm_link(instance)
        if apir is not None:
            apir_hosts.release(apir)
        phase("ready")
    except BaseException as exc:
        with _uninterrupted():
            if not container_id:  # interrupted inside create: podman may have made it under our name
                _remove_if_ours(api, name, spec.labels[L_TRACKING])
                raise
            tail = _safe_tail(api, container_id)
            if not opts.keep:
                _remove_failed(api, container_id)
        if isinstance(exc, ServeFailed):
            exc.log_tail = exc.log_tail or tail
            raise
        if isinstance(exc, ApirctlError):
            raise ServeFailed(exc.message, tail, hint=exc.hint) from exc
        raise
    router = isinstance(model, ModelSet)
    return Server(
        name=name, id=container_id, model=model.label if isinstance(model, ModelSet) else model.name,
        transport=plan.transport, url=server_url(opts.host_ip, opts.port),
        state="running", health="ok", port=opts.port, created=created_at(attrs), image=image_ref,
        rpc_backends=list(opts.rpc_backends), tunnels=list(plan.tunnels),
        kind="chat" if isinstance(model, ModelSet) else model.kind, rpc_target=_target(plan),
        rpc_link=instance.link if instance is not None else plan.rpc_link, rpc_instance=plan.rpc_instance,
        apir_host=plan.apir_host, router=router, models_dir=str(opts.models_dir or ""),
        models=router_models(base) if router else {}, default_model=spec.labels.get(L_DEFAULT_MODEL, ""),
    )


def _target(plan: Plan) -> str:
    args = plan.llama_args
    return args[args.index("--rpc") + 1] if "--rpc" in args[:-1] else ""


def _remove_failed(api: PodmanApi, container_id: str, patience: float = 20.0) -> None:
    """Remove a container that failed or was interrupted. Podman 4.3 can refuse a removal while the
    container is still being started, stopped or cleaned up (seen under load after Ctrl-C during
    loading, for several seconds), so a refusal is retried until `patience` runs out; the error
    being reported matters more than a failed clean-up."""
    deadline = time.monotonic() + patience
    pause = 0.25
    while True:
        try:
            api.remove(container_id, timeout=2)
            return
        except Exception:  # noqa: BLE001 - retried, then given up on: the original error is raised
            if time.monotonic() + pause > deadline:
                return
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def _remove_if_ours(api: PodmanApi, name: str, tracking: str) -> None:
    """Remove the container called `name` if it carries this start's tracking label (never another
    serve's container that took the name first)."""
    with contextlib.suppress(Exception):
        labels = (api.inspect(name).get("Config") or {}).get("Labels") or {}
        if labels.get(L_TRACKING) == tracking:
            api.remove(name, timeout=2)


def _safe_tail(api: PodmanApi, container_id: str) -> str:
    try:
        return api.logs(container_id, tail=LOG_TAIL_LINES).rstrip()
    except Exception:  # the container may be gone already; the error matters more than its log
        return ""


def _check_ours(base: str, model_path: str, port: int) -> None:
    """The published port must reach this container, not just any listener: llama-server's /props
    names the model file it loaded, which is ours. A server that has no /props (another image) is
    taken on trust."""
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=5)
    try:
        conn.request("GET", "/props")
        response = conn.getresponse()
        data = json.loads(response.read()) if response.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return
    finally:
        conn.close()
    found = data.get("model_path") if isinstance(data, dict) else None
    if isinstance(found, str) and found and found != model_path:
        raise ServeFailed(f"port {port} answers, but from another server (its model is {found}, ours {model_path})",
                          hint="another process took the port as this server started: stop it, or use another --port")


def _check_router(base: str, names: list[str], port: int, default: str | None = None) -> None:
    """The router on the published port must be ours: it lists the models serve gave it. One that does
    not answer /models as a router does (another image, a key it needs) is taken on trust. The default
    model must be one it lists (a --models-dir's names are the router's to give)."""
    found = router_models(base)
    if found and names and not set(names) <= set(found):
        raise ServeFailed(f"port {port} answers, but from another server (its models: {', '.join(found)})",
                          hint="another process took the port as this server started: stop it, or use another --port")
    if found and default and default not in found:
        raise ServeFailed(f"--default-model {default} is not one of the models the server lists",
                          hint="one of: " + ", ".join(found))


def _wait_ready(api: PodmanApi, container_id: str, base: str, timeout: float) -> dict[str, Any]:
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
            if status not in RUNNING + STARTING:
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


def restart(name: str, timeout: float | None = None, progress: ProgressFn | None = None) -> Server:
    """Stop and start a server's container again, then wait for /health; returns it as `ps` sees it.

    The container keeps what serve gave it (model, name, port, llama flags, the backend address), so
    a server whose RPC backend was restarted under it connects to the new one: llama-server does not
    reconnect by itself. An APIR server whose apir-host died gets a new host on the same socket
    first. Its instance label stays; it counts as connected because it started after
    the backend did (`rpc_server.backend_problem`). When the host backend came back on another port
    or on a Unix socket, the old address is in the container's command: it is made again with the
    new wiring (`_rewire`).
    """
    say = progress or (lambda _step: None)
    server = find_server(name, all=True)
    if not server.managed:
        raise ApirctlError(f"{name} was not started by apirctl", hint="restart it where it was started")
    limit = timeout if timeout is not None else config.settings().health_timeout
    record = rpc_server.read_record() if server.transport == "rpc" and server.rpc_link == "tcp" else None
    if record is not None and server.rpc_instance and server.rpc_instance != record.instance \
            and rpc_server.moved(server, record):
        return _rewire(server, limit, say)
    api = containers.connect()
    say(f"stopping {server.name}")
    api.stop(server.id, timeout=STOP_TIMEOUT)
    if server.apir_host and apir_hosts.problem(server.apir_host):  # its host died: the same socket, a new host
        say(f"starting the apir host of {server.name} again")
        apir_hosts.revive(server.apir_host)
    say(f"starting {server.name}")
    api.start(server.id, server.name)
    say(f"waiting for {server.name} to load its model")
    _wait_ready(api, server.id, server.base, limit)
    return find_server(server.name)


def _rewire(server: Server, timeout: float, say: ProgressFn) -> Server:
    """Make a server's container again against the host backend as it is now (another port, or a
    Unix socket and a backend of its own): the same image, command, model mounts, port, labels,
    restart policy and memory limit, with the rpc wiring of today. The old container's link is dead already."""
    api = containers.connect()
    attrs = api.inspect(server.id)
    command = list((attrs.get("Config") or {}).get("Cmd") or [])
    ngl = command[command.index("--n-gpu-layers") + 1] if "--n-gpu-layers" in command[:-1] else "999"
    plan = transport.host_rpc_plan(rpc_server.status(), int(ngl) if ngl.lstrip("-").isdigit() else 999)
    instance = None
    try:
        if plan.needs_backend:
            say(f"starting a backend for {server.name}")
            instance = rpc_server.start_own_backend(server.name, _memory_limit(attrs))
            plan = transport.with_backend(plan, instance)
        spec = _respec(attrs, plan)
        say(f"making {server.name} again against the backend as it is now")
        api.remove(server.id, timeout=STOP_TIMEOUT)
        new_id = ""
        try:
            with _uninterrupted():
                new_id = api.create(spec)
            if instance is not None:
                backends.attach(instance, new_id)
            api.start(new_id, server.name)
            say(f"waiting for {server.name} to load its model")
            _wait_ready(api, new_id, server.base, timeout)
            if instance is not None:
                backends.confirm_link(instance)
        except BaseException:
            with _uninterrupted():
                if new_id:
                    _remove_failed(api, new_id)
            raise
    except BaseException:
        with _uninterrupted():
            if instance is not None:
                backends.stop(instance)
        raise
    return find_server(server.name)


def _memory_limit(attrs: dict[str, Any]) -> int | None:
    """A container's memory limit in bytes from its inspect data (None: it has none)."""
    limit = (attrs.get("HostConfig") or {}).get("Memory")
    return limit if isinstance(limit, int) and limit > 0 else None


def _respec(attrs: dict[str, Any], plan: Plan) -> ContainerSpec:
    """The spec of a server's container from its inspect data (its memory limit too), with its rpc
    wiring (`--rpc ADDRESS --n-gpu-layers N`, its network, its backend's mount and labels) replaced
    by `plan`'s."""
    conf = attrs.get("Config") or {}
    host_conf = attrs.get("HostConfig") or {}
    command = list(conf.get("Cmd") or [])
    at = command.index("--rpc") if "--rpc" in command[:-1] else len(command)
    rest = command[at + 2:]
    if rest[:1] == ["--n-gpu-layers"]:
        rest = rest[2:]
    labels = {k: v for k, v in (conf.get("Labels") or {}).items() if k not in (L_RPC_INSTANCE, L_RPC_TARGET)}
    labels.update({L_RPC_LINK: plan.rpc_link, L_TRACKING: secrets.token_hex(8)})
    if plan.rpc_instance:
        labels[L_RPC_INSTANCE] = plan.rpc_instance
    if _target(plan):
        labels[L_RPC_TARGET] = _target(plan)
    ports = {int(key.split("/")[0]): (str(bound[0].get("HostIp") or ""), int(bound[0]["HostPort"]))
             for key, bound in (host_conf.get("PortBindings") or {}).items() if bound}
    policy = host_conf.get("RestartPolicy") or {}
    restart = str(policy.get("Name") or "") or None
    if restart == "on-failure" and policy.get("MaximumRetryCount"):
        restart = f"on-failure:{policy['MaximumRetryCount']}"
    image_ref = str(attrs.get("ImageName") or conf.get("Image") or "")
    spec = ContainerSpec(
        image=image_ref, name=str(attrs.get("Name") or "").lstrip("/") or None, command=command[:at],
        entrypoint=_entrypoint(image_ref, labels.get(L_DEFAULT_MODEL)), labels=labels,
        mounts=[BindMount(source=m["Source"], target=m["Destination"], read_only=not m.get("RW", False))
                for m in attrs.get("Mounts") or []
                if m.get("Type") == "bind" and m.get("Destination") != backends.CONTAINER_DIR],
        ports=ports, restart_policy=restart if restart not in ("", "no") else None, mem_limit=_memory_limit(attrs),
    )
    spec = plan.apply(spec)
    spec.command += rest
    return spec
