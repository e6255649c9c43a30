"""Versions and a description of the host: what `apirctl info` prints and bug reports need.

The upstream project asks reporters for the bundle version, the image and the host's
hardware and software; `report()` gathers all of it in one block.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from apirctl import __version__, gpu, host
from apirctl.build import image, llamacpp
from apirctl.errors import ApirctlError
from apirctl.gpu import nvidia
from apirctl.macos import bundle
from apirctl.remoting import hostloopback


class SystemInfo(BaseModel):
    apirctl: str
    python: str
    os: str
    kernel: str
    arch: str
    cpu: str
    cpu_count: int
    memory_gib: float | None
    gpus: list[str]
    podman: str | None
    llama_cpp: dict[str, Any] | None
    image: str | None
    bundle: dict[str, Any] | None
    gpu_passthrough: dict[str, Any] | None = None  # apirctl.gpu.GpuReport (Linux)


def _run(cmd: list[str], timeout: float = 5.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def cpu_model() -> str:
    if host.os_is_macos():
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def gpus() -> list[str]:
    """GPUs the host can offer: NVIDIA from nvidia-smi, Apple's GPU from system_profiler."""
    found: list[str] = []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if out:
        found += [f"NVIDIA {line.strip()}" for line in out.splitlines() if line.strip()]
    if host.os_is_macos():
        out = _run(["system_profiler", "SPDisplaysDataType"], timeout=15)
        if out:
            found += [m.group(1).strip() for m in re.finditer(r"Chipset Model:\s*(.+)", out)]
    return found


def os_name() -> str:
    if host.os_is_macos():
        return f"macOS {platform.mac_ver()[0]}"
    try:
        fields = dict(
            line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
        )
        return fields.get("PRETTY_NAME", "Linux").strip('"')
    except OSError:
        return platform.system()


def podman_version() -> str | None:
    out = _run(["podman", "--version"])
    return out.split()[-1] if out else None


def llama_cpp_info() -> dict[str, Any] | None:
    try:
        build = llamacpp.current_build()
    except ApirctlError:
        return None
    if build is None:
        return None
    return {
        "source": f"{llamacpp.SOURCE_DIST}=={llamacpp.SOURCE_VERSION}",
        "version": build.source_version,
        "backend": build.backend,
        "bin_dir": str(build.bin_dir),
        "options": build.options.model_dump() if build.options else "external build",
    }


def bundle_info() -> dict[str, Any] | None:
    active = bundle.active()
    if active is None:
        return None
    return {"version": active.version, "path": str(active.bin_dir.parent), "image": active.image}


def collect() -> SystemInfo:
    build = None
    try:
        build = llamacpp.container_build()
    except Exception:  # noqa: BLE001 - info must print whatever it can
        build = None
    image_tag = None
    if build is not None:
        image_tag = image.tag_for(build)
    return SystemInfo(
        apirctl=__version__,
        python=platform.python_version(),
        os=os_name(),
        kernel=platform.release(),
        arch=platform.machine(),
        cpu=cpu_model(),
        cpu_count=os.cpu_count() or 1,
        memory_gib=memory_gib(),
        gpus=gpus(),
        podman=podman_version(),
        llama_cpp=llama_cpp_info(),
        image=image_tag,
        bundle=bundle_info(),
        gpu_passthrough=_gpu_passthrough(),
    )


def _gpu_passthrough() -> dict[str, Any] | None:
    if host.is_macos():
        return None
    try:
        return gpu.report(hostloopback.containers_elsewhere()).model_dump(mode="json")
    except Exception:  # noqa: BLE001 - info must print whatever it can
        return None


def passthrough_lines(found: dict[str, Any]) -> list[str]:
    """The GPU passthrough facts of a `gpu.GpuReport` dump, one per line (info and doctor share them)."""
    offer, blocked = found.get("passthrough"), found.get("blocked")
    lines = [f"GPU passthrough: available: {offer['what']}" if offer else
             f"GPU passthrough: not available: {blocked['reason'] if blocked else 'unknown'}"]
    cdi = [d["kind"] + "=" + d["name"] for d in found.get("cdi_devices", [])]
    lines.append(f"CDI devices: {', '.join(cdi) or 'none'}"
                 + (f" ({len(found['cdi_problems'])} unreadable spec(s))" if found.get("cdi_problems") else ""))
    nvidia_specs = sorted({d["spec"] for d in found.get("cdi_devices", []) if d["kind"] == "nvidia.com/gpu"})
    if nvidia_specs:
        whose = {True: "written by `apirctl gpu cdi`", False: "the NVIDIA container toolkit"}
        lines.append("NVIDIA CDI spec: " + ", ".join(f"{s} ({whose[nvidia.generated_by_apirctl(s)]})"
                                                     for s in nvidia_specs))
    nodes = [f"{n['path']} ({n['driver'] or 'unknown driver'}{'' if n['accessible'] else ', no access'})"
             for n in found.get("render_nodes", [])]
    lines.append(f"render nodes: {', '.join(nodes) or 'none'}" + (f"; {found['kfd']}" if found.get("kfd") else ""))
    lines.append(f"GPU images: {', '.join(found.get('image_backends') or []) or 'none (CPU image only)'}")
    return lines


def report(info: SystemInfo) -> str:
    """A block to paste into a bug report (Markdown, one fact per line)."""
    lines = [
        "### apirctl bug report environment",
        f"- apirctl: {info.apirctl} (Python {info.python})",
        f"- host: {info.os}, kernel {info.kernel}, {info.arch}",
        f"- CPU: {info.cpu} ({info.cpu_count} cores), memory: {info.memory_gib} GiB",
        f"- GPU: {', '.join(info.gpus) or 'none found'}",
        f"- podman: {info.podman or 'not installed'}",
    ]
    if info.llama_cpp:
        lines.append(f"- llama.cpp: {info.llama_cpp['version']} ({info.llama_cpp['source']}), "
                     f"backend {info.llama_cpp['backend']}")
    else:
        lines.append("- llama.cpp: not built (apirctl setup)")
    lines.append(f"- image: {info.image or 'none'}")
    if info.bundle:
        lines.append(f"- remoting bundle: {info.bundle['version']} (image {info.bundle['image']})")
    else:
        lines.append("- remoting bundle: none")
    if info.gpu_passthrough is not None:
        lines += [f"- {line}" for line in passthrough_lines(info.gpu_passthrough)]
    return "\n".join(lines)
