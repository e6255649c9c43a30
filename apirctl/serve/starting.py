"""Starting a server, top to bottom: provision it (port, plan, model, host processes, image, container
spec: `apirctl.serve.provision`), create and start the container, wait until /health says ok.
Also `generate` (the same spec as a unit) and `restart` (the same container again, or its spec built
again when its host backend moved).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any, NoReturn

from pydantic import BaseModel

from apirctl import config, vm
from apirctl.build import llamacpp
from apirctl.errors import ApirctlError
from apirctl.podman import containers
from apirctl.podman.containers import PodmanApi
from apirctl.podman.servers import L_DEFAULT_MODEL, L_INPUTS, L_TRACKING, RUNNING, STARTING, Server, created_at
from apirctl.remoting import apir_hosts, backends, rpc_server, transport
from apirctl.serve import spec
from apirctl.serve.inputs import ModelSet, ServeOptions, publish_ip, resolve_model, resolve_models, server_url
from apirctl.serve.provision import Provisioned, local_plan, provision, uninterrupted
from apirctl.serve.servers import STOP_TIMEOUT, find_server, health, router_models
from apirctl.serve.spec import Served
from apirctl.serve.units import FORMATS, check_restart
from apirctl.serve.units import kube as kube_yaml
from apirctl.serve.units import quadlet as quadlet_unit

LOG_TAIL_LINES = 20


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


def start(opts: ServeOptions, progress: ProgressFn | None = None) -> Started:
    """Create the container, start it and wait until /health says ok.

    `progress` is called with each phase's name as it begins. On failure the container's last
    log lines come with the error (`ServeFailed.log_tail`), the container is removed unless
    `opts.keep`, and what provisioning made for it (SSH tunnels, a backend, an apir-host) is released.
    """
    with provision(opts, progress) as ready:
        server = _start_vm(ready) if ready.opts.isolation == "vm" else _start_container(ready)
    return Started(server=server, phases=[Phase(name=n, seconds=s) for n, s in ready.clock.phases],
                   notice=ready.notice)


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
    plan = local_plan(opts)
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
    name = opts.name or f"apirctl-{spec.slug(spec.display_name(model))}"
    unit = spec.container_spec(opts, plan, model, name, spec.image_for(opts, plan, None, api))
    if fmt == "kube":
        return kube_yaml(unit, opts.restart)
    shown = model.label if isinstance(model, ModelSet) else model.name
    return quadlet_unit(unit, opts.restart, description=f"apirctl llama-server: {shown}")


def _start_container(ready: Provisioned) -> Server:
    """Create (the container phase is open), attach the host processes, start, wait for /health; a failed
    container is removed (unless --keep). The block of `provision` around it releases the host processes
    on failure."""
    opts, plan, model, name, api = ready.opts, ready.plan, ready.model, ready.name, ready.api
    instance, apir, phase = ready.instance, ready.apir, ready.clock.phase
    container_id = ""
    try:
        with uninterrupted():  # podman finishes a create its client gave up on: Ctrl-C waits for the id
            container_id = api.create(ready.spec)
        if instance is not None:
            backends.attach(instance, container_id)
        if apir is not None:
            apir_hosts.attach(apir, container_id)
        api.start(container_id, name)
        phase("loading model")
        base = server_url(opts.host_ip, opts.port).removesuffix("/v1")
        attrs = _wait_ready(api, container_id, base, opts.timeout)
        if isinstance(model, ModelSet):
            _check_router(base, model.names, opts.port, ready.spec.labels.get(L_DEFAULT_MODEL))
        else:
            _check_ours(base, f"{spec.MODELS_DIR}/{model.filename}", opts.port)
        if instance is not None:
            backends.confirm_link(instance)
        if apir is not None:
            apir_hosts.release(apir)
        phase("ready")
    except BaseException as exc:
        with uninterrupted():
            if not container_id:  # interrupted inside create: podman may have made it under our name
                _remove_if_ours(api, name, ready.spec.labels[L_TRACKING])
                raise
            tail = _safe_tail(api, container_id)
            if not opts.keep:
                _remove_failed(api, container_id)
        _raise_with_log(exc, tail)
    router = isinstance(model, ModelSet)
    return Server(
        name=name, id=container_id, model=model.label if isinstance(model, ModelSet) else model.name,
        transport=plan.transport, url=server_url(opts.host_ip, opts.port),
        state="running", health="ok", port=opts.port, created=created_at(attrs), image=ready.image,
        rpc_backends=list(opts.rpc_backends), tunnels=list(plan.tunnels),
        kind="chat" if isinstance(model, ModelSet) else model.kind, rpc_target=spec.target(plan),
        rpc_link=instance.link if instance is not None else plan.rpc_link, rpc_instance=plan.rpc_instance,
        apir_host=plan.apir_host, router=router, models_dir=str(opts.models_dir or ""),
        models=router_models(base) if router else {}, default_model=ready.spec.labels.get(L_DEFAULT_MODEL, ""),
    )


def _raise_with_log(exc: BaseException, tail: str) -> NoReturn:
    """Raise what a failed start ends in: our errors carry the server's last log lines (ServeFailed);
    anything else (an interrupt, a bug) goes on as it was."""
    if isinstance(exc, ServeFailed):
        exc.log_tail = exc.log_tail or tail
        raise exc
    if isinstance(exc, ApirctlError):
        raise ServeFailed(exc.message, tail, hint=exc.hint) from exc
    raise exc


#: A VM's memory when --memory is not given (MiB), and its CPUs when --cpus is not.
VM_MEMORY_MB = 2048
VM_CPUS = 2


def _start_vm(ready: Provisioned) -> Server:
    """Boot the image's llama-server in a micro-VM (`apirctl.vm`), wait for /health; a failed VM is
    ended and its folder removed (the console's last lines come with the error)."""
    opts, model, clock = ready.opts, ready.model, ready.clock
    if isinstance(model, ModelSet) or model.mmproj or len(model.files) > 1:
        raise ApirctlError("--isolation vm serves a model of one file (no projector, no split parts)",
                           hint="serve this model in a container")
    accel = vm.choose(config.settings().vm_accel)
    # the image apirctl builds carries the host build; an image of the user's own is theirs to match
    build = None if accel.name == "kvm" or opts.image else llamacpp.container_build()
    native = build is not None and build.options is not None and build.options.native
    if problem := vm.build_problem(accel, native):
        raise ApirctlError(problem, hint=f"serve in a container; or {vm.BUILD_HINT} (emulated because {accel.why})")
    ready.notices.append(f"VM on {accel.name}" + ("" if accel.name == "kvm" else f": {accel.why}"))
    clock.phase("vm image")
    boot = vm.ensure_boot_files()
    rootfs = vm.ensure_rootfs(ready.image)
    argv = (ready.spec.entrypoint or rootfs.entrypoint) + ready.spec.command
    labels = dict(ready.spec.labels)
    memory_mb = max(256, (opts.memory or VM_MEMORY_MB << 20) >> 20)
    instance = ready.instance  # rpc: the VM's backend of its own (provision started it; APIR's host: ready.apir)
    record = vm.VmRecord(name=ready.name, id=secrets.token_hex(32), labels=labels, image=ready.image,
                         port=opts.port, created=time.time(), accel=accel.name, memory_mb=memory_mb,
                         cpus=opts.cpus or VM_CPUS, rpc_instance=instance.id if instance else "",
                         apir_host=ready.apir.id if ready.apir else "")
    clock.phase("vm boot")
    env = {**rootfs.env, **ready.plan.environment}  # the transport's: APIR's endpoint in the VM
    record = vm.launch(record, boot, rootfs, model.path, argv, env, spec.CONTAINER_PORT,
                       publish_ip(opts.host_ip), model_file=model.filename, region=ready.region)
    try:  # (the relay keeps the backend from now on, and ends it with the VM)
        clock.phase("loading model")
        base = server_url(opts.host_ip, opts.port).removesuffix("/v1")
        _wait_vm(record, base, opts.timeout)
        _check_ours(base, f"{spec.MODELS_DIR}/{model.filename}", opts.port)
        if instance is not None:  # `ps` shows whether the guest's rings are in the VM's shared memory
            instance = backends.confirm_link(backends.get(instance.id) or instance, release=False)
        clock.phase("ready")
    except BaseException as exc:
        with uninterrupted():
            tail = vm.server_tail(record.name, LOG_TAIL_LINES)
            vm.remove(record.name)
        _raise_with_log(exc, tail)
    server = vm.server_of(record)
    server.health = "ok"
    if instance is not None:
        server.rpc_link = instance.link
    return server


def _wait_vm(record: vm.VmRecord, base: str, timeout: float) -> None:
    """Poll /health until ok; fail fast when QEMU ends (the server exited: the VM powers off)."""
    deadline = time.monotonic() + timeout
    while True:
        state = health(base, timeout=2.0)
        if state == "ok":
            return
        if not vm.alive(record):
            why = vm.ended(record.name)  # its relay ended it: the backend died or refused the guest
            raise ServeFailed(f"the VM ended before its server was ready{': ' + why if why else ''}",
                              hint="its console's last lines are above; fix the model or flags and retry")
        if time.monotonic() > deadline:
            raise ServeFailed(f"the server in the VM was not ready after {timeout:g} s (health: {state})",
                              hint="raise the limit with --timeout or APIRCTL_HEALTH_TIMEOUT")
        time.sleep(0.05)


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
    if server.isolation == "vm":
        raise ApirctlError(f"{server.name} is a VM: restart is for containers",
                           hint=f"`apirctl stop {server.name}`, then serve it again with --isolation vm")
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
    Unix socket and a backend of its own): its spec is built again the one way (`spec.container_spec`)
    from the inputs recorded in its label, with the rpc wiring of today: the same image, command, model
    mounts, port, labels, restart policy and memory limit. The old container's link is dead already."""
    api = containers.connect()
    attrs = api.inspect(server.id)
    inputs = spec.recorded((attrs.get("Config") or {}).get("Labels") or {}, server.name)
    opts = inputs.options
    plan = transport.host_rpc_plan(rpc_server.status(), opts.ngl)
    instance = None
    try:
        if plan.needs_backend:
            say(f"starting a backend for {server.name}")
            instance = rpc_server.start_own_backend(server.name, opts.memory)
            plan = transport.with_backend(plan, instance)
        remade = spec.container_spec(opts, plan, inputs.served, server.name, inputs.image)
        remade.labels[L_INPUTS] = spec.record(opts, inputs.served, inputs.image)
        say(f"making {server.name} again against the backend as it is now")
        api.remove(server.id, timeout=STOP_TIMEOUT)
        new_id = ""
        try:
            with uninterrupted():
                new_id = api.create(remade)
            if instance is not None:
                backends.attach(instance, new_id)
            api.start(new_id, server.name)
            say(f"waiting for {server.name} to load its model")
            _wait_ready(api, new_id, server.base, timeout)
            if instance is not None:
                backends.confirm_link(instance)
        except BaseException:
            with uninterrupted():
                if new_id:
                    _remove_failed(api, new_id)
            raise
    except BaseException:
        with uninterrupted():
            if instance is not None:
                backends.stop(instance)
        raise
    return find_server(server.name)
