"""What `apirctl serve` is asked for: the options (flags over settings), the port (checked before
anything is created), the model file to mount."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from apirctl import config, host, models
from apirctl.errors import ApirctlError
from apirctl.serve.servers import list_servers

if TYPE_CHECKING:
    pass


class ServeOptions(BaseModel):
    """Everything `apirctl serve` takes; defaults come from `apirctl.config`. An unknown key is an error:
    a misspelt option must not be dropped."""

    model_config = ConfigDict(extra="forbid")

    model: str
    port: int = 1234
    port_given: bool = False  # --port: a busy one is an error; a busy default (or setting) moves to a free one
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
    gpu_devices: list[str] = Field(default_factory=list)  # CDI names or /dev paths; implies transport gpu
    via_ssh: str | None = None  # USER@HOST[:PORT] that tunnels every backend
    insecure_network: bool = False  # allow plain non-loopback backends
    ssh_options: list[str] = Field(default_factory=list)  # extra `ssh -o` options (IdentityFile=...)
    llama_args: list[str] = Field(default_factory=list)
    temperature: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    restart: str | None = None  # a Podman restart policy
    memory: int | None = None  # the container's memory limit in bytes (`--memory`, read by `memory_limit`)
    apir_trace: bool = False  # virtgpu on Linux: the apir-host writes a trace (`apirctl apir trace`)
    metrics: bool = True  # llama-server's Prometheus endpoint, /metrics on the server's port
    models: list[str] = Field(default_factory=list)  # several models: llama-server's router mode, one container
    models_dir: Path | None = None  # a host directory of GGUFs the router lists (instead of `models`)
    models_max: int | None = None  # router: models loaded at once (0: no limit; default llama-server's 4)
    idle_unload: int | None = None  # seconds without requests after which a model is unloaded (None: never)
    isolation: str = "container"  # container, or vm: a QEMU micro-VM of the same image (apirctl.vm)
    cpus: int | None = None  # vm isolation: the VM's virtual CPUs (None: 2)
    router_default: str | None = None  # --default-model: where a request naming no model goes (None: the first)

    @property
    def router(self) -> bool:
        """Several models behind one endpoint: llama-server's router mode."""
        return len(self.models) > 1 or self.models_dir is not None


# --- options -----------------------------------------------------------------------------------


#: The options whose default is a setting of `apirctl.config` of the same name: a flag left out (None)
#: takes the setting's value (config file, environment), a flag given wins.
SETTING_OPTIONS = ("port", "host_ip", "transport", "image", "ctx_size", "ngl", "threads", "rpc_port", "apir_trace",
                   "isolation")


def options(model: str, **flags: Any) -> ServeOptions:
    """ServeOptions from the effective settings (config file, environment) and the given flags (None:
    not given). A key that is no field of ServeOptions raises TypeError, whatever its value."""
    unknown = sorted(set(flags) - set(ServeOptions.model_fields) - {"model"})
    if unknown or "model" in flags:
        raise TypeError(f"options() got unknown options: {', '.join(unknown or ['model'])}")
    keys = SETTING_OPTIONS
    if flags.get("rpc_backends") and flags.get("gpu_devices"):
        raise ApirctlError("--rpc-backend and --gpu-device are two different transports",
                           hint="keep --gpu-device for GPU passthrough or --rpc-backend for remoting")
    if flags.get("rpc_backends"):
        if flags.get("transport") not in (None, "rpc"):
            raise ApirctlError(f"--rpc-backend uses the rpc transport, not --transport {flags['transport']}")
        flags = {**flags, "transport": "rpc"}
    elif flags.get("via_ssh") or flags.get("insecure_network"):
        raise ApirctlError("--via-ssh and --insecure-network only apply with --rpc-backend HOST:PORT")
    if isinstance(flags.get("memory"), str):
        flags = {**flags, "memory": memory_limit(flags["memory"])}
    if isinstance(flags.get("idle_unload"), str):
        flags = {**flags, "idle_unload": idle_seconds(flags["idle_unload"])}
    flags = _router_flags(model, flags)
    if flags.get("gpu_devices"):
        if flags.get("transport") not in (None, "gpu"):
            raise ApirctlError(f"--gpu-device uses the gpu transport, not --transport {flags['transport']}")
        flags = {**flags, "transport": "gpu"}
    known = {k: v for k, v in flags.items() if k in keys}
    loaded = config.load(known)
    settings = loaded.settings
    values: dict[str, Any] = {k: getattr(settings, k) for k in keys}
    values["port_given"] = loaded.sources.get("port") == "command line"
    values["timeout"] = settings.health_timeout
    values.update({k: v for k, v in flags.items() if k not in keys and v is not None})
    return ServeOptions(model=model, **values)


def _router_flags(model: str, flags: dict[str, Any]) -> dict[str, Any]:
    """Check the router's inputs (several models, --models-dir, --models-max) before anything starts."""
    refs = [ref for ref in (flags.get("models") or [model]) if ref]
    directory = flags.get("models_dir")
    if directory is not None:
        if refs:
            raise ApirctlError("give models or --models-dir, not both",
                               hint="put the models into the directory, or name them without --models-dir")
        path = Path(directory).expanduser()
        if not path.is_dir():
            raise ApirctlError(f"--models-dir {directory}: no such directory",
                               hint="a directory of .gguf files (a subdirectory per model of several files)")
        flags = {**flags, "models_dir": path.resolve()}
    if len(set(refs)) < len(refs):
        raise ApirctlError("a model is named twice", hint="name each model once")
    chosen = flags.get("router_default")
    if chosen is not None:
        if len(refs) < 2 and directory is None:
            raise ApirctlError("--default-model picks one of the models of a server of several",
                               hint="name several models (`serve A B`) or give --models-dir")
        if directory is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", chosen):
            raise ApirctlError(f"--default-model {chosen!r} is not a model's name",
                               hint="a name as `apirctl ps` lists it: letters, digits, '.', '_' and '-'")
    flags = {**flags, "models": refs if len(refs) > 1 else []}
    models_max = flags.get("models_max")
    if models_max is not None:
        if models_max < 0:
            raise ApirctlError(f"--models-max {models_max} is below 0", hint="0 for no limit, else how many at once")
        if len(refs) < 2 and directory is None:
            raise ApirctlError("--models-max limits the models of a server of several",
                               hint="name several models (`serve A B`) or give --models-dir")
    return flags


#: --idle-unload: a whole number of seconds, or of s, m, h and d each once in that order (90, 30s, 5m, 1h30m);
#: 0, off and never turn it off.
_DURATION = re.compile(r"(?:(\d{1,6})d)?(?:(\d{1,6})h)?(?:(\d{1,6})m)?(?:(\d{1,9})s)?", re.IGNORECASE)
IDLE_HINT = "a length of time: seconds, or with s, m, h or d (30s, 5m, 1h30m); 0, off or never: keep models loaded"


def idle_seconds(text: str) -> int | None:
    """The seconds of an `--idle-unload` duration, None for off; a one-line error for anything else."""
    given = text.strip().lower()
    if given in ("0", "off", "never", "no"):
        return None
    if given.isdigit():
        return int(given)
    found = _DURATION.fullmatch(given)
    if not given or not found:
        raise ApirctlError(f"--idle-unload {text!r} is not a length of time", hint=IDLE_HINT)
    days, hours, minutes, secs = (int(part or 0) for part in found.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    if total == 0:
        return None
    if total > 2**31 - 1:  # llama-server keeps it as a C int
        raise ApirctlError(f"--idle-unload {text!r} is longer than llama-server can wait", hint=IDLE_HINT)
    return total


#: Podman's --memory: a whole or decimal number and an optional binary unit (k, m, g, t, p; with b, ib or
#: nothing after it; any case), as Podman reads it. It refuses a limit under 6 MiB (too little for any
#: container), and so does apirctl, before anything is fetched or created.
_SIZE = re.compile(r"(\d{1,30}(?:\.\d{1,30})?) ?(?:([kmgtp])i?)?b?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}
MIN_MEMORY = 6 * 1024**2
MAX_MEMORY = 2**63 - 1  # Podman keeps the limit as a signed 64-bit number
MEMORY_HINT = "a size of at least 6m: bytes, or a number with k, m, g or t (binary units, as Podman's --memory), " \
              "e.g. --memory 8g or --memory 512m; leave it out for no limit"


def memory_limit(text: str) -> int:
    """The bytes of a memory limit given as Podman's `--memory` takes it (`8g`, `512m`, `1.5G`,
    `1073741824`), or a one-line error with the accepted forms."""
    found = _SIZE.fullmatch(text.strip())
    if not found:
        raise ApirctlError(f"--memory {text!r} is not a memory size", hint=MEMORY_HINT)
    number, unit = found.group(1), (found.group(2) or "").lower()
    whole, _, fraction = number.partition(".")
    scale = _UNITS[unit]
    value = int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)
    if value < MIN_MEMORY:
        raise ApirctlError(f"--memory {text!r} is below the smallest limit Podman accepts (6 MiB)", hint=MEMORY_HINT)
    if value > MAX_MEMORY:
        raise ApirctlError(f"--memory {text!r} is more than a memory limit can be", hint=MEMORY_HINT)
    return value


def _connect_host(host_ip: str) -> str:
    """Where the host reaches a port published on `host_ip` (any-address means loopback)."""
    if host_ip in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host_ip == "::":
        return "::1"
    return host_ip


def publish_ip(host_ip: str) -> str:
    """The host address to ask Podman for: "" for every IPv4 interface. Netavark before 1.6 (Podman 4)
    turns an explicit 0.0.0.0 into a rule for the literal address 0.0.0.0, which no connection has,
    so `--host-ip 0.0.0.0` published a port nothing could reach."""
    return "" if host_ip == "0.0.0.0" else host_ip


def server_url(host_ip: str, port: int) -> str:
    host = _connect_host(host_ip)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def free_port(host_ip: str, start: int, tries: int = 100) -> int:
    """The first port from `start` on that nothing listens on (as RamaLama moves off a busy default)."""
    for port in range(start, min(start + tries, 65536)):
        try:
            check_port(host_ip, port)
        except ApirctlError:
            continue
        return port
    raise ApirctlError(f"no free port from {start} to {start + tries - 1} on {host_ip}", hint="pick one with --port")


class PortClaim:
    """This process's claim on a host port, from the port check until the server is ready (or has
    failed), so that parallel `apirctl serve`s on one port cannot all pass the check.

    Why: with Podman 4.3 and netavark, a container that fails to start because its port is taken
    removes the port-forwarding rules of the container that holds the port, so a serve that slips
    past the check breaks the running server as it fails. Linux: an abstract unix socket named after
    the user and port (the kernel frees it when the process ends, so nothing is left behind);
    elsewhere an flock on a file in a private folder.
    """

    def __init__(self, port: int) -> None:
        import os

        self.port = port
        self._sock: socket.socket | None = None
        self._file: Any = None
        if host.os_is_linux():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0apirctl-serve-port-{os.getuid()}-{port}")
            except OSError:
                sock.close()
                raise self._busy() from None
            self._sock = sock
            return
        import fcntl
        import tempfile

        folder = Path(tempfile.gettempdir()) / f"apirctl-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        handle = (folder / f"serve-port-{port}.lock").open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise self._busy() from None
        self._file = handle

    def _busy(self) -> ApirctlError:
        return ApirctlError(f"port {self.port} is being taken by another `apirctl serve` that is starting",
                            hint="wait for it (`apirctl ps`), or pick another one with --port")

    def release(self) -> None:
        for held in (self._sock, self._file):
            if held is not None:
                held.close()
        self._sock = self._file = None


def claim_port(host_ip: str, port: int, given: bool = True) -> tuple[int, PortClaim]:
    """Claim `port` and check it is free (given), or the first free port from it on (not given)."""
    _check_host_ip(host_ip)
    if given:
        claim = PortClaim(port)
        try:
            check_port(host_ip, port)
        except BaseException:
            claim.release()
            raise
        return port, claim
    for candidate in range(port, min(port + 100, 65536)):
        try:
            claim = PortClaim(candidate)
        except ApirctlError:
            continue
        try:
            check_port(host_ip, candidate)
        except ApirctlError:
            claim.release()
            continue
        return candidate, claim
    raise ApirctlError(f"no free port from {port} to {min(port + 99, 65535)} on {host_ip}", hint="pick one with --port")


def _check_host_ip(host_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host_ip)
    except ValueError:
        raise ApirctlError(f"--host-ip {host_ip!r} is not an IP address (default 127.0.0.1)") from None


def check_port(host_ip: str, port: int) -> None:
    """A clear error for a privileged or busy port, before anything is created."""
    if not 1024 < port < 65536:
        raise ApirctlError(f"port {port} is not allowed: choose one from 1025 to 65535")
    address = _check_host_ip(host_ip)
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
    """The GGUF file to mount, the name it gets inside the container, and a short display name;
    with the files that go beside it (split parts, the projector), its kind and its default params."""

    path: Path
    filename: str
    name: str
    files: list[models.ModelFile] = Field(default_factory=list, description="every file to mount")
    mmproj: str | None = None  # the projector's name in the container
    kind: str = "chat"
    params: dict[str, Any] = Field(default_factory=dict)


def resolve_model(ref: str) -> ModelFile:
    """Resolve a reference through the model store (which fetches what is missing).

    Store blobs are named by digest, so the container sees each file under its original name.
    """
    found = models.resolve(ref, pull=True)
    name = Path(found.filename).stem if found.source == "file" else found.name
    return ModelFile(path=found.path, filename=found.filename, name=name, files=found.files(),
                     mmproj=found.mmproj.filename if found.mmproj else None,
                     kind=models.header(found.path).kind, params=found.params)


class ModelSet(BaseModel):
    """The models of a router server: resolved models, each under a name of its own, or a host directory
    that llama-server lists itself."""

    models: list[ModelFile] = Field(default_factory=list)
    directory: Path | None = None
    default: str | None = None  # the model a request that names none goes to (None: it must name one)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    @property
    def label(self) -> str:
        """What `ps` shows before the server is asked: the names, or the directory."""
        return ",".join(self.names) if self.models else str(self.directory)


def resolve_models(opts: ServeOptions) -> ModelSet:
    """The router's models, each named as llama-server will list it (a directory's name: letters,
    digits, '.', '_' and '-'); two models of one name, or a model that does not chat, are refused
    (the router gives every model the same llama-server flags, and --embeddings is not a chat's)."""
    if opts.models_dir is not None:  # its names are the router's to list: the default is checked once it runs
        return ModelSet(directory=opts.models_dir, default=opts.router_default)
    found: list[ModelFile] = []
    for ref in opts.models:
        model = resolve_model(ref)
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", model.name).strip("-.") or "model"
        if model.kind != "chat":
            raise ApirctlError(f"{ref} is not a chat model ({model.kind}): a server of several serves chat models",
                               hint=f"serve it on its own: `apirctl serve {ref}`")
        if name in (m.name for m in found):
            raise ApirctlError(f"two of the models are called {name}", hint="serve one of them on its own, or "
                               "give one another file name")
        found.append(model.model_copy(update={"name": name}))
    return ModelSet(models=found, default=_default_of(opts, found))


def _default_of(opts: ServeOptions, found: list[ModelFile]) -> str:
    """The router's default model: --default-model, by the name it is served under or as it was named on
    the command line, else the first model named."""
    chosen = opts.router_default
    if chosen is None:
        return found[0].name
    for ref, model in zip(opts.models, found, strict=True):
        if chosen in (ref, model.name):
            return model.name
    raise ApirctlError(f"--default-model {chosen} is not one of the models served",
                       hint="one of: " + ", ".join(m.name for m in found))
