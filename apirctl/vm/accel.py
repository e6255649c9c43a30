"""Which accelerator a VM runs on, decided once per start, with the reason.

KVM when /dev/kvm opens read-write and the host's KVM runs ordinary guest kernels. A host whose
KVM is PVM (the `kvm_pvm` module: KVM without hardware virtualization, as some cloud sandboxes
expose) runs only PVM guest kernels: Debian's kernel hangs there before its first line. Such a
host, and one without /dev/kvm, gets QEMU's emulation (TCG) when the `vm_accel` setting allows
it (auto), which is slow but the same VM; `vm_accel = "kvm"` refuses instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from apirctl.errors import ApirctlError

KVM = Path("/dev/kvm")
MODULES = Path("/sys/module")
CPUINFO = Path("/proc/cpuinfo")
HINT = ("give this user access to /dev/kvm: `sudo usermod -aG kvm $USER` and log in again "
        "(or load KVM: `sudo modprobe kvm_intel` / `kvm_amd`)")


@dataclass(frozen=True)
class Accel:
    """The accelerator (kvm or tcg) and why, in one line."""

    name: str
    why: str


def kvm_problem(device: Path = KVM, modules: Path = MODULES) -> str | None:
    """Why this host cannot run an ordinary guest on KVM, or None when it can."""
    if not device.exists():
        return f"{device} is absent (KVM is not loaded, or the host has no hardware virtualization)"
    if not os.access(device, os.R_OK | os.W_OK):
        return f"{device} is not readable and writable by this user"
    hardware = any((modules / name).exists() for name in ("kvm_intel", "kvm_amd"))
    if (modules / "kvm_pvm").exists() and not hardware:
        return "this host's KVM is PVM (kvm_pvm), which boots only PVM guest kernels, not the distribution's"
    return None


def choose(setting: str = "auto") -> Accel:
    """kvm where it works; else tcg (auto) or a one-line refusal (kvm)."""
    problem = kvm_problem()
    if setting == "tcg":
        return Accel("tcg", "vm_accel is tcg")
    if problem is None:
        return Accel("kvm", "/dev/kvm")
    if setting == "kvm":
        raise ApirctlError(f"cannot run a VM on KVM: {problem}", hint=HINT)
    return Accel("tcg", f"emulated (TCG, slow): {problem}")


def tcg_unemulated(cpuinfo: Path = CPUINFO) -> str | None:
    """An instruction set this host's CPU has and QEMU's emulation does not (TCG stops at AVX2), or None.

    A llama.cpp built for this CPU (GGML_NATIVE, apirctl's default) uses it, and in an emulated VM its
    programs die of an illegal instruction as soon as they compute, before a line says why."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "AVX-512" if "avx512f" in flags else None


def build_problem(accel: Accel, native_build: bool) -> str | None:
    """Why an image whose llama.cpp was built for this CPU (`native_build`) cannot compute in a VM on
    `accel`, or None: emulation lacks an instruction set the build uses."""
    if accel.name == "kvm" or not native_build or not (lacks := tcg_unemulated()):
        return None
    return (f"a VM here runs on QEMU's emulation, which lacks {lacks}, and the image's llama.cpp is built for this "
            "CPU, which has it")


#: What `build_problem`'s user can do about it.
BUILD_HINT = "build for any AVX2 CPU: `apirctl config set native_cpu false`, then `apirctl setup`"
