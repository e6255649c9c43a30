"""Which GPU path a container gets: the passthrough offer and `auto`'s decision, as pure functions.

Everything these functions need is passed in (the CDI inventory, the device files, which GPU
images exist, whether the engine runs in a VM, the remoting status), so the whole decision table
is tested without the hardware; `apirctl.transport` gathers the facts and applies the result.

`auto` prefers, in order: passthrough (the container gets the GPU itself: native speed, no
host process), local remoting (the host backend through rpc) when that backend computes on a GPU,
the container's CPU (with a notice saying why each faster path was not taken and what to do about
it). A backend on the CPU is never faster than the container's own CPU: the same cores, plus a
transport.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from apirctl.gpu.cdi import CdiInventory, is_qualified
from apirctl.gpu.devices import DeviceFiles
from apirctl.podman.containers import NVIDIA_CDI_FIX

ImageBackend = Literal["cuda", "vulkan"]

VULKAN_FIX = "build the Vulkan image with `apirctl setup --vulkan` (needs libvulkan-dev, glslc, spirv-headers)"
CUDA_FIX = "run `apirctl setup` on this host with the CUDA toolkit (nvcc) installed, or `apirctl setup --vulkan`"


class Passthrough(BaseModel):
    """A GPU the engine can hand to a container, and the image backend that can use it."""

    devices: list[str]  # what `podman --device` takes: CDI names or device paths
    backend: ImageBackend | None  # the image to run; None: the user's own image (--image)
    what: str  # for people: "NVIDIA GPU (CDI nvidia.com/gpu=all)"


class Blocked(BaseModel):
    """Why there is no passthrough here, and the step that would give one."""

    reason: str
    hint: str | None = None


class Remoting(BaseModel):
    """The remoting path of this platform as `auto` sees it."""

    kind: Literal["rpc", "virtgpu"]
    ready: bool
    why: str = ""  # the machine status summary when not ready
    step: str | None = None  # what to run to make it ready
    unreachable: str | None = None  # ready, but no container network can reach it (and why)
    unreachable_hint: str | None = None
    device: str = ""  # the backend's devices as `machine status` shows them ("CPU: AMD EPYC (...)")

    @property
    def on_cpu(self) -> bool:
        """The backend computes on the CPU: remoting then adds a transport to the same cores a
        container uses by itself, so it can only be slower (docs/performance.md measures it)."""
        return backend_on_cpu(self.device)


class Choice(BaseModel):
    transport: Literal["gpu", "rpc", "virtgpu", "none"]
    reason: str  # the one line `auto` prints


def _pick_backend(backends: Collection[str], nvidia: bool) -> ImageBackend | None:
    if nvidia and "cuda" in backends:
        return "cuda"
    return "vulkan" if "vulkan" in backends else None


def find_passthrough(cdi: CdiInventory, files: DeviceFiles, backends: Collection[str], *, engine_in_vm: bool = False,
                     requested: Sequence[str] = (), own_image: bool = False) -> Passthrough | Blocked:
    """The passthrough this host offers, or why there is none.

    `backends`: the GPU backends of the images apirctl has (or can build at once): "cuda",
    "vulkan". `requested`: devices the user named (CDI names or paths); each must exist.
    `own_image`: the user runs their own image (`--image`), so no apirctl image backend is needed.
    """
    if engine_in_vm:
        return Blocked(reason="containers run in a virtual machine (podman machine), whose GPU cannot be handed over",
                       hint="use remoting: `apirctl machine restart --remoting`")
    if requested:
        return _requested(cdi, files, backends, requested, own_image)
    nvidia_cdi = [d for d in cdi.gpus() if d.vendor == "nvidia"]
    if nvidia_cdi:
        chosen = next((d for d in nvidia_cdi if d.name == "all"), nvidia_cdi[0])
        backend = _pick_backend(backends, nvidia=True)
        if backend or own_image:
            return Passthrough(devices=[chosen.qualified], backend=None if own_image else backend,
                               what=f"NVIDIA GPU (CDI {chosen.qualified})")
        blocked = Blocked(reason=f"an NVIDIA GPU is available through CDI ({chosen.qualified}) but no apirctl image "
                                 "has a GPU backend", hint=CUDA_FIX)
    elif files.nvidia:
        blocked = Blocked(reason="an NVIDIA GPU is present but the container engine cannot hand it over "
                                 "(no CDI spec for nvidia.com/gpu)", hint=NVIDIA_CDI_FIX)
    else:
        blocked = Blocked(reason="no GPU device on this host (no CDI spec for a GPU, no /dev/dri render node)")
    other_cdi = [d for d in cdi.gpus() if d.vendor != "nvidia"]
    if other_cdi and ("vulkan" in backends or own_image):
        chosen = other_cdi[0]
        return Passthrough(devices=[chosen.qualified], backend=None if own_image else "vulkan",
                           what=f"{chosen.vendor} GPU (CDI {chosen.qualified})")
    nodes = [n for n in files.render_nodes if n.driver != "virtio_gpu"]
    usable = files.usable_render_nodes
    if usable and ("vulkan" in backends or own_image):
        drivers = ", ".join(sorted({n.driver or "unknown driver" for n in usable}))
        return Passthrough(devices=[n.path for n in usable], backend=None if own_image else "vulkan",
                           what=f"render node{'s' if len(usable) > 1 else ''} {', '.join(n.path for n in usable)} "
                                f"({drivers})")
    if isinstance(blocked, Blocked) and (nvidia_cdi or files.nvidia):
        return blocked  # the NVIDIA step comes first: it is the faster path
    if other_cdi or usable:
        what = other_cdi[0].qualified if other_cdi else usable[0].path
        return Blocked(reason=f"a GPU is available ({what}) but no apirctl image has the Vulkan backend",
                       hint=VULKAN_FIX)
    if nodes:
        return Blocked(reason=f"this user cannot open {nodes[0].path}",
                       hint="add the user to the group that owns it (`sudo usermod -aG render $USER`, then log in "
                            "again)")
    return blocked


def _requested(cdi: CdiInventory, files: DeviceFiles, backends: Collection[str], requested: Sequence[str],
               own_image: bool) -> Passthrough | Blocked:
    nvidia = False
    for name in requested:
        if is_qualified(name):
            found = cdi.find(name)
            if found is None:
                kinds = sorted({d.kind for d in cdi.devices})
                known = (f" (specs found for: {', '.join(kinds)})" if kinds
                         else " (no CDI spec found in /etc/cdi or /var/run/cdi)")
                hint = NVIDIA_CDI_FIX if name.startswith("nvidia.com/") else (
                    "write or generate a CDI spec for it in /etc/cdi, or check the name with `apirctl doctor`")
                return Blocked(reason=f"no CDI device {name}{known}", hint=hint)
            nvidia = nvidia or found.vendor == "nvidia"
        elif not name.startswith("/dev/"):
            return Blocked(reason=f"{name!r} is neither a CDI device name (vendor.com/class=name) nor a /dev path",
                           hint="e.g. --gpu-device nvidia.com/gpu=all or --gpu-device /dev/dri/renderD128")
        elif not any(n.path == name for n in files.render_nodes) and name != files.kfd and not Path(name).exists():
            return Blocked(reason=f"no device {name} on this host")
    backend = None if own_image else _pick_backend(backends, nvidia=nvidia)
    if backend is None and not own_image:
        return Blocked(reason="no apirctl image has a GPU backend", hint=CUDA_FIX if nvidia else VULKAN_FIX)
    return Passthrough(devices=list(requested), backend=backend, what=", ".join(requested))


def backend_on_cpu(device: str) -> bool:
    """Whether every device of a backend's device line ("CPU: AMD EPYC (...), CUDA0: ...") is a CPU;
    an empty line (not known) is not."""
    names = [part.split(":", 1)[0].strip() for part in device.split(", ") if ":" in part]
    return bool(names) and all(name.upper().startswith("CPU") for name in names)


def device_names(device: str) -> str:
    """A backend's device line without its memory figures: "CPU: AMD EPYC (24105 MiB, ...)" -> "CPU: AMD EPYC"."""
    return ", ".join(part.split(" (", 1)[0] for part in device.split(", ") if ":" in part) or device


def decide(platform: str, offer: Passthrough | Blocked, remoting: Remoting) -> Choice:
    """`auto`'s decision table: passthrough, else remoting to a GPU backend, else the container's CPU;
    one line why."""
    if platform != "darwin" and isinstance(offer, Passthrough):
        return Choice(transport="gpu", reason=f"GPU passthrough: {offer.what} handed to the container")
    if platform == "darwin":
        offer = Blocked(reason="containers run in the podman machine's VM, whose GPU cannot be handed over")
    assert isinstance(offer, Blocked)
    if remoting.ready and remoting.on_cpu:
        device = device_names(remoting.device)
        return Choice(transport="none",
                      reason=f"the container's CPU: no passthrough ({offer.reason}), and the {remoting.kind} backend "
                             f"computes on the CPU too ({device}), where remoting only adds its transport; "
                             f"`--transport {remoting.kind}` uses it anyway")
    if remoting.ready and remoting.unreachable is None:
        return Choice(transport=remoting.kind,
                      reason=f"{remoting.kind} remoting to the host GPU backend (no passthrough: {offer.reason})")
    if remoting.ready:
        hint = f"; {remoting.unreachable_hint}" if remoting.unreachable_hint else ""
        return Choice(transport="none",
                      reason=f"the container's CPU: no passthrough ({offer.reason}); the {remoting.kind} backend is "
                             f"ready, but {remoting.unreachable}{hint}")
    steps = [s for s in (offer.hint, remoting.step) if s]
    tail = f"; to go faster: {' or '.join(steps)}" if steps else ""
    return Choice(transport="none",
                  reason=f"the container's CPU: no passthrough ({offer.reason}) and remoting is not ready "
                         f"({remoting.why or 'no backend'}){tail}")
