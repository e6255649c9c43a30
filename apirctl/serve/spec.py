"""The container spec of a server, built one way: from the serve options, the transport's plan, the
model (or a router's set) and the image. `apirctl serve` creates it, `--generate` writes it down, and
`apirctl restart` builds it again (from the inputs recorded in its label) when the host backend moved.

A server is a Podman container running llama-server with the model mounted read-only and its port
published on the host's loopback by default (the upstream extension publishes on every interface;
an inference API without a key should not be reachable from the network).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from apirctl import __version__, gpu, models
from apirctl.build import image, llamacpp
from apirctl.errors import MISSING, ApirctlError
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
    L_INPUTS,
    L_ISOLATION,
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
)
from apirctl.serve.inputs import ModelFile, ModelSet, ServeOptions, publish_ip, server_url
from apirctl.serve.units import check_restart

if TYPE_CHECKING:
    from apirctl.remoting.transport import Plan


CONTAINER_PORT = 8000


#: Where a router listens inside its container behind apirctl-front, which holds CONTAINER_PORT.
ROUTER_PORT = 8001


MODELS_DIR = "/models"


DOCS_URL = "https://github.com/ggml-org/llama.cpp/tree/master/tools/server"


ProgressFn = Callable[[str], None]
#: What a server serves: one model, or (router mode) a set of them.
Served = ModelFile | ModelSet


def image_for(opts: ServeOptions, plan: Plan, on_status: ProgressFn | None, api: PodmanApi) -> str:
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


def labels_for(opts: ServeOptions, plan: Plan, model_path: Path, model_name: str, kind: str = "chat",
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
    if opts.isolation == "vm":
        remote[L_ISOLATION] = "vm"
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


def router_command(opts: ServeOptions, plan: Plan, behind_front: bool = False) -> list[str]:
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


def router_mounts(chosen: ModelSet) -> list[BindMount]:
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


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "model"


def display_name(model: Served) -> str:
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


def container_spec(opts: ServeOptions, plan: Plan, model: Served, name: str, image_ref: str) -> ContainerSpec:
    """The container `serve` runs (also what `--generate` writes down): one model, or the router over a set."""
    default = None
    if isinstance(model, ModelSet):
        default = _router_default(opts, model, image_ref)
        command = router_command(opts, plan, behind_front=default is not None)
        first = model.directory / "model.gguf" if model.directory is not None else model.models[0].path
        labels = labels_for(opts, plan, first, model.label, default_model=default)
        mounts = router_mounts(model)
    else:
        command = _llama_command(opts, model.filename, model.name) + _model_args(opts, model)
        labels = labels_for(opts, plan, model.path, model.name, model.kind)
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


def target(plan: Plan) -> str:
    args = plan.llama_args
    return args[args.index("--rpc") + 1] if "--rpc" in args[:-1] else ""


class Recorded(BaseModel):
    """What a started container was built from, kept in its L_INPUTS label, so that `apirctl restart`
    builds its spec again the one way (`container_spec`) with the rpc wiring of the moment."""

    options: ServeOptions
    model: ModelFile | None = None
    models: ModelSet | None = None
    image: str

    @property
    def served(self) -> Served:
        served = self.models if self.models is not None else self.model
        if served is None:
            raise ApirctlError("the container's recorded inputs name no model")
        return served


def record(opts: ServeOptions, model: Served, image_ref: str) -> str:
    """The L_INPUTS label of a container `serve` starts (JSON)."""
    served = {"models": model} if isinstance(model, ModelSet) else {"model": model}
    return Recorded(options=opts, image=image_ref, **served).model_dump_json(exclude_none=True)


def recorded(labels: dict[str, str], name: str) -> Recorded:
    """The inputs a container was started with, from its labels; a one-line error for a container an
    older apirctl started (it has none)."""
    text = labels.get(L_INPUTS)
    if not text:
        raise ApirctlError(f"{name} was started by an older apirctl and cannot be made again",
                           hint=f"stop it and serve it again: `apirctl stop {name}`, then `apirctl serve ...`")
    try:
        return Recorded.model_validate_json(text)
    except ValueError as exc:
        raise ApirctlError(f"the recorded inputs of {name} do not read ({exc.__class__.__name__})",
                           hint=f"stop it and serve it again: `apirctl stop {name}`") from None
