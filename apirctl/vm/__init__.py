"""Micro-VM isolation: `serve --isolation vm` runs the inference image's llama-server in a QEMU VM.

`boot` (the distribution's kernel and an initramfs of its own, from Debian's packages into the
cache), `rootfs` (the image's files as a cached read-only ext4 image), `accel` (KVM where it runs
ordinary guests, else emulation, with the reason; doctor's check), `machines` (start, list, logs,
stop: one QEMU process and one runtime folder per VM, its record carrying a container's labels),
`relay` (the host end of a remoting VM's RPC stream: a backend connection per client session; a VM
and its backend end together), `region` (the memory the guest and its backend share: the rings of
the RPC transport, as the guest's ivshmem device).
"""

from __future__ import annotations

from apirctl.vm.accel import BUILD_HINT, Accel, build_problem, choose, kvm_problem, tcg_unemulated
from apirctl.vm.boot import BootFiles, ensure_boot_files
from apirctl.vm.machines import (
    GUEST_RPC_ENDPOINT,
    VmRecord,
    alive,
    ended,
    exists,
    follow_to_end,
    launch,
    logs,
    records,
    relay_alive,
    remove,
    server_of,
    server_tail,
    servers,
)
from apirctl.vm.region import Region
from apirctl.vm.rootfs import RootFs, ensure_rootfs

__all__ = ["BUILD_HINT", "GUEST_RPC_ENDPOINT", "Accel", "BootFiles", "Region", "RootFs",
           "VmRecord", "alive", "build_problem", "choose", "ended", "ensure_boot_files", "ensure_rootfs", "exists",
           "follow_to_end", "kvm_problem", "launch", "logs", "records", "relay_alive", "remove", "server_of",
           "server_tail", "servers", "tcg_unemulated"]
