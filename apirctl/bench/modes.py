"""A llama.cpp program in each mode, one after the other on the same model file, and bench's rows.

The modes decide where the program runs and how it reaches the GPU; the program (a `Program`:
llama-bench for `apirctl bench`, llama-perplexity for `apirctl perplexity`) decides its arguments
and reads its output, so both commands share one definition of each mode.

- native: the host build's llama-bench on the host's best backend (the reference).
- remoting: llama-bench in the container, its GGML backend calls going to the host
  through the active transport (rpc on Linux, virtgpu on macOS). Where the host backend
  listens on a Unix socket, the run gets a backend of its own on its own socket (so it runs
  beside inference servers, and the container has no network at all); its rows say which link
  ran: rpc-shm (shared memory), rpc-unix, or rpc-tcp (the shared TCP backend, which serves one
  client at a time, so that mode is skipped while a server uses it). With the host client
  (`client="host"`, or where no container engine is installed) the host build's own
  llama-bench is the client instead, with its local GPUs hidden: the rpc path without
  the container's network, e.g. on a GPU machine that has no podman.
- container: llama-bench in a container with no remoting: with GPU passthrough where this host
  can hand its GPU to a container (`apirctl.gpu`: the comparison a Linux user makes), else CPU only.
- apir (Linux): llama-bench with the ggml-virtgpu frontend against an apir-host of its own on a
  private socket (`apirctl.remoting.apir_hosts`, the host build's GPU backend, else its CPU one):
  in a container with no network (the virtgpu transport's wiring), or with the host client the
  host build's own llama-bench with `GGML_VIRTGPU_SOCKET` and its local GPUs hidden. On macOS the
  remoting mode is APIR already.
- vm-cpu, vm-remoting, vm-apir (Linux): llama-bench in a micro-VM of its own booted from the inference
  image (`apirctl.vm`, on KVM where it runs guests, else emulated): on the VM's own CPU, or through a
  backend (vm-remoting) or an apir-host (vm-apir) of its own on the host, reached by the VM's one way
  out (its relay) and the memory it shares with it. The seeds' Lima comparison: a VM without a GPU,
  on its CPU and through remoting, against native.

A mode that cannot run here (no build, no image, no remoting backend) becomes rows
with a `skipped_reason` and the others still run; a llama-bench that runs and fails is
a failure that the caller reports after showing what did run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Generic, Literal, Protocol, TypeVar

from apirctl import config, gpu, host, models, vm
from apirctl.bench import MODES, system
from apirctl.bench.llamabench import LlamaBench, Params, ProgressFn, Result
from apirctl.bench.results import Row, Run, SystemInfo, new_id, now_iso
from apirctl.build import image, llamacpp
from apirctl.errors import ApirctlError
from apirctl.podman import containers
from apirctl.remoting import apir_hosts, backends, hostloopback, rpc_server, transport
from apirctl.remoting.hostloopback import HostLoopback

#: Progress events: (mode, test or "" while starting, repetition (0 = warmup), repetitions).
EventFn = Callable[[str, str, int, int], None]


class Skipped(Exception):
    """A mode that cannot run on this host; the message says why (and how to enable it)."""


class Backends(Protocol):
    """A program's result that may name the backends it ran on (llama-bench's do)."""

    @property
    def backends(self) -> str: ...


R = TypeVar("R", bound=Backends)


class LineReader(Protocol):
    """Reads a program's output lines as they come (progress) and keeps a tail for errors."""

    def feed(self, line: str) -> None: ...

    def tail_text(self, lines: int = 5) -> str: ...


class Program(Protocol[R]):
    """What the modes need of the program they run: its name (on the host build and on the image's
    PATH), its arguments, how to run it on the host and how to read its output from a container."""

    @property
    def executable(self) -> str: ...

    @property
    def ngl(self) -> int: ...

    def arguments(self, model: str, mode: str, in_container: bool, extra: Sequence[str] = ()) -> list[str]: ...

    def mounts(self) -> list[containers.BindMount]: ...

    def reader(self, on_progress: ProgressFn | None) -> LineReader: ...

    def run_host(self, argv: Sequence[str], on_progress: ProgressFn | None,
                 env: dict[str, str] | None = None) -> list[R]: ...

    def parse_output(self, output: str) -> list[R]: ...


@dataclass
class ModeOutcome(Generic[R]):
    mode: str
    results: list[R] = field(default_factory=list)
    backend: str | None = None
    skipped: str | None = None
    failed: str | None = None
    client: str | None = None  # where llama-bench ran: "host" or "container"
    transport: str | None = None  # remoting: what ran (rpc-shm, rpc-unix, rpc-tcp, virtgpu)


@dataclass
class Context(Generic[R]):
    """What the modes share: the model file, the program, and facts gathered on the way."""

    model_path: Path
    program: Program[R]
    filename: str = ""
    on_event: EventFn | None = None
    client: str = "container"  # the remoting client: "container" or "host"
    facts: dict[str, Any] = field(default_factory=dict)

    def progress(self, mode: str) -> Callable[[str, int, int], None]:
        def emit(test: str, rep: int, reps: int) -> None:
            if self.on_event:
                self.on_event(mode, test, rep, reps)

        return emit


def parse_modes(text: str | Sequence[str]) -> list[str]:
    """`native,remoting` -> ["native", "remoting"]; unknown names are a one-line error."""
    items = text.split(",") if isinstance(text, str) else list(text)
    modes: list[str] = []
    for item in (i.strip().lower() for i in items):
        if not item:
            continue
        if item not in MODES:
            raise ApirctlError(f"unknown bench mode {item!r} (known: {', '.join(MODES)})")
        if item not in modes:
            modes.append(item)
    if not modes:
        raise ApirctlError(f"no bench mode given (known: {', '.join(MODES)})")
    return modes


@dataclass(frozen=True)
class ModelFile:
    """The model to bench: a display label, the local GGUF, and its original file name."""

    label: str
    path: Path
    filename: str


def model_file(ref: str) -> ModelFile:
    """Resolve a model reference through the model store (which fetches what is missing)."""
    found = models.resolve(ref, pull=True)
    label = Path(found.filename).name if found.source == "file" else found.name
    return ModelFile(label=label, path=found.path, filename=found.filename)


# --- the modes ------------------------------------------------------------------------------------


def _host_build() -> Any:
    try:
        build = llamacpp.current_build()
    except ApirctlError as exc:
        raise Skipped(exc.message) from None
    if build is None:
        raise Skipped("llama.cpp is not built on this host (run `apirctl setup`)")
    return build


def run_native(ctx: Context[R]) -> ModeOutcome[R]:
    build = _host_build()
    ctx.facts.setdefault("host_backend", build.backend)
    ctx.facts.setdefault("llama_cpp", build.source_version)
    program = ctx.program
    argv = [str(build.binary(program.executable)), *program.arguments(str(ctx.model_path), "native", False)]
    results = program.run_host(argv, ctx.progress("native"))
    return ModeOutcome("native", results, backend=_backend_label(results, build.backend), client="host")


def _image(ctx: Context[Any]) -> str:
    """The inference image (built on first use), or Skipped saying what is missing."""
    try:
        build = llamacpp.container_build() or _host_build()
        tag = image.ensure(build)
    except ApirctlError as exc:
        raise Skipped(f"no inference image: {exc.message}") from None
    ctx.facts["image"] = tag
    return tag


def run_in_container(ctx: Context[R], mode: str, plan: Any | None = None) -> list[R]:
    """The program as a one-shot container with the model mounted read-only; no network unless a plan adds it."""
    if plan is not None and plan.image:
        tag = plan.image
    elif plan is not None and plan.image_backend:
        tag = _gpu_image(ctx, plan.image_backend)
    else:
        tag = _image(ctx)
    target = f"/models/{ctx.filename or ctx.model_path.name}"
    program = ctx.program
    spec = containers.ContainerSpec(
        image=tag,
        entrypoint=[program.executable],  # on the image's PATH: apirctl's image and the bundles' images alike
        command=program.arguments(target, mode, True),
        mounts=[containers.BindMount(source=ctx.model_path.resolve(), target=target, read_only=True),
                *program.mounts()],
        network_mode="none",
        labels={"apirctl.role": "bench", "apirctl.bench.mode": mode},
    )
    if plan is not None:
        spec = plan.apply(spec)
    reader = program.reader(ctx.progress(mode))
    result = containers.run_once(spec, on_line=reader.feed)
    if result.exit_code != 0:
        raise ApirctlError(f"{program.executable} in the container failed (exit {result.exit_code}): "
                           f"{reader.tail_text() or 'no output'}")
    return program.parse_output(result.output)


def run_container(ctx: Context[R]) -> ModeOutcome[R]:
    plan = _passthrough_plan(ctx)
    results = run_in_container(ctx, "container", plan)
    fallback = (plan.image_backend or "gpu") if plan is not None else "cpu"
    return ModeOutcome("container", results, backend=_backend_label(results, fallback), client="container")


def _passthrough_plan(ctx: Context[Any]) -> Any | None:
    """The gpu transport's wiring where this host can give a container its GPU, else None (CPU)."""
    if host.is_macos():
        return None
    offer = gpu.facts(hostloopback.containers_elsewhere())[-1]
    if not isinstance(offer, gpu.Passthrough):
        ctx.facts["container_note"] = f"CPU only: no GPU passthrough ({offer.reason})"
        return None
    ctx.facts["container_note"] = f"GPU passthrough: {offer.what}"
    plan = transport.gpu_plan(offer, ctx.program.ngl)
    return plan.model_copy(update={"llama_args": without_flag(plan.llama_args, ("-ngl", "--n-gpu-layers"))})


def _gpu_image(ctx: Context[Any], backend: str) -> str:
    """The passthrough image of a GPU backend (built on first use)."""
    build = gpu.gpu_builds().get(backend)
    if build is None:
        raise Skipped(f"no llama.cpp build with the {backend} backend for the passthrough image")
    tag = image.ensure(build)
    ctx.facts["image"] = tag
    return tag


def run_remoting(ctx: Context[R]) -> ModeOutcome[R]:
    settings = config.settings()
    requested = settings.transport
    if requested == "none":
        raise Skipped("the transport setting is `none` (set it to auto, rpc or virtgpu)")
    client = ctx.client
    if client == "container" and shutil.which("podman") is None:
        client = "host"
        ctx.facts["client_note"] = (f"podman is not installed: the host build's {ctx.program.executable} was the "
                                    f"remoting client")
    door = None
    if client == "host":  # it dials the backend's 127.0.0.1 itself: no container network door is needed

        door = HostLoopback(mode="slirp4netns", why="unused: the host client dials 127.0.0.1")
    no_passthrough = gpu.Blocked(reason="the remoting mode measures remoting (the container mode is passthrough)")
    if requested in ("auto", "gpu"):  # this platform's remoting, even where `auto` would not serve with it
        requested = "virtgpu" if host.is_macos() else "rpc"
    try:
        plan = transport.plan(requested, ngl=ctx.program.ngl, rpc_port=settings.rpc_port, loopback=door,
                              offer=no_passthrough)
    except ApirctlError as exc:
        raise Skipped(exc.message + (f" ({exc.hint})" if exc.hint else "")) from None
    status = transport.machine_status()
    if plan.rpc_link == "tcp" and status is not None and status.state == 1:  # MachineState.SERVING
        users = status.details.get("serving") or "an inference server"
        raise Skipped(f"the TCP remoting backend serves one client at a time and is in use by {users} "
                      f"(stop it with `apirctl stop`, or listen on a Unix socket: "
                      f"`apirctl machine restart --remoting --listen unix`)")
    ctx.facts["transport"] = plan.transport
    device = str(status.details.get("device") or "") if status is not None and plan.transport == "rpc" else ""
    if gpu.backend_on_cpu(device):
        ctx.facts["remoting_note"] = (f"the remoting backend computes on the CPU ({gpu.device_names(device)}): on this "
                                      f"host the remoting row measures the transport, not a speed-up")
    if client == "host" and plan.transport != "rpc":
        raise Skipped(f"the host client reaches the backend over rpc only, not {plan.transport} "
                      f"(use --client container)")
    instance = rpc_server.start_own_backend(f"bench-{new_id()}") if plan.needs_backend else None
    try:
        if client == "host":
            if instance is not None:
                endpoint = instance.endpoint
            else:
                details = status.details if status is not None else {}
                endpoint = client_endpoint(str(details.get("host") or "127.0.0.1"),
                                           int(details.get("port") or settings.rpc_port))
            results = run_host_client(ctx, endpoint)
        else:
            if instance is not None:
                plan = transport.with_backend(plan, instance)
            # llama-bench runs one test per value of a repeated flag: keep our own -ngl only.
            plan = plan.model_copy(update={"llama_args": without_flag(plan.llama_args, ("-ngl", "--n-gpu-layers"))})
            results = run_in_container(ctx, "remoting", plan)
        link: str = plan.rpc_link
        if instance is not None:
            link = backends.confirm_link(instance, release=False).link
    finally:
        if instance is not None:
            backends.stop(instance)
    ran = f"{plan.transport}-{link}" if link else plan.transport
    return ModeOutcome("remoting", results, backend=_backend_label(results, plan.transport), client=client,
                       transport=ran)


#: Hide the host client's own GPUs, so that every offloaded layer goes to the remoting backend.
_NO_LOCAL_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}


def client_endpoint(host: str, port: int) -> str:
    """The address the host client dials: a backend bound to every address is reached on loopback."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_host_client(ctx: Context[R], endpoint: str) -> list[R]:
    """The host build's program as the rpc client (one -ngl: ours; one --rpc: the backend's
    `HOST:PORT` or `unix:PATH`)."""
    build = _host_build()
    ctx.facts.setdefault("llama_cpp", build.source_version)
    program = ctx.program
    extra = ["--rpc", endpoint]
    argv = [str(build.binary(program.executable)),
            *program.arguments(str(ctx.model_path), "remoting", False, extra=extra)]
    return program.run_host(argv, ctx.progress("remoting"), env=dict(os.environ) | _NO_LOCAL_GPU)


def without_flag(args: Sequence[str], names: tuple[str, ...]) -> list[str]:
    """`args` without the given flags and their values (`--flag V` and `--flag=V`)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in names:
            skip = True
            continue
        if any(arg.startswith(name + "=") for name in names):
            continue
        out.append(arg)
    return out


def run_apir(ctx: Context[R]) -> ModeOutcome[R]:
    """APIR on Linux: the frontend against an apir-host of the run's own (see the module's docstring)."""
    if host.is_macos():
        raise Skipped("on macOS the remoting mode is APIR (virtgpu through krunkit)")
    build = _host_build()
    client = ctx.client
    if client == "container" and shutil.which("podman") is None:
        client = "host"
        ctx.facts["client_note"] = (f"podman is not installed: the host build's {ctx.program.executable} was the "
                                    f"remoting client")
    client_build = build if client == "host" else llamacpp.container_build()
    problem = transport.apir_problem(build, client_build)
    if problem:
        raise Skipped(f"APIR cannot run here: {problem}")
    ctx.facts.setdefault("llama_cpp", build.source_version)
    apir = apir_hosts.start(build, f"bench-{new_id()}", threads=config.settings().threads)
    try:
        if client == "host":
            env = dict(os.environ) | _NO_LOCAL_GPU | {apir_hosts.SOCKET_ENV: str(apir.socket)}
            program = ctx.program
            argv = [str(build.binary(program.executable)), *program.arguments(str(ctx.model_path), "apir", False)]
            results = program.run_host(argv, ctx.progress("apir"), env=env)
        else:
            plan = transport.with_apir_host(transport.apir_plan(ctx.program.ngl), apir)
            plan = plan.model_copy(update={"llama_args": without_flag(plan.llama_args, ("-ngl", "--n-gpu-layers"))})
            results = run_in_container(ctx, "apir", plan)
        died = apir_hosts.problem(apir.id)
    finally:
        apir_hosts.stop(apir)
    if died:  # llama-bench may report results of a host that died after them: the run is not sound
        raise ApirctlError(f"the apir-host died during the run: {died}")
    return ModeOutcome("apir", results, backend=_backend_label(results, "virtgpu", apir=True), client=client,
                       transport="virtgpu-socket")


#: How long a VM mode's program may run (an emulated VM computes at a few tokens a second), and its
#: VM's memory (MiB): `serve --isolation vm`'s default, or the model's size and a GiB more.
VM_TIMEOUT = 3600.0
VM_MEMORY_MB = 2048


def run_in_vm(ctx: Context[R], mode: str, remoting: Literal["", "rpc", "apir"]) -> ModeOutcome[R]:
    """The program in a micro-VM of its own (`apirctl.vm`, as `serve --isolation vm` boots one), from the
    inference image, the model its second disk: on the VM's own CPU (vm-cpu), or with its graphs
    computed on the host by a backend of its own (vm-remoting, rpc) or an apir-host of its own
    (vm-apir), reached through the VM's relay and the memory it shares with it. The VM publishes
    nothing; the program's end powers it off, and its console holds the results."""
    if host.is_macos():
        raise Skipped("the VM modes run on Linux (on macOS the containers run in a VM already)")
    if ctx.program.mounts():
        raise Skipped(f"a VM gets the model as its only file, and {ctx.program.executable} needs more")
    try:
        accel = vm.choose(config.settings().vm_accel)
        tag = _image(ctx)
        build = llamacpp.container_build()
        native = build is not None and build.options is not None and build.options.native
        if problem := vm.build_problem(accel, native):
            raise Skipped(f"{problem} ({vm.BUILD_HINT})")
        if remoting == "apir" and (problem := transport.apir_problem(_host_build(), build)):
            raise Skipped(f"APIR cannot run here: {problem}")
        boot = vm.ensure_boot_files()
        rootfs = vm.ensure_rootfs(tag)
    except ApirctlError as exc:
        raise Skipped(exc.message + (f" ({exc.hint})" if exc.hint else "")) from None
    ctx.facts["vm_note"] = f"{accel.name}" + ("" if accel.name == "kvm" else f": {accel.why}")
    program = ctx.program
    folder = str(PurePosixPath(rootfs.entrypoint[0]).parent) if rootfs.entrypoint else ""
    executable = f"{folder}/{program.executable}" if folder.startswith("/") else program.executable
    filename = ctx.filename or ctx.model_path.name
    extra = ["--rpc", vm.GUEST_RPC_ENDPOINT] if remoting == "rpc" else []
    argv = [executable, *program.arguments(f"/models/{filename}", mode, True, extra=extra)]
    env = dict(rootfs.env)
    name = f"bench-{new_id()}"
    # the memory the VM shares with its host process: RPC's rings, or APIR's resources
    region = vm.Region.for_transport("virtgpu" if remoting == "apir" else "rpc") if remoting else None
    instance = apir = None
    try:
        if remoting == "rpc":
            instance = rpc_server.start_own_backend(name, region=region)
        elif remoting == "apir":
            apir = apir_hosts.start(_host_build(), name, region=region, threads=config.settings().threads)
            env |= transport.vm_apir_plan(program.ngl, vm.GUEST_RPC_ENDPOINT).environment
    except BaseException:
        if region is not None:
            region.close()
        raise
    record = vm.VmRecord(name=name, id=secrets.token_hex(32), labels={"apirctl.role": "bench",
                         "apirctl.bench.mode": mode}, image=tag, port=0, created=time.time(), accel=accel.name,
                         memory_mb=max(VM_MEMORY_MB, (ctx.model_path.stat().st_size >> 20) + 1024),
                         cpus=os.cpu_count() or 1, rpc_instance=instance.id if instance else "",
                         apir_host=apir.id if apir else "")
    try:
        record = vm.launch(record, boot, rootfs, ctx.model_path, argv, env, 0, "", model_file=filename,
                           region=region)
        instance = apir = None  # the VM's relay owns them now, and stops them with the VM
        reader = program.reader(ctx.progress(mode))
        console = vm.follow_to_end(record, VM_TIMEOUT, on_line=reader.feed)
        why = vm.ended(record.name)
    finally:
        vm.remove(record.name)
        if instance is not None:
            backends.stop(instance)
        if apir is not None:
            apir_hosts.stop(apir)
        if region is not None:
            region.close()
    results = program.parse_output(console)
    if not results:  # (a relay notes why it ended the VM also when QEMU was already on its way out)
        raise ApirctlError(f"{program.executable} in the VM gave no results{' (ended: ' + why + ')' if why else ''}: "
                           f"{reader.tail_text() or 'no output'}")
    if remoting == "apir":  # its resources are ranges of the VM's shared memory (llama_patches/ 0025)
        return ModeOutcome(mode, results, backend=_backend_label(results, "virtgpu", apir=True), client="vm",
                           transport="virtgpu-vm-region")
    # the guest's rings in the VM's shared memory (llama_patches/ 0024: its llama.cpp says so), or every
    # byte through the relay
    in_region = backends.SHM_LOG_LINE in console
    label = ("rpc-vm-region" if in_region else "rpc-vm-relay") if remoting else None
    return ModeOutcome(mode, results, backend=_backend_label(results, "rpc" if remoting else "cpu"), client="vm",
                       transport=label)


def run_vm_cpu(ctx: Context[R]) -> ModeOutcome[R]:
    return run_in_vm(ctx, "vm-cpu", remoting="")


def run_vm_remoting(ctx: Context[R]) -> ModeOutcome[R]:
    return run_in_vm(ctx, "vm-remoting", remoting="rpc")


def run_vm_apir(ctx: Context[R]) -> ModeOutcome[R]:
    return run_in_vm(ctx, "vm-apir", remoting="apir")


RUNNERS: dict[str, Callable[[Context[Any]], ModeOutcome[Any]]] = {
    "native": run_native,
    "remoting": run_remoting,
    "container": run_container,
    "apir": run_apir,
    "vm-cpu": run_vm_cpu,
    "vm-remoting": run_vm_remoting,
    "vm-apir": run_vm_apir,
}


#: llama-bench names every backend registered, and the ggml-virtgpu frontend registers itself also
#: when no socket is given (then it has no device): only the apir mode runs on it.
_IDLE_FRONTEND = "ggml-virtgpu"


def _backend_label(results: Sequence[Backends], fallback: str, apir: bool = False) -> str:
    seen = [r.backends for r in results if r.backends]
    if not seen:
        return fallback
    names = [n for n in seen[0].split(",") if apir or n != _IDLE_FRONTEND]
    return ",".join(names) or fallback


# --- the comparison -------------------------------------------------------------------------------


def rows_from(outcomes: list[ModeOutcome[Result]], params: Params) -> list[Row]:
    """Rows in mode order; each test's ratio is to the native row of the same test."""
    native = next((o for o in outcomes if o.mode == "native" and o.results), None)
    native_tps = {r.test: r.tps_mean for r in native.results} if native else {}
    rows: list[Row] = []
    for outcome in outcomes:
        if not outcome.results:
            reason = outcome.skipped or (f"failed: {outcome.failed}" if outcome.failed else "no results")
            rows += [Row(mode=outcome.mode, backend=outcome.backend, client=outcome.client, test=test,
                         transport=outcome.transport, skipped_reason=reason)
                     for test in params.tests()]
            continue
        for r in outcome.results:
            base = native_tps.get(r.test)
            rows.append(Row(
                mode=outcome.mode, backend=outcome.backend, client=outcome.client, transport=outcome.transport,
                test=r.test, tps_mean=r.tps_mean,
                tps_std=r.tps_std, ratio_to_native=(r.tps_mean / base) if base else None,
                samples_ts=r.samples_ts, n_gpu_layers=r.n_gpu_layers, n_threads=r.n_threads,
            ))
    return rows


@dataclass
class Outcome:
    """A finished benchmark: the run to print and save, and what failed (not merely skipped)."""

    run: Run
    failures: list[str]


CLIENTS = ("container", "host")


def check_inputs(model_path: Path, client: str) -> None:
    """What every run needs before any mode starts: a known remoting client and the model file."""
    if client not in CLIENTS:
        raise ApirctlError(f"unknown remoting client {client!r} (known: {', '.join(CLIENTS)})")
    if not model_path.is_file():
        raise ApirctlError(f"model file {model_path} does not exist")


def run_modes(ctx: Context[R], modes: Sequence[str]) -> list[ModeOutcome[R]]:
    """Run the program in each mode, in order; a skipped mode does not stop the others, nor does a failed one."""
    outcomes: list[ModeOutcome[R]] = []
    for mode in modes:
        if ctx.on_event:
            ctx.on_event(mode, "", 0, 0)
        try:
            outcomes.append(RUNNERS[mode](ctx))
        except Skipped as exc:
            outcomes.append(ModeOutcome(mode, skipped=str(exc)))
        except ApirctlError as exc:
            outcomes.append(ModeOutcome(mode, failed=exc.message))
    return outcomes


def system_info(ctx: Context[Any], raw: dict[str, Any] | None = None) -> SystemInfo:
    """Where the numbers came from, with the notes the modes left on the way."""
    info = system.collect(raw, host_backend=ctx.facts.get("host_backend"), transport=ctx.facts.get("transport"),
                          image=ctx.facts.get("image"), llama_cpp=ctx.facts.get("llama_cpp"))
    if ctx.facts.get("client_note"):
        info.extra["remoting_client"] = ctx.facts["client_note"]
    if ctx.facts.get("container_note"):
        info.extra["container"] = ctx.facts["container_note"]
    if ctx.facts.get("remoting_note"):
        info.extra["remoting"] = ctx.facts["remoting_note"]
    if ctx.facts.get("vm_note"):
        info.extra["vm"] = ctx.facts["vm_note"]
    return info


def run(model_ref: str, model_path: Path, modes: Sequence[str], params: Params,
        on_event: EventFn | None = None, filename: str | None = None, client: str = "container") -> Outcome:
    """llama-bench in each mode (see `run_modes`).

    `client` picks where the remoting mode's llama-bench runs: "container" (the real path; the
    host when no container engine is installed) or "host" (the rpc path without a container).
    """
    params.validate()
    check_inputs(model_path, client)
    ctx: Context[Result] = Context(model_path=model_path, program=LlamaBench(params), on_event=on_event,
                                   filename=filename or model_path.name, client=client)
    outcomes = run_modes(ctx, modes)
    failures = [f"{o.mode}: {o.failed}" for o in outcomes if o.failed]
    raw = next((o.results[0].raw for o in outcomes if o.mode == "native" and o.results), None)
    raw = raw or next((o.results[0].raw for o in outcomes if o.results), None)
    bench_run = Run(
        id=new_id(), created=now_iso(), kind="llama-bench", model=model_ref, model_file=str(model_path),
        params={"pp": params.pp, "tg": params.tg, "reps": params.reps, "ngl": params.ngl,
                "threads": params.threads, "modes": list(modes), "client": client},
        system=system_info(ctx, raw), rows=rows_from(outcomes, params),
    )
    return Outcome(bench_run, failures)
