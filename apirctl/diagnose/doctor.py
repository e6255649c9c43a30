"""`apirctl doctor`: every check the default path needs, each with the fix for its failure.

Checks run in dependency order and never raise: a failing check records what went wrong
and what to do, and checks that depend on it are reported as skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from apirctl import config, gpu, host, models, paths, vm
from apirctl.build import image, llamacpp
from apirctl.diagnose import sandbox, sysinfo
from apirctl.errors import ApirctlError
from apirctl.gpu import nvidia
from apirctl.podman import engine
from apirctl.remoting import hostloopback

Status = Literal["ok", "warn", "fail", "skip"]


class Check(BaseModel):
    name: str
    status: Status
    detail: str
    fix: str | None = None
    # what a check measured, for `--json` (the sandbox check: each server's attempts)
    data: dict[str, object] | None = None


class Report(BaseModel):
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status in ("ok", "warn") for c in self.checks)


def _podman() -> Check:
    try:
        version = engine.podman_version()
    except ApirctlError as exc:
        return Check(name="podman", status="fail", detail=exc.message, fix=exc.hint)
    return Check(name="podman", status="ok", detail="podman " + ".".join(map(str, version)))


def _runtime() -> Check:
    try:
        decision = engine.runtime_decision(refresh=True)
    except ApirctlError as exc:
        fix = exc.hint or ""
        return Check(name="containers start", status="fail", detail=exc.message,
                     fix=fix + ("; " if fix else "") + "on hosts that refuse ulimits or crun's cgroups, a "
                     "containers.conf with [engine] runtime = \"runc\" and [containers] default_ulimits = [] "
                     "fixes it (apirctl writes and uses one itself once runc is installed)")
    return Check(name="containers start", status="ok", detail=decision.reason)


def _api() -> Check:
    try:
        endpoint = engine.discover(start=True)
    except ApirctlError as exc:
        return Check(name="podman API", status="fail", detail=exc.message, fix=exc.hint)
    return Check(name="podman API", status="ok", detail=f"{endpoint.url} ({endpoint.source})")


def _build_tools() -> Check:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        return Check(name="build tools", status="fail", detail=f"missing: {', '.join(missing)}",
                     fix="install CMake and a C++ compiler (Debian: apt-get install cmake g++ ninja-build)")
    extra = "" if shutil.which("ninja") else " (ninja not found: builds use make, a little slower)"
    return Check(name="build tools", status="ok", detail="cmake and a C++ compiler found" + extra)


def _llama_build() -> Check:
    try:
        build = llamacpp.current_build()
    except ApirctlError as exc:
        return Check(name="llama.cpp build", status="fail", detail=exc.message, fix=exc.hint)
    if build is None:
        return Check(name="llama.cpp build", status="fail", detail="not built", fix="run `apirctl setup`")
    proc = subprocess.run([str(build.binary("llama-server")), "--version"], capture_output=True, text=True)
    if proc.returncode != 0:
        return Check(name="llama.cpp build", status="fail",
                     detail=f"llama-server does not run: {(proc.stderr or proc.stdout).strip()[-200:]}",
                     fix="rebuild with `apirctl setup`")
    return Check(name="llama.cpp build", status="ok",
                 detail=f"{build.source_version} ({build.backend}) in {build.bin_dir}")


def _image() -> Check:
    build = llamacpp.container_build()
    if build is None:
        return Check(name="inference image", status="skip", detail="no container build yet",
                     fix="run `apirctl setup`")
    tag = image.tag_for(build)
    if not image.exists(tag):
        return Check(name="inference image", status="fail", detail=f"{tag} not built", fix="run `apirctl setup`")
    if not image.is_current(build, tag):
        return Check(name="inference image", status="fail", detail=f"{tag} was built from another llama.cpp build",
                     fix="run `apirctl setup` to rebuild it")
    return Check(name="inference image", status="ok", detail=tag)


def _model() -> Check:
    ref = config.settings().default_model
    try:
        found = models.resolve(ref, pull=False)
    except ApirctlError as exc:
        return Check(name="demo model", status="fail", detail=f"{ref}: {exc.message}",
                     fix=f"run `apirctl models pull {ref}` (or `apirctl setup`)")
    return Check(name="demo model", status="ok", detail=f"{ref} -> {found.path}")


def _gpu() -> Check:
    backend = llamacpp.detect_backend()
    gpus = sysinfo.gpus()
    if backend == "cpu":
        return Check(name="host GPU backend", status="warn",
                     detail="no GPU backend on this host: remoting runs on the host CPU"
                     + (f" (found {', '.join(gpus)} but no nvcc)" if gpus else ""),
                     fix="on an NVIDIA host install the CUDA toolkit (nvcc) and rerun `apirctl setup`")
    return Check(name="host GPU backend", status="ok", detail=f"{backend}: {', '.join(gpus) or 'GPU found'}")


def _runtime_dir() -> Check:
    """The private directory of the RPC sockets (Linux): created 0700 when missing, refused when open."""
    if host.is_macos():
        return Check(name="runtime directory", status="skip", detail="Linux remoting only")
    folder = paths.private_dir(paths.dirs().runtime)
    paths.socket_path(folder / "rpc-00000000", "rpc.sock")  # the longest socket path apirctl makes there
    return Check(name="runtime directory", status="ok", detail=f"{folder} (mode 0700, this user's)")


def _passthrough() -> Check:
    """Can a container be given the GPU itself (apirctl.gpu)? A warning, never a failure: remoting
    and the CPU remain."""
    if host.is_macos():
        return Check(name="GPU passthrough", status="ok",
                     detail="not on macOS: containers run in the podman machine's VM; remoting (virtgpu) is the path")
    found = gpu.report(hostloopback.containers_elsewhere())
    detail = "; ".join(sysinfo.passthrough_lines(found.model_dump(mode="json"))).removeprefix("GPU passthrough: ")
    problems = "; ".join(f"{p.path}: {p.reason}" for p in found.cdi_problems)
    if found.passthrough is not None:
        status: Status = "warn" if problems else "ok"
        return Check(name="GPU passthrough", status=status, detail=detail,
                     fix=f"fix or remove the unreadable CDI specs ({problems})" if problems else None)
    fix = found.blocked.hint if found.blocked else None
    if problems:
        fix = (fix + "; " if fix else "") + f"fix or remove the unreadable CDI specs ({problems})"
    return Check(name="GPU passthrough", status="warn", detail=detail, fix=fix)


def _micro_vms() -> Check:
    """`serve --isolation vm`: QEMU, and /dev/kvm that runs an ordinary guest. Only a failure where
    the isolation setting is vm; elsewhere a warning (containers do not need it)."""
    if host.is_macos():
        return Check(name="micro-VMs", status="skip", detail="Linux only")
    bad: Status = "fail" if config.settings().isolation == "vm" else "warn"
    if shutil.which(vm.machines.QEMU) is None:
        return Check(name="micro-VMs", status=bad, detail=f"{vm.machines.QEMU} is not installed",
                     fix="run scripts/system-deps.sh (Debian: qemu-system-x86)")
    problem = vm.kvm_problem()
    if problem is not None:
        fix = vm.accel.HINT if "readable" in problem or "absent" in problem else \
            "VMs run emulated here (slow); use a host whose KVM has hardware virtualization"
        if (lacks := vm.tcg_unemulated()) is not None and config.settings().native_cpu:
            # a build for this CPU dies in an emulated VM: say so before the first VM does
            fix += (f"; emulation lacks this CPU's {lacks}: `apirctl config set native_cpu false`, then "
                    "`apirctl setup`")
        return Check(name="micro-VMs", status=bad, detail=problem, fix=fix)
    return Check(name="micro-VMs", status="ok", detail="/dev/kvm runs guests; QEMU found")


def _gpu_sharing() -> Check:
    """Several containers on one NVIDIA GPU: each backend is a CUDA process of its own, and without
    MPS the GPU switches between their contexts (docs/linux.md). Advice, never a warning."""
    if host.is_macos() or not nvidia.find_driver(ldconfig_text="", smi="").gpus:
        return Check(name="GPU sharing", status="skip", detail="no NVIDIA GPU")
    mps = nvidia.mps_state()
    if mps.running:
        return Check(name="GPU sharing", status="ok",
                     detail=f"CUDA MPS running (pid {', '.join(map(str, mps.pids))}; clients look in "
                            f"{mps.pipe_directory}): the backends of several containers compute at once")
    return Check(name="GPU sharing", status="ok",
                 detail="CUDA MPS not running: the backends of several containers take turns on the GPU; "
                        "to serve several at once, start `nvidia-cuda-mps-control -d` before "
                        "`apirctl machine restart --remoting`")


def _sandbox() -> Check:
    """The host servers run each container's graphs in a sandbox: their selftests show it holds."""
    if host.is_macos():
        return Check(name="host sandbox", status="skip", detail="Linux host servers only")
    build = llamacpp.current_build()
    if build is None:
        return Check(name="host sandbox", status="skip", detail="no llama.cpp build")
    results = sandbox.selftests(build)
    if not results:
        return Check(name="host sandbox", status="skip", detail="this build has no host servers")
    data: dict[str, object] = {r.server: r.model_dump(mode="json") for r in results}
    parts, fixes = [], []
    for r in results:
        if r.error is not None:
            parts.append(f"{r.server}: {r.error}")
            fixes.append("rebuild with `apirctl setup` (the selftest came with llama_patches 0016)")
            continue
        landlock = f"ABI {r.landlock_abi}" if r.landlock_abi else "OFF"
        layers = f"seccomp {'on' if r.seccomp else 'OFF'}, Landlock {landlock}"
        allowed = f"; ALLOWED: {', '.join(r.allowed)}" if r.allowed else ""
        broken = "" if r.threads and r.memfd and r.self_ok else "; what serving needs is BROKEN"
        parts.append(f"{r.server}: {len(r.attempts) - len(r.allowed)} of {len(r.attempts)} attempts denied "
                     f"({layers}){allowed}{broken}")
        if not (r.seccomp and r.landlock_abi):
            fixes.append("a kernel with seccomp-bpf and Landlock (5.13+, `lsm=landlock,...`) confines the servers")
        elif r.allowed or broken:
            fixes.append("report it: the sandbox of this build lets a compromised server act")
    status: Status = "ok" if all(r.ok for r in results) else "warn"
    if any(r.error is None and r.seccomp and (r.allowed or not (r.threads and r.memfd and r.self_ok))
           for r in results):
        status = "fail"
    return Check(name="host sandbox", status=status, detail="; ".join(parts),
                 fix="; ".join(dict.fromkeys(fixes)) or None, data=data)


# Each check and the checks that must pass before it makes sense.
CHECKS: list[tuple[str, Callable[[], Check], tuple[str, ...]]] = [
    ("podman", _podman, ()),
    ("containers start", _runtime, ("podman",)),
    ("podman API", _api, ("podman",)),
    ("build tools", _build_tools, ()),
    ("llama.cpp build", _llama_build, ()),
    ("inference image", _image, ("podman", "llama.cpp build")),
    ("demo model", _model, ()),
    ("host GPU backend", _gpu, ()),
    ("runtime directory", _runtime_dir, ()),
    ("host sandbox", _sandbox, ("llama.cpp build",)),
    ("GPU passthrough", _passthrough, ()),
    ("GPU sharing", _gpu_sharing, ()),
    ("micro-VMs", _micro_vms, ()),
]


def run(on_check: Callable[[Check], None] | None = None) -> Report:
    done: dict[str, Check] = {}
    for name, fn, needs in CHECKS:
        failed = [n for n in needs if done.get(n) and done[n].status in ("fail", "skip")]
        if failed:
            check = Check(name=name, status="skip", detail=f"needs {', '.join(failed)}")
        else:
            try:
                check = fn()
            except ApirctlError as exc:
                check = Check(name=name, status="fail", detail=exc.message, fix=exc.hint)
        done[name] = check
        if on_check:
            on_check(check)
    return Report(checks=list(done.values()))
