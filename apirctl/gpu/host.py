"""This host's GPU paths, gathered: the facts `choice` decides on, and the report `doctor`/`info` print.

Reading them costs a directory listing or two and, when `nvidia-ctk` is installed, one short
process: cheap enough for every `serve --transport auto`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from apirctl.build import llamacpp
from apirctl.gpu.cdi import CdiDevice, CdiInventory, SpecProblem, inventory
from apirctl.gpu.choice import Blocked, Passthrough, find_passthrough
from apirctl.gpu.devices import DeviceFiles, RenderNode, scan


def gpu_builds() -> dict[str, llamacpp.Build]:
    """The finished llama.cpp builds with a backend a passthrough image can use, by backend."""
    found: dict[str, llamacpp.Build] = {}
    host_build = llamacpp.current_build()
    if host_build is not None and host_build.backend == "cuda":
        found["cuda"] = host_build
    vulkan = llamacpp.vulkan_build()
    if vulkan is not None:
        found["vulkan"] = vulkan
    return found


class GpuReport(BaseModel):
    """What `doctor` and `info` say about GPU passthrough on this host."""

    cdi_devices: list[CdiDevice] = Field(default_factory=list)
    cdi_problems: list[SpecProblem] = Field(default_factory=list)
    render_nodes: list[RenderNode] = Field(default_factory=list)
    kfd: str | None = None
    nvidia_driver: bool = False
    image_backends: list[str] = Field(default_factory=list)  # GPU builds an image can be made from
    engine_in_vm: bool = False
    passthrough: Passthrough | None = None
    blocked: Blocked | None = None


def facts(engine_in_vm: bool, requested: tuple[str, ...] = (), own_image: bool = False
          ) -> tuple[CdiInventory, DeviceFiles, dict[str, llamacpp.Build], bool, Passthrough | Blocked]:
    """(CDI inventory, device files, GPU builds, engine in a VM, the offer) for this host now.

    `engine_in_vm`: the containers run in a VM or on another host (`hostloopback.containers_elsewhere`),
    where this host's devices mean nothing."""
    cdi, files, builds, in_vm = inventory(), scan(), gpu_builds(), engine_in_vm
    offer = find_passthrough(cdi, files, builds.keys(), engine_in_vm=in_vm, requested=requested, own_image=own_image)
    return cdi, files, builds, in_vm, offer


def report(engine_in_vm: bool) -> GpuReport:
    cdi, files, builds, in_vm, offer = facts(engine_in_vm)
    return GpuReport(
        cdi_devices=cdi.devices, cdi_problems=cdi.problems, render_nodes=files.render_nodes, kfd=files.kfd,
        nvidia_driver=files.nvidia, image_backends=sorted(builds), engine_in_vm=in_vm,
        passthrough=offer if isinstance(offer, Passthrough) else None,
        blocked=offer if isinstance(offer, Blocked) else None,
    )
