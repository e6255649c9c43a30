"""The system description saved with each benchmark: host, CPU/GPU, versions, transport, image.

llama-bench itself reports the CPU, GPU and backends it saw, which is more faithful
than guessing from the host, so those come from its native row when there is one; the
rest comes from `apirctl.sysinfo` (the same facts `apirctl info` prints).
"""

from __future__ import annotations

import platform
from typing import Any

from apirctl import __version__
from apirctl.bench.results import SystemInfo
from apirctl.diagnose import sysinfo


def _quiet(fn: Any) -> Any:
    """Optional facts (podman, bundle, GPUs) never fail a benchmark."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def collect(llama_bench: dict[str, Any] | None = None, host_backend: str | None = None,
            transport: str | None = None, image: str | None = None,
            llama_cpp: str | None = None) -> SystemInfo:
    """Describe this host; `llama_bench` is one raw llama-bench result row (native if possible)."""
    raw = llama_bench or {}
    build = None
    if raw.get("build_commit") or raw.get("build_number"):
        build = f"b{raw.get('build_number', '?')} ({raw.get('build_commit', '?')})"
    gpus = _quiet(sysinfo.gpus) or []
    bundle = _quiet(sysinfo.bundle_info)
    return SystemInfo(
        host=platform.node(),
        os=_quiet(sysinfo.os_name) or platform.platform(),
        arch=platform.machine(),
        cpu=str(raw["cpu_info"]) if raw.get("cpu_info") else _quiet(sysinfo.cpu_model),
        gpu=str(raw["gpu_info"]) if raw.get("gpu_info") else (", ".join(gpus) or None),
        python=platform.python_version(),
        apirctl=__version__,
        llama_cpp=build or llama_cpp,
        host_backend=host_backend,
        transport=transport,
        image=image,
        bundle=bundle.get("version") if isinstance(bundle, dict) else None,
        extra={k: v for k, v in {"podman": _quiet(sysinfo.podman_version), "kernel": platform.release(),
                                 "memory_gib": _quiet(sysinfo.memory_gib)}.items() if v is not None},
    )
