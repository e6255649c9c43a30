"""The GPU paths of a Linux host that a container can be given directly (passthrough).

- `cdi`: CDI specs (`/etc/cdi`, `/var/run/cdi`, `nvidia-ctk cdi list`): named devices with their
  nodes, environment and mounts.
- `devices`: `/dev/dri` render nodes (Vulkan, ROCm), `/dev/kfd` (ROCm), the NVIDIA driver.
- `choice`: the passthrough this host offers and `auto`'s decision table, as pure functions.
- `host`: the facts of this host gathered for `choice`, and the report `doctor` and `info` print.
"""

from apirctl.gpu.cdi import SPEC_DIRS, CdiDevice, CdiInventory, inventory, is_qualified, parse_spec
from apirctl.gpu.choice import (
    NVIDIA_CDI_FIX,
    Blocked,
    Choice,
    ImageBackend,
    Passthrough,
    Remoting,
    backend_on_cpu,
    decide,
    device_names,
    find_passthrough,
)
from apirctl.gpu.devices import DeviceFiles, RenderNode, scan
from apirctl.gpu.host import GpuReport, facts, gpu_builds, report

__all__ = [
    "Blocked", "CdiDevice", "CdiInventory", "Choice", "DeviceFiles", "GpuReport", "ImageBackend",
    "NVIDIA_CDI_FIX", "Passthrough", "Remoting", "RenderNode", "SPEC_DIRS", "backend_on_cpu", "decide",
    "device_names", "facts",
    "find_passthrough", "gpu_builds", "inventory", "is_qualified", "parse_spec", "report", "scan",
]
