"""Micro-VM isolation: `serve --isolation vm` runs the inference image's llama-server in a QEMU VM.

`boot` (the distribution's kernel and an initramfs of its own, from Debian's packages into the
cache), `rootfs` (the image's files as a cached read-only ext4 image), `accel` (KVM where it runs
ordinary guests, else emulation, with the reason; doctor's check), `machines` (start, list, logs,
stop: one QEMU process and one runtime folder per VM, its record carrying a container's labels),
`relay` (the host end of a remoting VM's RPC stream: a backend connection per client session; a VM
and its backend end together).
"""

from __future__ import annotations

from apirctl.vm.accel import Accel, choose, kvm_problem, tcg_unemulated
from apirctl.vm.boot import BootFiles, ensure_boot_files
from apirctl.vm.machines import (
    GUEST_RPC_ENDPOINT,
    VmRecord,
    alive,
    ended,
    exists,
    launch,
    logs,
    records,
    relay_alive,
    remove,
    server_of,
    server_tail,
    servers,
)
from apirctl.vm.rootfs import RootFs, ensure_rootfs

__all__ = ["GUEST_RPC_ENDPOINT", "Accel", "BootFiles", "RootFs", "VmRecord", "choose", "ensure_boot_files",
           "ended", "ensure_rootfs", "exists", "kvm_problem", "launch", "alive", "relay_alive", "server_of",
           "server_tail", "logs", "records", "remove", "servers", "tcg_unemulated"]
