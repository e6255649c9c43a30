"""How an inference container reaches the host GPU: `none`, `rpc`, `virtgpu`, or `auto`.

A transport is only a difference in the container's wiring, so each one is a `Plan`: devices,
network, SELinux options, environment and llama.cpp flags that `Plan.apply` adds to a
`engine.ContainerSpec`. Serve and bench share it, so both run the same container shape.

- `none`: llama.cpp on the container's own CPU; nothing added.
- `rpc` (Linux): the host runs `ggml-rpc-server` on 127.0.0.1; the container reaches it through
  the host-loopback door of its network (`apirctl.hostloopback`: slirp4netns' 10.0.2.2, a pasta
  port forward to the container's own 127.0.0.1, or a podman machine's gvproxy gateway) and
  llama.cpp gets `--rpc ADDRESS:PORT`. Nothing listens on a routable address.
- `virtgpu` (macOS): the container gets `/dev/dri` (the virtio-gpu of the krunkit VM) with
  SELinux labelling off; its ggml-virtgpu frontend forwards to the host's Metal backend.
  The image comes from the active API-remoting bundle when one is installed.
- `auto`: the remoting transport of this platform when `machine status` says it is ready (and,
  for rpc, a container network can reach it), else `none` with a notice saying why and what to run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError

if TYPE_CHECKING:
    from apirctl.engine import ContainerSpec
    from apirctl.hostloopback import HostLoopback
    from apirctl.machine import MachineStatus

Kind = Literal["none", "rpc", "virtgpu"]
TRANSPORTS = ("auto", "virtgpu", "rpc", "none")


class Plan(BaseModel):
    """The container wiring of one transport."""

    transport: Kind
    requested: str
    image: str | None = None  # an image the transport needs (virtgpu: the bundle's), else the default
    devices: list[str] = Field(default_factory=list)
    network_mode: str | None = None
    network_options: dict[str, list[str]] = Field(default_factory=dict)
    security_opt: list[str] = Field(default_factory=list)
    environment: dict[str, str] = Field(default_factory=dict)
    llama_args: list[str] = Field(default_factory=list)
    notice: str | None = None  # why `auto` chose what it chose
    tunnels: list[int] = Field(default_factory=list)  # rpc via SSH: pids of the tunnels (close them on stop)

    @property
    def remoting(self) -> bool:
        return self.transport != "none"

    def apply(self, spec: ContainerSpec) -> ContainerSpec:
        """A copy of `spec` with this transport's devices, network, env and llama.cpp flags."""
        return spec.model_copy(
            update={
                "devices": [*spec.devices, *self.devices],
                "network_mode": self.network_mode or spec.network_mode,
                "network_options": {**spec.network_options, **self.network_options},
                "security_opt": [*spec.security_opt, *self.security_opt],
                "environment": {**spec.environment, **self.environment},
                "command": [*spec.command, *self.llama_args],
            },
            deep=True,
        )


def _ready(status: MachineStatus) -> bool:
    from apirctl.machine import MachineState

    return status.state in (MachineState.READY, MachineState.SERVING)


def machine_status() -> MachineStatus | None:
    """This platform's remoting status, or None where the platform module is not available."""
    try:
        from apirctl.machine import platform

        return platform().status()
    except ImportError:
        return None


def _not_ready(kind: str, status: MachineStatus | None) -> ApirctlError:
    summary = status.summary if status else "the remoting backend is not available on this host"
    hint = (status.next_step if status else None) or "start it with `apirctl machine restart --remoting`"
    return ApirctlError(f"the {kind} transport is not ready: {summary}", hint=hint)


def _bundle_image() -> str | None:
    """The container image named by the active macOS bundle, if bundles exist yet."""
    try:
        from apirctl import bundle
    except ImportError:
        return None
    active = bundle.active()
    return getattr(active, "image", None) if active is not None else None


def _door(loopback: HostLoopback | None) -> HostLoopback:
    from apirctl import hostloopback

    return loopback if loopback is not None else hostloopback.choose()


def rpc_plan(port: int, ngl: int, requested: str = "rpc", loopback: HostLoopback | None = None) -> Plan:
    """The rpc wiring for a host backend on 127.0.0.1:`port` (`loopback`: the door to it, chosen
    for this host when not given)."""
    door = _door(loopback)
    return Plan(
        transport="rpc",
        requested=requested,
        network_mode=door.network_mode,
        network_options=door.network_options([port]),
        llama_args=["--rpc", door.endpoint(port), "--n-gpu-layers", str(ngl)],
    )


def parse_endpoint(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT` -> (host, port), with a one-line error for anything else."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ApirctlError(f"--rpc-backend {text!r}: expected HOST:PORT (e.g. 192.168.1.20:50052)")
    return host, int(port)


def remote_rpc_plan(backends: list[str], ngl: int, via_ssh: str | None = None, insecure_network: bool = False,
                    ssh_args: list[str] | None = None, requested: str = "rpc",
                    loopback: HostLoopback | None = None) -> Plan:
    """rpc wiring for explicit backends (`--rpc-backend`, repeatable: llama.cpp splits the layers).

    Loopback backends are reached through the host-loopback door (`loopback`, chosen for this
    host when one is needed and not given). With `via_ssh` every backend address is as the SSH
    host sees it, reached through a tunnel whose local end is on this host's loopback. A plain
    non-loopback address is refused unless `insecure_network`: the RPC protocol has no
    authentication.
    """
    from apirctl import hostloopback, tunnel

    if not backends:
        raise ApirctlError("no --rpc-backend given")
    endpoints: list[str] = []
    local_ports: list[int] = []  # ports of this host's loopback the container must reach
    opened: list[int] = []
    door = loopback
    try:
        for text in backends:
            host, port = parse_endpoint(text)
            if via_ssh:
                door = _door(door)
                t = tunnel.open_tunnel(via_ssh, host, port, ssh_args=ssh_args)
                opened.append(t.pid)
                local_ports.append(t.local_port)
                endpoints.append(door.endpoint(t.local_port))
            elif hostloopback.is_loopback(host):
                door = _door(door)
                local_ports.append(port)
                endpoints.append(door.endpoint(port))
            elif insecure_network:
                endpoints.append(f"{host}:{port}")
            else:
                raise ApirctlError(
                    f"refusing the RPC backend {host}:{port} over the network: the RPC protocol has no "
                    "authentication and gives its clients access to that host's memory",
                    hint="tunnel it with --via-ssh USER@HOST (the backend stays on that host's loopback), "
                         "or pass --insecure-network on a network you trust completely",
                )
    except BaseException:
        tunnel.close(opened)
        raise
    return Plan(
        transport="rpc",
        requested=requested,
        network_mode=door.network_mode if door and local_ports else None,
        network_options=door.network_options(local_ports) if door and local_ports else {},
        llama_args=["--rpc", ",".join(endpoints), "--n-gpu-layers", str(ngl)],
        tunnels=opened,
    )


def virtgpu_plan(ngl: int, image: str | None = None, requested: str = "virtgpu") -> Plan:
    """The virtgpu wiring: the VM's virtio-gpu device, unlabelled, all layers offloaded."""
    return Plan(
        transport="virtgpu",
        requested=requested,
        image=image,
        devices=["/dev/dri"],
        security_opt=["label=disable"],
        llama_args=["--n-gpu-layers", str(ngl)],
    )


def plan(
    requested: str,
    *,
    ngl: int = 999,
    rpc_port: int = 50052,
    status: MachineStatus | None = None,
    platform_name: str | None = None,
    loopback: HostLoopback | None = None,
) -> Plan:
    """Resolve a requested transport into its wiring, or a one-line error saying what to do.

    `status` is the machine status (asked for when not given); `platform_name` ("darwin" or
    "linux") defaults to this host's, as `engine.on_macos` sees it; `loopback` is rpc's door to
    the host's loopback (`hostloopback.choose()` when not given).
    """
    if requested not in TRANSPORTS:
        raise ApirctlError(f"unknown transport {requested!r} (choose from {', '.join(TRANSPORTS)})")
    if requested == "none":
        return Plan(transport="none", requested=requested)
    if platform_name is None:
        from apirctl.engine import on_macos

        darwin = on_macos()
    else:
        darwin = platform_name == "darwin"
    if requested == "virtgpu" and not darwin:
        raise ApirctlError(
            "the virtgpu transport needs macOS API remoting (a krunkit podman machine)",
            hint="on Linux use `--transport rpc` (after `apirctl machine restart --remoting`) or `none`",
        )
    if requested == "rpc" and darwin:
        raise ApirctlError("the rpc transport is for Linux hosts", hint="on macOS use `--transport virtgpu`")
    if status is None:
        status = machine_status()
    ready = status is not None and _ready(status)
    if requested == "auto":
        if not ready:
            why = status.summary if status else "no remoting backend on this host"
            step = f"; {status.next_step}" if status and status.next_step else ""
            return Plan(
                transport="none",
                requested=requested,
                notice=f"remoting is not ready ({why}): running on the container's CPU{step}",
            )
        requested_kind = "virtgpu" if darwin else "rpc"
    else:
        if not ready:
            raise _not_ready(requested, status)
        requested_kind = requested
    if requested_kind == "virtgpu":
        return virtgpu_plan(ngl, image=_bundle_image(), requested=requested)
    port = int((status.details.get("port") if status else None) or rpc_port)
    if requested == "auto":  # a backend no container can reach is no reason to fail: fall back, say why
        try:
            loopback = _door(loopback)
        except ApirctlError as exc:
            hint = f"; {exc.hint}" if exc.hint else ""
            return Plan(transport="none", requested=requested,
                        notice=f"the rpc backend is ready, but {exc.message}: running on the container's CPU{hint}")
    return rpc_plan(port, ngl, requested=requested, loopback=loopback)
