"""The GPU device files of this host that a container can be given without CDI.

`/dev/dri/renderD*` are the render nodes Vulkan (Mesa's RADV, ANV, or NVIDIA's own driver) and
ROCm open; `/dev/kfd` is the AMD compute interface ROCm needs besides them. A render node's
driver name (`/sys/class/drm/renderD128/device/driver`) says whose it is. NVIDIA's proprietary
driver needs more than nodes (its libraries must match the kernel module), which is why it goes
through CDI instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field


class RenderNode(BaseModel):
    path: str
    driver: str | None = None  # amdgpu, i915, xe, nouveau, nvidia, virtio_gpu, ...
    accessible: bool = True  # can this user open it (rootless: the `render` group)


class DeviceFiles(BaseModel):
    render_nodes: list[RenderNode] = Field(default_factory=list)
    kfd: str | None = None  # /dev/kfd when present
    nvidia: bool = False  # the NVIDIA kernel driver is loaded (/dev/nvidiactl)

    @property
    def usable_render_nodes(self) -> list[RenderNode]:
        """Render nodes a container can do Vulkan on: this user can open them, and they are a GPU's
        (a VM's virtio-gpu is the macOS remoting door, not a GPU to compute on)."""
        return [n for n in self.render_nodes if n.accessible and n.driver != "virtio_gpu"]


def _driver(node: Path, sysfs: Path) -> str | None:
    link = sysfs / node.name / "device" / "driver"
    try:
        return os.readlink(link).rsplit("/", 1)[-1]
    except OSError:
        return None


def scan(dev: Path = Path("/dev"), sysfs: Path = Path("/sys/class/drm")) -> DeviceFiles:
    """What is under `dev` now (arguments for tests that lay out a fake /dev and /sys)."""
    nodes: list[RenderNode] = []
    try:
        found = sorted((dev / "dri").glob("renderD*"))
    except OSError:
        found = []
    for node in found:
        nodes.append(RenderNode(path=str(node), driver=_driver(node, sysfs),
                                accessible=os.access(node, os.R_OK | os.W_OK)))
    kfd = dev / "kfd"
    return DeviceFiles(render_nodes=nodes, kfd=str(kfd) if kfd.exists() else None,
                       nvidia=(dev / "nvidiactl").exists())
