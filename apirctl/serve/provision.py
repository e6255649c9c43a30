"""Provisioning a server: everything its container needs before it is created, as one step that owns
its clean-up.

`provision` claims the port, plans the transport, resolves the model (or a router's set), picks the
container's name, opens SSH tunnels, starts a backend or an apir-host of the container's own, finds
the image and builds the container spec (`apirctl.serve.spec`). It yields the finished `Provisioned`;
when the block it guards fails (any exception, Ctrl-C included) every host resource it made is
released; when the block succeeds they belong to the container. The port claim is released either
way, once the block ends.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from apirctl import config, host, vm
from apirctl.build import llamacpp
from apirctl.errors import ApirctlError
from apirctl.podman import containers
from apirctl.podman.containers import ContainerSpec, PodmanApi
from apirctl.podman.servers import L_INPUTS, RUNNING
from apirctl.remoting import apir_hosts, backends, rpc_server, transport, tunnel
from apirctl.remoting.apir_hosts import Host
from apirctl.remoting.backends import Instance
from apirctl.remoting.transport import Plan
from apirctl.serve import spec
from apirctl.serve.inputs import ServeOptions, claim_port, resolve_model, resolve_models
from apirctl.serve.servers import list_servers
from apirctl.serve.spec import ProgressFn, Served
from apirctl.serve.units import check_restart


class PhaseClock:
    """The phases of a start and how long each took: `phase(name)` closes the running one and opens
    `name`, telling `progress` (the CLI shows it with elapsed time; the benchmark reads `phases`)."""

    def __init__(self, progress: ProgressFn | None = None) -> None:
        self.progress = progress
        self.phases: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None

    def phase(self, name: str) -> None:
        now = time.monotonic()
        if self._current is not None:
            self.phases.append((self._current[0], now - self._current[1]))
        self._current = (name, now)
        if self.progress:
            self.progress(name)


@dataclass
class Provisioned:
    """A server ready to be created: its options (the claimed port in them), plan, model, name, image and
    spec, and the host processes made for it (a backend, an apir-host), which the container attaches to."""

    opts: ServeOptions
    plan: Plan
    model: Served
    name: str
    image: str
    spec: ContainerSpec
    api: PodmanApi
    clock: PhaseClock
    instance: Instance | None = None
    apir: Host | None = None
    region: vm.Region | None = None  # a remoting VM's shared memory, until QEMU has it too
    notices: list[str] = field(default_factory=list)

    @property
    def notice(self) -> str | None:
        return "; ".join(self.notices) or None


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Clean-up that a second Ctrl-C (or `kill`) must not cut short: SIGINT and SIGTERM wait until
    it is done (they are delivered then)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


ISOLATIONS = ("container", "vm")


def local_plan(opts: ServeOptions) -> Plan:
    """The transport's plan on this host (no --rpc-backend): what `serve` and `--generate` wire. A VM
    (`--isolation vm`) runs on its own CPU, or with `--transport rpc` (`virtgpu`) on a backend (an
    apir-host) of its own on the host, reached through the one address its restricted network forwards
    (`vm.GUEST_RPC_ENDPOINT`) and the memory it shares with it (`vm.Region`)."""
    if opts.isolation not in ISOLATIONS:
        raise ApirctlError(f"--isolation {opts.isolation!r}: one of {', '.join(ISOLATIONS)}")
    if opts.cpus is not None and opts.isolation != "vm":
        raise ApirctlError("--cpus sizes a VM", hint="add --isolation vm, or leave --cpus out")
    if opts.isolation == "vm":
        if opts.transport not in ("auto", "none", "rpc", "virtgpu"):
            raise ApirctlError(f"--isolation vm remotes with --transport rpc or virtgpu, not --transport "
                               f"{opts.transport}", hint="use --transport rpc (a backend of its own on the host), "
                               "virtgpu (an apir-host of its own) or none (the VM's CPU)")
        if opts.router or opts.restart or opts.gpu_devices:
            raise ApirctlError("--isolation vm serves one model file, without --restart or --gpu-device",
                               hint="serve several models or a restart policy in a container")
        if opts.transport in ("rpc", "virtgpu"):
            if host.is_macos():
                raise ApirctlError("--isolation vm is for Linux hosts", hint="on macOS use `--transport virtgpu`")
            if opts.transport == "virtgpu":
                return transport.vm_apir_plan(opts.ngl, vm.GUEST_RPC_ENDPOINT)
            return transport.vm_rpc_plan(opts.ngl, vm.GUEST_RPC_ENDPOINT)
        if opts.transport == "auto":
            return _vm_auto(opts)
        return transport.plan("none", ngl=opts.ngl, rpc_port=opts.rpc_port, gpu_devices=[], own_image=False)
    return transport.plan(opts.transport, ngl=opts.ngl, rpc_port=opts.rpc_port, gpu_devices=opts.gpu_devices,
                          own_image=opts.image is not None)


def _vm_auto(opts: ServeOptions) -> Plan:
    """`auto` in a VM apirctl starts: the VM has no GPU, so remoting is its only way to the host's; on
    emulation (TCG) the host's CPU also computes far faster than the VM's. A VM on KVM of a host without
    a GPU keeps its own CPU (remoting would move the work to the same cores). The notice says why."""
    none = transport.plan("none", ngl=opts.ngl, gpu_devices=[], own_image=False)
    try:
        build = None if host.is_macos() else llamacpp.current_build()
    except ApirctlError as exc:
        return none.model_copy(update={"notice": f"auto: the VM's own CPU ({exc.message})"})
    if build is None or not (build.bin_dir / backends.BINARY).exists():
        return none.model_copy(update={"notice": f"auto: the VM's own CPU (no host build with {backends.BINARY}: "
                                                 "`apirctl setup` makes one)"})
    remoting = transport.vm_rpc_plan(opts.ngl, vm.GUEST_RPC_ENDPOINT, requested="auto")
    if build.backend != "cpu":
        why = f"a VM has no GPU: remoting is its only way to the host's ({build.backend})"
        return remoting.model_copy(update={"notice": f"auto: rpc remoting, {why}"})
    accel = vm.choose(config.settings().vm_accel)
    if accel.name != "kvm":
        why = f"the VM runs on {accel.name} emulation, and the host's CPU computes its graphs far faster"
        return remoting.model_copy(update={"notice": f"auto: rpc remoting, {why}"})
    return none.model_copy(update={"notice": "auto: the VM's own CPU (the host has no GPU: remoting would move "
                                             "the work to the same cores)"})


@contextlib.contextmanager
def provision(opts: ServeOptions, progress: ProgressFn | None = None) -> Iterator[Provisioned]:
    """Everything before the container is created (see the module's docstring). `progress` is told each
    phase as it begins (model, ssh tunnels, rpc backend, apir host, image, then container, which the
    caller's create begins) and the status of an image pull or build; the yielded `clock` times them."""
    clock = PhaseClock(progress)
    phase = clock.phase
    if opts.restart:
        check_restart(opts.restart)
    port, claim = claim_port(opts.host_ip, opts.port, given=opts.port_given)  # held until the block ends
    notices = [f"port {opts.port} is in use: serving on {port} (--port picks one)"] if port != opts.port else []
    opts = opts.model_copy(update={"port": port})
    plan: Plan | None = None
    instance = apir = None
    region: vm.Region | None = None
    try:
        if opts.rpc_backends:
            if opts.isolation == "vm":
                raise ApirctlError("--isolation vm does not take --rpc-backend yet", hint="serve it in a container")
            _check_remote(opts)
        else:
            plan = local_plan(opts)
            _one_virtgpu_at_a_time(plan)
        phase("model")
        model: Served = resolve_models(opts) if opts.router else resolve_model(opts.model)
        api = containers.connect()
        name = _pick_name(opts, spec.display_name(model), api)
        if plan is None:
            if opts.via_ssh:
                phase("ssh tunnels")
            plan = _remote_plan(opts)
        if plan.needs_backend:  # a backend of its own, on its own socket
            phase("rpc backend")
            region = vm.Region.for_transport("rpc") if opts.isolation == "vm" else None  # the guest's rings
            instance = rpc_server.start_own_backend(name, opts.memory, region)  # the cap on what it shares and pins
            plan = transport.with_backend(plan, instance)
        if plan.needs_apir_host:  # Linux APIR: an apir-host of its own, on its own socket
            phase("apir host")
            if opts.isolation == "vm":  # the guest's resources, ranges of memory both map
                region = vm.Region.for_transport("virtgpu")
            apir = apir_hosts.start(llamacpp.require_build(), name, trace=opts.apir_trace,
                                    respawn=opts.restart not in (None, "no"), mem_cap=opts.memory, region=region,
                                    threads=config.settings().threads)
            plan = transport.with_apir_host(plan, apir)
        phase("image")
        image_ref = spec.image_for(opts, plan, progress, api)
        built = spec.container_spec(opts, plan, model, name, image_ref)
        built.labels[L_INPUTS] = spec.record(opts, model, image_ref)
        _, router_notice = spec.models_max(opts, plan) if opts.router else (None, None)
        notices += [n for n in (plan.notice, router_notice) if n]
        phase("container")
        yield Provisioned(opts=opts, plan=plan, model=model, name=name, image=image_ref, spec=built, api=api,
                          clock=clock, instance=instance, apir=apir, region=region, notices=notices)
    except BaseException:
        with uninterrupted():
            if plan is not None and plan.tunnels:  # a kept container cannot use them either: it has exited
                tunnel.close(plan.tunnels)
            if instance is not None:
                backends.stop(instance)
            if apir is not None:
                apir_hosts.stop(apir)
        raise
    finally:
        if region is not None:  # the backend and QEMU hold their own descriptors of it by now
            region.close()
        claim.release()


def _pick_name(opts: ServeOptions, model_name: str, api: PodmanApi) -> str:
    def exists(candidate: str) -> bool:
        return api.exists("containers", candidate) or vm.exists(candidate)

    if opts.name:
        if not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", opts.name):
            raise ApirctlError(f"invalid server name {opts.name!r}: use letters, digits, '_', '.' and '-'")
        if exists(opts.name):
            raise ApirctlError(f"a container named {opts.name} already exists",
                               hint=f"stop it with `apirctl stop {opts.name}` or pick another --name")
        return opts.name
    base = f"apirctl-{spec.slug(model_name)}"
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
