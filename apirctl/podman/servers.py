"""apirctl's inference servers as Podman knows them: the labels a server container carries, and
the listing made from those labels alone.

It needs only Podman, so `apirctl.serve` (ps, chat, stop) and the machine backends (which servers
use the host's remoting) list servers the same way. Servers started by the upstream Podman Desktop
extension carry its labels and are found too. Health is not asked here (that is an HTTP call to
the server, `apirctl.serve.health`).
"""

from __future__ import annotations

import contextlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from apirctl.podman import containers

# Our labels (the key `apirctl.version` marks a container as ours).
L_VERSION = "apirctl.version"
L_MODEL = "apirctl.model"
L_KIND = "apirctl.model-kind"  # chat, embedding or reranking: what the server answers
L_TRANSPORT = "apirctl.transport"
L_HOST_IP = "apirctl.host-ip"
L_RPC_BACKENDS = "apirctl.rpc-backends"  # --rpc-backend addresses, comma-separated, as given
L_RPC_TARGET = "apirctl.rpc-target"  # the --rpc address(es) llama-server was given, as the container sees them
L_VIA_SSH = "apirctl.via-ssh"
L_TUNNELS = "apirctl.ssh-tunnels"  # pids of the SSH tunnels this server uses (closed by `stop`)
L_RPC_LINK = "apirctl.rpc-link"  # rpc: unix (a backend of its own, on a mounted socket) or tcp
L_RPC_INSTANCE = "apirctl.rpc-instance"  # rpc: the backend instance it was started against (random per start)
L_ROUTER = "apirctl.router"  # "true": llama-server's router mode, several models (L_MODEL names them, comma-separated)
L_MODELS_DIR = "apirctl.models-dir"  # router: the host directory it lists, when given instead of models
L_DEFAULT_MODEL = "apirctl.default-model"  # router: the model a request that names none goes to
L_INPUTS = "apirctl.serve-inputs"  # JSON: the options, model and image it was built from (restart builds it again)
L_ISOLATION = "apirctl.isolation"  # vm: a QEMU micro-VM (apirctl.vm), not a container; absent: a container
L_APIR_HOST = "apirctl.apir-host"  # virtgpu on Linux: the id of its own apir-host (apirctl.remoting.apir_hosts)
# Labels of the upstream Podman Desktop extension and Podman AI Lab.
L_APIR = "llama-cpp.apir"
L_API = "api"
L_AI_LAB = "ai-lab-inference-server"
L_GPU = "gpu"
L_DOCS = "docs"
L_TRACKING = "trackingId"

GPU_LABELS = {"virtgpu": "llama.cpp API Remoting", "rpc": "llama.cpp RPC remoting", "gpu": "llama.cpp GPU passthrough",
              "none": "none (container CPU)"}
RUNNING = ("running",)
STARTING = ("created", "configured", "initialized")


class Server(BaseModel):
    """One inference server as `ps`, `chat` and `bench` see it."""

    name: str
    id: str
    model: str
    transport: str
    url: str  # the OpenAI base URL, .../v1
    state: str  # podman's: running, exited, created...
    health: str  # ok, loading, error, unreachable, or "-" when not running (or not asked)
    port: int | None
    created: datetime | None = None
    image: str = ""
    managed: bool = True  # False for servers of the upstream extension
    rpc_backends: list[str] = Field(default_factory=list)  # explicit --rpc-backend addresses
    tunnels: list[int] = Field(default_factory=list)  # pids of its SSH tunnels
    rpc_target: str = ""  # the --rpc value it runs with (which backend it holds)
    kind: str = "chat"  # chat, embedding or reranking
    rpc_link: str = ""  # rpc: tcp, unix, or shm (unix upgraded to shared memory, known from the backend)
    rpc_instance: str = ""  # rpc: the backend instance it was started against
    apir_host: str = ""  # virtgpu on Linux: its own apir-host's id
    isolation: str = "container"  # or vm: a QEMU micro-VM apirctl started (apirctl.vm)
    started: float | None = None  # when its container last started (Unix seconds), where Podman says
    exit_code: int | None = None  # Podman's, for a container that exited
    why: str = ""  # why it does not serve, when apirctl knows: a health problem, or what it exited of
    router: bool = False  # several models behind one endpoint (llama-server's router mode)
    models_dir: str = ""  # router: the host directory it lists, when it was given one
    models: dict[str, str] = Field(default_factory=dict)  # router: each model's state (loaded, unloaded, sleeping...)
    default_model: str = ""  # router: the model a request without a `model` goes to ("": none, it must name one)

    @property
    def model_names(self) -> list[str]:
        """The models a router serves: as it lists them when it was asked, else as serve named them."""
        if self.models:
            return list(self.models)
        return [m for m in self.model.split(",") if m] if self.router and not self.models_dir else []

    @property
    def transport_name(self) -> str:
        """The transport as `ps` shows it: rpc-shm, rpc-unix, rpc-tcp, virtgpu-socket (Linux's apir-host), or
        the transport itself."""
        if self.transport == "virtgpu" and self.apir_host:
            return "virtgpu-socket"
        return f"{self.transport}-{self.rpc_link}" if self.transport == "rpc" and self.rpc_link else self.transport

    @property
    def base(self) -> str:
        """The server root (without /v1), where /health lives."""
        return self.url.removesuffix("/v1")

    @property
    def running(self) -> bool:
        return self.state in RUNNING


def created_at(attrs: dict[str, Any]) -> datetime | None:
    """A container's creation time from its inspect or list data (a number or an RFC 3339 text)."""
    value = attrs.get("Created")
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    if isinstance(value, str) and value:
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", value).replace("Z", "+00:00"))
    return None


def from_listed(item: dict[str, Any]) -> Server:
    """The server a labelled container describes (an entry of libpod's container list; health not
    asked: "-")."""
    labels: dict[str, str] = item.get("Labels") or {}
    url = labels.get(L_API, "")
    port_match = re.search(r":(\d+)(?:/|$)", url)
    model = labels.get(L_MODEL)
    if not model:
        with contextlib.suppress(ValueError, TypeError, IndexError):
            model = Path(json.loads(labels.get(L_AI_LAB, "[]"))[0]).name
    names = item.get("Names")
    name = names[0] if isinstance(names, list) and names else item.get("Name") or item.get("Id", "?")[:12]
    state = item.get("State")
    return Server(
        name=str(name).lstrip("/"),
        id=str(item.get("Id", "")),
        model=model or "?",
        transport=labels.get(L_TRANSPORT) or ("virtgpu" if labels.get(L_APIR) == "true" else "none"),
        url=url,
        state=str(state if isinstance(state, str) else (state or {}).get("Status", "unknown")),
        health="-",
        port=int(port_match.group(1)) if port_match else None,
        created=created_at(item),
        image=str(item.get("Image") or ""),
        managed=L_VERSION in labels,
        rpc_backends=[b for b in labels.get(L_RPC_BACKENDS, "").split(",") if b],
        tunnels=[int(p) for p in labels.get(L_TUNNELS, "").split(",") if p.isdigit()],
        rpc_target=labels.get(L_RPC_TARGET, ""),
        kind=labels.get(L_KIND, "chat"),
        rpc_link=labels.get(L_RPC_LINK, ""),
        rpc_instance=labels.get(L_RPC_INSTANCE, ""),
        apir_host=labels.get(L_APIR_HOST, ""),
        isolation=labels.get(L_ISOLATION, "container"),
        started=_started(item),
        exit_code=_exit_code(item),
        router=labels.get(L_ROUTER) == "true",
        models_dir=labels.get(L_MODELS_DIR, ""),
        default_model=labels.get(L_DEFAULT_MODEL, ""),
    )


def _exit_code(item: dict[str, Any]) -> int | None:
    value = item.get("ExitCode")
    exited = item.get("Exited") or item.get("State") in ("exited", "stopped")
    return value if exited and isinstance(value, int) and not isinstance(value, bool) else None


def _started(item: dict[str, Any]) -> float | None:
    value = item.get("StartedAt")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def list_servers(all: bool = False) -> list[Server]:  # noqa: A002
    """apirctl's servers (and the upstream extension's), newest first; `all` adds stopped ones."""
    api = containers.connect()
    seen: dict[str, Server] = {}
    for label in (L_VERSION, L_APIR):
        for item in api.list(label, all_=all):
            server = from_listed(item)
            seen.setdefault(server.id, server)
    epoch = datetime.fromtimestamp(0, tz=timezone.utc)
    return sorted(seen.values(), key=lambda s: s.created or epoch, reverse=True)


def remove(server: Server, timeout: int = 10) -> None:
    """Stop and remove a server's container (absent is fine)."""
    containers.connect().remove(server.id, timeout=timeout)
