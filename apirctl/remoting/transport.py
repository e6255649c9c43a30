"""How an inference container reaches the host GPU: `none`, `rpc`, `virtgpu`, or `auto`.

A transport is only a difference in the container's wiring, so each one is a `Plan`: devices,
network, SELinux options, environment and llama.cpp flags that `Plan.apply` adds to a
`engine.ContainerSpec`. Serve and bench share it, so both run the same container shape.

- `none`: llama.cpp on the container's own CPU; nothing added.
- `gpu` (Linux passthrough): the container gets the GPU itself: CDI devices (`nvidia.com/gpu=all`
  from the NVIDIA container toolkit's spec) or `/dev/dri` render nodes, SELinux labelling off, and
  apirctl's image with the matching GPU backend (CUDA or Vulkan; `apirctl.gpu` finds all three).
- `rpc` (Linux), two links:
  - `unix` (when the host backend listens on a Unix socket, the default): the container gets a
    `ggml-rpc-server` of its own (`apirctl.remoting.backends`, started by serve or bench once the
    plan is made), whose socket directory is mounted at `/run/apirctl-rpc`; llama.cpp gets
    `--rpc unix:/run/apirctl-rpc/rpc.sock` and moves to shared memory. No network route to the
    host: any network works, `none` included.
  - `tcp`: the host runs `ggml-rpc-server` on 127.0.0.1; the container reaches it through the
    host-loopback door of its network (`apirctl.remoting.hostloopback`: slirp4netns' 10.0.2.2, a
    pasta port forward to the container's own 127.0.0.1, or a podman machine's gvproxy gateway) and
    llama.cpp gets `--rpc ADDRESS:PORT`. Explicit `--rpc-backend`s and SSH tunnels take this link.
  Nothing listens on a routable address.
- `virtgpu`, chosen by the host platform:
  - macOS: the container gets `/dev/dri` (the virtio-gpu of the krunkit VM) with SELinux
    labelling off; its ggml-virtgpu frontend forwards to the host's Metal backend. The image is
    the active API-remoting bundle's, as the machine's status names it.
  - Linux: the container gets an `apir-host` of its own (`apirctl.remoting.apir_hosts`, started by
    serve or bench once the plan is made), whose socket directory is mounted at
    `/run/apirctl-apir`, and `GGML_VIRTGPU_SOCKET` pointing at the socket: apirctl's image's
    frontend then talks to the host's ggml-virtgpu backend (CUDA, else CPU) over the socket and
    shared memory. No network route to the host, no device.
- `auto`: passthrough where the engine can hand the GPU over, else the remoting transport of this
  platform when `machine status` says it is ready, its backend computes on a GPU (on the CPU it
  only adds a transport to the container's own cores) and, for rpc over TCP, a container network
  can reach it; else `none`; its notice is one line saying what it chose and why (`apirctl.gpu.decide`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from apirctl import gpu, host
from apirctl.build import llamacpp
from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, MachineStatus
from apirctl.podman.containers import BindMount
from apirctl.remoting import apir_hosts, backends, hostloopback, machines, tunnel

if TYPE_CHECKING:
    from apirctl.build.llamacpp import Build
    from apirctl.podman.containers import ContainerSpec
    from apirctl.remoting.apir_hosts import Host
    from apirctl.remoting.backends import Instance
    from apirctl.remoting.hostloopback import HostLoopback

Kind = Literal["none", "gpu", "rpc", "virtgpu"]
TRANSPORTS = ("auto", "gpu", "virtgpu", "rpc", "none")


class Plan(BaseModel):
    """The container wiring of one transport."""

    transport: Kind
    requested: str
    image: str | None = None  # an image the transport needs (virtgpu: the bundle's), else the default
    image_backend: str | None = None  # gpu: the GPU backend of apirctl's image to run (cuda, vulkan)
    devices: list[str] = Field(default_factory=list)
    network_mode: str | None = None
    network_options: dict[str, list[str]] = Field(default_factory=dict)
    security_opt: list[str] = Field(default_factory=list)
    environment: dict[str, str] = Field(default_factory=dict)
    llama_args: list[str] = Field(default_factory=list)
    notice: str | None = None  # why `auto` chose what it chose
    tunnels: list[int] = Field(default_factory=list)  # rpc via SSH: pids of the tunnels (close them on stop)
    rpc_link: Literal["", "unix", "tcp"] = ""  # rpc: a backend of its own on a socket, or a TCP backend
    rpc_instance: str = ""  # rpc: the backend instance it uses (unix: set by `with_backend`)
    apir_link: Literal["", "socket"] = ""  # virtgpu on Linux: an apir-host of its own on a socket
    apir_host: str = ""  # virtgpu on Linux: that host's id (set by `with_apir_host`)
    mounts: list[BindMount] = Field(default_factory=list)

    @property
    def remoting(self) -> bool:
        return self.transport != "none"

    @property
    def one_client(self) -> bool:
        """A router server (several models) keeps one model loaded, as each model is a client of the
        container's backend: ggml-rpc-server serves one client at a time; an apir-host serves a few at
        once (the router's own process holds one), each a backend context of its own on the host."""
        return self.transport in ("rpc", "virtgpu")

    @property
    def needs_backend(self) -> bool:
        """The caller starts a backend for this container (`backends.start`, then `with_backend`)."""
        return self.rpc_link == "unix" and not self.mounts

    @property
    def needs_apir_host(self) -> bool:
        """The caller starts an apir-host for this container (`apir_hosts.start`, then `with_apir_host`)."""
        return self.apir_link == "socket" and not self.apir_host

    def apply(self, spec: ContainerSpec) -> ContainerSpec:
        """A copy of `spec` with this transport's devices, network, env and llama.cpp flags."""
        return spec.model_copy(
            update={
                "devices": [*spec.devices, *self.devices],
                "mounts": [*spec.mounts, *self.mounts],
                "network_mode": self.network_mode or spec.network_mode,
                "network_options": {**spec.network_options, **self.network_options},
                "security_opt": [*spec.security_opt, *self.security_opt],
                "environment": {**spec.environment, **self.environment},
                "command": [*spec.command, *self.llama_args],
            },
            deep=True,
        )


def _ready(status: MachineStatus) -> bool:
    return status.state in (MachineState.READY, MachineState.SERVING)


def machine_status() -> MachineStatus:
    """This platform's remoting status."""
    return machines.current().status()


def _not_ready(kind: str, status: MachineStatus | None) -> ApirctlError:
    summary = status.summary if status else "the remoting backend is not available on this host"
    hint = (status.next_step if status else None) or "start it with `apirctl machine restart --remoting`"
    return ApirctlError(f"the {kind} transport is not ready: {summary}", hint=hint)


def _door(loopback: HostLoopback | None) -> HostLoopback:
    return loopback if loopback is not None else hostloopback.choose()


def rpc_plan(port: int, ngl: int, requested: str = "rpc", loopback: HostLoopback | None = None,
             instance: str = "") -> Plan:
    """The rpc wiring for a host backend on 127.0.0.1:`port` (`loopback`: the door to it, chosen
    for this host when not given; `instance`: the backend's, for the container's label)."""
    door = _door(loopback)
    return Plan(
        transport="rpc",
        requested=requested,
        network_mode=door.network_mode,
        network_options=door.network_options([port]),
        llama_args=["--rpc", door.endpoint(port), "--n-gpu-layers", str(ngl)],
        rpc_link="tcp",
        rpc_instance=instance,
    )


def local_rpc_plan(ngl: int, requested: str = "rpc") -> Plan:
    """The rpc wiring over a backend of the container's own on a Unix socket: the caller starts the
    backend and adds its directory with `with_backend`. No network route to the host is needed."""
    return Plan(
        transport="rpc",
        requested=requested,
        llama_args=["--rpc", backends.CONTAINER_ENDPOINT, "--n-gpu-layers", str(ngl)],
        rpc_link="unix",
    )


def vm_rpc_plan(ngl: int, endpoint: str, requested: str = "rpc") -> Plan:
    """The rpc wiring of a VM (`serve --isolation vm`): a backend of its own on a Unix socket, as a
    container's, that the guest's llama.cpp dials at `endpoint`, the one address QEMU forwards to it
    (`apirctl.vm.machines`); its rings live in the memory the VM shares with the backend (`vm.region`)."""
    return Plan(transport="rpc", requested=requested, rpc_link="unix",
                llama_args=["--rpc", endpoint, "--n-gpu-layers", str(ngl)])


def vm_apir_plan(ngl: int, endpoint: str, requested: str = "virtgpu") -> Plan:
    """The APIR wiring of a VM: an apir-host of its own, which the guest's frontend reaches at
    `endpoint` (the one address QEMU forwards) with its resources in the memory the VM shares with the
    host (llama_patches/ 0025); its buffers stay in the host backend's memory (the region holds the
    transfers, not the weights)."""
    problem = apir_problem(llamacpp.current_build(), llamacpp.container_build())
    if problem:
        raise ApirctlError(f"the virtgpu transport is not available: {problem}", hint="run `apirctl setup`")
    return Plan(transport="virtgpu", requested=requested, apir_link="socket",
                environment={apir_hosts.SOCKET_ENV: f"tcp:{endpoint}", "GGML_VIRTGPU_SHARED_BUFFERS": "0"},
                llama_args=["--n-gpu-layers", str(ngl)])


def with_backend(plan: Plan, instance: Instance) -> Plan:
    """`plan` with the backend's socket directory mounted (read-only: connecting needs no write
    access to the mount) where the container's llama.cpp dials it."""
    mount = BindMount(source=Path(instance.directory), target=backends.CONTAINER_DIR, read_only=True)
    return plan.model_copy(update={"mounts": [mount], "rpc_instance": instance.id})


def host_rpc_plan(status: MachineStatus, ngl: int, rpc_port: int = 50052, requested: str = "rpc",
                  loopback: HostLoopback | None = None) -> Plan:
    """rpc against this host's remoting as `machine status` describes it: a backend of the
    container's own when the host backend listens on a Unix socket, else its TCP port through the
    host-loopback door."""
    if status.details.get("listen") == "unix":
        return local_rpc_plan(ngl, requested=requested)
    port = int(status.details.get("port") or rpc_port)
    return rpc_plan(port, ngl, requested=requested, loopback=loopback,
                    instance=str(status.details.get("instance") or ""))


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
        rpc_link="tcp",
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


def apir_plan(ngl: int, requested: str = "virtgpu") -> Plan:
    """Linux APIR: the frontend in apirctl's image reaches an apir-host of the container's own; the
    caller starts it and adds its directory with `with_apir_host`. All layers offloaded (the
    frontend's device is the only GPU the container has)."""
    return Plan(
        transport="virtgpu",
        requested=requested,
        environment={apir_hosts.SOCKET_ENV: apir_hosts.CONTAINER_SOCKET},
        llama_args=["--n-gpu-layers", str(ngl)],
        apir_link="socket",
    )


def with_apir_host(plan: Plan, host: Host) -> Plan:
    """`plan` with the host's socket directory mounted (read-only: connecting needs no write access
    to the mount) where `GGML_VIRTGPU_SOCKET` points."""
    mount = BindMount(source=Path(host.directory), target=apir_hosts.CONTAINER_DIR, read_only=True)
    return plan.model_copy(update={"mounts": [*plan.mounts, mount], "apir_host": host.id})


def apir_problem(host_build: Build | None, image_build: Build | None) -> str | None:
    """Why Linux APIR cannot run here (the host program, the backend libraries, the image's
    frontend), or None."""
    return apir_hosts.host_problem(host_build) or apir_hosts.frontend_problem(image_build)


def _linux_apir_plan(ngl: int, requested: str) -> Plan:
    problem = apir_problem(llamacpp.current_build(), llamacpp.container_build())
    if problem:
        raise ApirctlError(f"the virtgpu transport is not available: {problem}", hint="run `apirctl setup`")
    return apir_plan(ngl, requested=requested)


def gpu_plan(offer: gpu.Passthrough, ngl: int, requested: str = "gpu") -> Plan:
    """The passthrough wiring: the devices (CDI names or paths), unlabelled so SELinux lets the
    container open them, all layers offloaded, and apirctl's image of the offer's backend."""
    return Plan(
        transport="gpu",
        requested=requested,
        image_backend=offer.backend,
        devices=list(offer.devices),
        security_opt=["label=disable"],
        llama_args=["--n-gpu-layers", str(ngl)],
    )


def _offer(gpu_devices: Sequence[str], own_image: bool) -> gpu.Passthrough | gpu.Blocked:
    return gpu.facts(hostloopback.containers_elsewhere(), requested=tuple(gpu_devices), own_image=own_image)[-1]


def plan(
    requested: str,
    *,
    ngl: int = 999,
    rpc_port: int = 50052,
    status: MachineStatus | None = None,
    platform_name: str | None = None,
    loopback: HostLoopback | None = None,
    gpu_devices: Sequence[str] = (),
    own_image: bool = False,
    offer: gpu.Passthrough | gpu.Blocked | None = None,
) -> Plan:
    """Resolve a requested transport into its wiring, or a one-line error saying what to do.

    `status` is the machine status (asked for when not given); `platform_name` ("darwin" or
    "linux") defaults to this host's (`apirctl.host`); `loopback` is rpc's door to
    the host's loopback (`hostloopback.choose()` when not given).
    `gpu_devices`: the devices the user named for passthrough; `own_image`: the user runs their
    own image (no apirctl GPU image needed); `offer`: the passthrough this host offers (found
    when not given).
    """
    if requested not in TRANSPORTS:
        raise ApirctlError(f"unknown transport {requested!r} (choose from {', '.join(TRANSPORTS)})")
    if requested == "none":
        return Plan(transport="none", requested=requested)
    darwin = host.is_macos() if platform_name is None else platform_name == "darwin"
    if requested == "gpu":
        if darwin:
            raise ApirctlError("the gpu transport hands a Linux host's GPU to its containers; on macOS they run "
                               "in the podman machine's VM", hint="use `--transport virtgpu` (API remoting)")
        found = offer if offer is not None else _offer(gpu_devices, own_image)
        if isinstance(found, gpu.Blocked):
            raise ApirctlError(f"cannot give the container the GPU: {found.reason}",
                               hint=found.hint or "`--transport auto` uses remoting or the container's CPU instead; "
                                                  "`apirctl doctor` shows what was looked for")
        return gpu_plan(found, ngl, requested=requested)
    if requested == "auto":
        return _auto(ngl=ngl, rpc_port=rpc_port, status=status, darwin=darwin, loopback=loopback,
                     offer=offer if offer is not None or darwin else _offer(gpu_devices, own_image))
    if requested == "virtgpu" and not darwin:  # Linux: an apir-host per container, no VM
        return _linux_apir_plan(ngl, requested)
    if requested == "rpc" and darwin:
        raise ApirctlError("the rpc transport is for Linux hosts", hint="on macOS use `--transport virtgpu`")
    if status is None:
        status = machine_status()
    if status is None or not _ready(status):
        raise _not_ready(requested, status)
    if requested == "virtgpu":
        return virtgpu_plan(ngl, image=_status_image(status), requested=requested)
    return host_rpc_plan(status, ngl, rpc_port=rpc_port, requested=requested, loopback=loopback)


def _status_image(status: MachineStatus | None) -> str | None:
    """The macOS machine's status names the active bundle's image (it is what krunkit loaded)."""
    image = status.details.get("image") if status else None
    return str(image) if image else None


def _auto(*, ngl: int, rpc_port: int, status: MachineStatus | None, darwin: bool, loopback: HostLoopback | None,
          offer: gpu.Passthrough | gpu.Blocked | None) -> Plan:
    """`auto`: gather the facts `gpu.decide` needs, and wire what it chose; its reason is the notice."""
    if status is None:
        status = machine_status()
    ready = status is not None and _ready(status)
    remoting = gpu.Remoting(kind="virtgpu" if darwin else "rpc", ready=ready,
                            why=status.summary if status else "no remoting backend on this host",
                            step=status.next_step if status else None,
                            device="" if darwin or status is None else str(status.details.get("device") or ""))
    tcp = status is not None and status.details.get("listen") != "unix"
    if ready and tcp and not darwin and not isinstance(offer, gpu.Passthrough):
        try:  # a TCP backend no container can reach is no reason to fail: fall back, say why
            loopback = _door(loopback)
        except ApirctlError as exc:
            remoting.unreachable, remoting.unreachable_hint = exc.message, exc.hint
    choice = gpu.decide("darwin" if darwin else "linux",
                        offer or gpu.Blocked(reason="containers run in the podman machine's VM"), remoting)
    if choice.transport == "gpu":
        assert isinstance(offer, gpu.Passthrough)
        chosen = gpu_plan(offer, ngl, requested="auto")
    elif choice.transport == "virtgpu":
        chosen = virtgpu_plan(ngl, image=_status_image(status), requested="auto")
    elif choice.transport == "rpc":
        assert status is not None
        chosen = host_rpc_plan(status, ngl, rpc_port=rpc_port, requested="auto", loopback=loopback)
    else:
        chosen = Plan(transport="none", requested="auto")
    return chosen.model_copy(update={"notice": choice.reason})
