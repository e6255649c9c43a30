"""llama-bench in each mode, one after the other on the same model file, and the comparison rows.

- native: the host build's llama-bench on the host's best backend (the reference).
- remoting: llama-bench in the container, its GGML backend calls going to the host
  through the active transport (rpc on Linux, virtgpu on macOS). With the host client
  (`client="host"`, or where no container engine is installed) the host build's own
  llama-bench is the client instead, with its local GPUs hidden: the rpc path without
  the container's network, e.g. on a GPU machine that has no podman.
- container: llama-bench in the same container with no remoting (CPU only).

A mode that cannot run here (no build, no image, no remoting backend) becomes rows
with a `skipped_reason` and the others still run; a llama-bench that runs and fails is
a failure that the caller reports after showing what did run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apirctl.bench import MODES
from apirctl.bench.llamabench import Params, Result, arguments, run_process
from apirctl.bench.results import Row, Run, new_id, now_iso
from apirctl.errors import ApirctlError

#: Progress events: (mode, test or "" while starting, repetition (0 = warmup), repetitions).
EventFn = Callable[[str, str, int, int], None]


class Skipped(Exception):
    """A mode that cannot run on this host; the message says why (and how to enable it)."""


@dataclass
class ModeOutcome:
    mode: str
    results: list[Result] = field(default_factory=list)
    backend: str | None = None
    skipped: str | None = None
    failed: str | None = None
    client: str | None = None  # where llama-bench ran: "host" or "container"


@dataclass
class Context:
    """What the modes share: the model file, the parameters, and facts gathered on the way."""

    model_path: Path
    params: Params
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
    from apirctl import models

    found = models.resolve(ref, pull=True, quiet=True)
    label = Path(found.filename).name if found.source == "file" else found.name
    return ModelFile(label=label, path=found.path, filename=found.filename)


# --- the modes ------------------------------------------------------------------------------------


def _host_build() -> Any:
    from apirctl import llamacpp

    try:
        build = llamacpp.current_build()
    except ApirctlError as exc:
        raise Skipped(exc.message) from None
    if build is None:
        raise Skipped("llama.cpp is not built on this host (run `apirctl setup`)")
    return build


def run_native(ctx: Context) -> ModeOutcome:
    build = _host_build()
    ctx.facts.setdefault("host_backend", build.backend)
    ctx.facts.setdefault("llama_cpp", build.source_version)
    argv = [str(build.binary("llama-bench")), *arguments(str(ctx.model_path), ctx.params)]
    results = run_process(argv, ctx.params, ctx.progress("native"))
    return ModeOutcome("native", results, backend=_backend_label(results, build.backend), client="host")


def _image(ctx: Context) -> str:
    """The inference image (built on first use), or Skipped saying what is missing."""
    from apirctl import image, llamacpp

    try:
        build = llamacpp.container_build() or _host_build()
        tag = image.ensure(build)
    except ApirctlError as exc:
        raise Skipped(f"no inference image: {exc.message}") from None
    ctx.facts["image"] = tag
    return tag


def run_in_container(ctx: Context, mode: str, plan: Any | None = None) -> list[Result]:
    """llama-bench as a one-shot container with the model mounted read-only; no network unless a plan adds it."""
    from apirctl import engine
    from apirctl.bench.llamabench import ProgressReader, parse_mixed

    tag = plan.image if plan is not None and plan.image else _image(ctx)
    target = f"/models/{ctx.filename or ctx.model_path.name}"
    spec = engine.ContainerSpec(
        image=tag,
        entrypoint=["llama-bench"],  # on the image's PATH: apirctl's image and the bundles' images alike
        command=arguments(target, ctx.params, output="jsonl"),
        mounts=[engine.BindMount(source=ctx.model_path.resolve(), target=target, read_only=True)],
        network_mode="none",
        labels={"apirctl.role": "bench", "apirctl.bench.mode": mode},
    )
    if plan is not None:
        spec = plan.apply(spec)
    reader = ProgressReader(ctx.params, ctx.progress(mode))
    result = engine.run_once(spec, on_line=reader.feed)
    if result.exit_code != 0:
        raise ApirctlError(f"llama-bench in the container failed (exit {result.exit_code}): "
                           f"{reader.tail_text() or 'no output'}")
    return parse_mixed(result.output)


def run_container(ctx: Context) -> ModeOutcome:
    results = run_in_container(ctx, "container")
    return ModeOutcome("container", results, backend=_backend_label(results, "cpu"), client="container")


def run_remoting(ctx: Context) -> ModeOutcome:
    from apirctl import config, transport

    settings = config.settings()
    requested = settings.transport
    if requested == "none":
        raise Skipped("the transport setting is `none` (set it to auto, rpc or virtgpu)")
    client = ctx.client
    if client == "container" and shutil.which("podman") is None:
        client = "host"
        ctx.facts["client_note"] = "podman is not installed: the host build's llama-bench was the remoting client"
    door = None
    if client == "host":  # it dials the backend's 127.0.0.1 itself: no container network door is needed
        from apirctl.hostloopback import HostLoopback

        door = HostLoopback(mode="slirp4netns", why="unused: the host client dials 127.0.0.1")
    try:
        plan = transport.plan(requested, ngl=ctx.params.ngl, rpc_port=settings.rpc_port, loopback=door)
    except ApirctlError as exc:
        raise Skipped(exc.message + (f" ({exc.hint})" if exc.hint else "")) from None
    if not plan.remoting:
        status = transport.machine_status()
        why = status.summary if status else "no remoting backend on this host"
        step = (status.next_step if status else None) or "start one with `apirctl machine restart --remoting`"
        raise Skipped(f"remoting is not ready: {why} ({step})")
    status = transport.machine_status()
    if status is not None and status.state == 1:  # MachineState.SERVING
        users = status.details.get("serving") or "an inference server"
        raise Skipped(f"the remoting backend serves one client at a time and is in use by {users} "
                      f"(stop it with `apirctl stop` to bench remoting)")
    ctx.facts["transport"] = plan.transport
    if client == "host":
        if plan.transport != "rpc":
            raise Skipped(f"the host client reaches the backend over rpc only, not {plan.transport} "
                          f"(use --client container)")
        details = status.details if status is not None else {}
        results = run_host_client(ctx, str(details.get("host") or "127.0.0.1"),
                                  int(details.get("port") or settings.rpc_port))
    else:
        # llama-bench runs one test per value of a repeated flag: keep our own -ngl only.
        plan = plan.model_copy(update={"llama_args": without_flag(plan.llama_args, ("-ngl", "--n-gpu-layers"))})
        results = run_in_container(ctx, "remoting", plan)
    return ModeOutcome("remoting", results, backend=_backend_label(results, plan.transport), client=client)


#: Hide the host client's own GPUs, so that every offloaded layer goes to the remoting backend.
_NO_LOCAL_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}


def client_endpoint(host: str, port: int) -> str:
    """The address the host client dials: a backend bound to every address is reached on loopback."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_host_client(ctx: Context, host: str, port: int) -> list[Result]:
    """The host build's llama-bench as the rpc client (one -ngl: ours; one --rpc: the backend)."""
    build = _host_build()
    ctx.facts.setdefault("llama_cpp", build.source_version)
    extra = ["--rpc", client_endpoint(host, port)]
    argv = [str(build.binary("llama-bench")), *arguments(str(ctx.model_path), ctx.params, extra=extra)]
    return run_process(argv, ctx.params, ctx.progress("remoting"), env=dict(os.environ) | _NO_LOCAL_GPU)


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


RUNNERS: dict[str, Callable[[Context], ModeOutcome]] = {
    "native": run_native,
    "remoting": run_remoting,
    "container": run_container,
}


def _backend_label(results: list[Result], fallback: str) -> str:
    seen = [r.backends for r in results if r.backends]
    return seen[0] if seen else fallback


# --- the comparison -------------------------------------------------------------------------------


def rows_from(outcomes: list[ModeOutcome], params: Params) -> list[Row]:
    """Rows in mode order; each test's ratio is to the native row of the same test."""
    native = next((o for o in outcomes if o.mode == "native" and o.results), None)
    native_tps = {r.test: r.tps_mean for r in native.results} if native else {}
    rows: list[Row] = []
    for outcome in outcomes:
        if not outcome.results:
            reason = outcome.skipped or (f"failed: {outcome.failed}" if outcome.failed else "no results")
            rows += [Row(mode=outcome.mode, backend=outcome.backend, client=outcome.client, test=test,
                         skipped_reason=reason)
                     for test in params.tests()]
            continue
        for r in outcome.results:
            base = native_tps.get(r.test)
            rows.append(Row(
                mode=outcome.mode, backend=outcome.backend, client=outcome.client, test=r.test, tps_mean=r.tps_mean,
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


def run(model_ref: str, model_path: Path, modes: Sequence[str], params: Params,
        on_event: EventFn | None = None, filename: str | None = None, client: str = "container") -> Outcome:
    """Run the modes in order; a skipped mode does not stop the others, nor does a failed one.

    `client` picks where the remoting mode's llama-bench runs: "container" (the real path; the
    host when no container engine is installed) or "host" (the rpc path without a container).
    """
    from apirctl.bench import system

    params.validate()
    if client not in CLIENTS:
        raise ApirctlError(f"unknown remoting client {client!r} (known: {', '.join(CLIENTS)})")
    if not model_path.is_file():
        raise ApirctlError(f"model file {model_path} does not exist")
    ctx = Context(model_path=model_path, params=params, on_event=on_event, filename=filename or model_path.name,
                  client=client)
    outcomes: list[ModeOutcome] = []
    for mode in modes:
        if on_event:
            on_event(mode, "", 0, params.reps)
        try:
            outcomes.append(RUNNERS[mode](ctx))
        except Skipped as exc:
            outcomes.append(ModeOutcome(mode, skipped=str(exc)))
        except ApirctlError as exc:
            outcomes.append(ModeOutcome(mode, failed=exc.message))
    failures = [f"{o.mode}: {o.failed}" for o in outcomes if o.failed]
    raw = next((o.results[0].raw for o in outcomes if o.mode == "native" and o.results), None)
    raw = raw or next((o.results[0].raw for o in outcomes if o.results), None)
    info = system.collect(raw, host_backend=ctx.facts.get("host_backend"), transport=ctx.facts.get("transport"),
                          image=ctx.facts.get("image"), llama_cpp=ctx.facts.get("llama_cpp"))
    if ctx.facts.get("client_note"):
        info.extra["remoting_client"] = ctx.facts["client_note"]
    bench_run = Run(
        id=new_id(), created=now_iso(), kind="llama-bench", model=model_ref, model_file=str(model_path),
        params={"pp": params.pp, "tg": params.tg, "reps": params.reps, "ngl": params.ngl,
                "threads": params.threads, "modes": list(modes), "client": client},
        system=info, rows=rows_from(outcomes, params),
    )
    return Outcome(bench_run, failures)
