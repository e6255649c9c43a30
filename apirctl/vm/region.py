"""The shared memory of a remoting VM: one sealed memfd, which QEMU shows the guest as an ivshmem
device and the VM's backend maps on the host (patch 0024 of llama_patches/).

The guest's llama.cpp cannot pass a memfd across the VM, so the rings of the RPC transport live in
this region instead: the guest maps the device's memory (`GUEST_ENV`, set by the VM's init), the
backend maps the memfd it was started with (`HOST_ENV`), and the stream through the relay carries only
the HELLO that agrees on it. The guest writes nothing outside the region, and the backend reads only
what it copied out of it and checked. apirctl makes the memfd, hands it to both processes when it
starts them, and closes its own copy: the region lives as long as the VM and its backend.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from types import TracebackType

#: Bytes of an RPC VM's region: a PCI BAR's size is a power of two; it holds the control page and two
#: rings of 1 MiB (the size the shared-memory transport measured fastest for a token's logits).
REGION_BYTES = 4 << 20
#: An APIR VM's: every shared resource of its frontend (llama_patches/ 0025): the reply page, the data
#: resource, a graph's held writes (72 MiB) and outputs (up to 64 MiB), with room to grow.
APIR_REGION_BYTES = 256 << 20
#: What the backend reads: the number of the descriptor it inherited.
HOST_ENV = "GGML_RPC_SHM_REGION_FD"
#: What the guest's llama.cpp reads: the device's memory, found by the VM's init (`boot`), for RPC's
#: rings and for APIR's resources.
GUEST_ENV = "GGML_RPC_SHM_REGION"
GUEST_APIR_ENV = "GGML_VIRTGPU_REGION"
#: QEMU's name for the region's memory backend.
QEMU_ID = "apirshm"


class Region:
    """The memfd while apirctl still holds it (between the backend's start and QEMU's); a context
    manager that closes it."""

    def __init__(self, fd: int, size: int = REGION_BYTES) -> None:
        self.fd = fd
        self.size = size

    @classmethod
    def create(cls, size: int = REGION_BYTES) -> Region:
        """A memfd of `size` bytes (a power of two), sealed so that no one can resize it (the backend
        refuses one that is not: a file that shrinks under a mapping faults)."""
        fd = os.memfd_create("apirctl-vm-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size)

    @classmethod
    def for_transport(cls, transport: str) -> Region:
        """The region a remoting VM's transport needs: RPC's rings (`REGION_BYTES`), or APIR's resources
        (`virtgpu`: `APIR_REGION_BYTES`)."""
        return cls.create(APIR_REGION_BYTES if transport == "virtgpu" else REGION_BYTES)

    def backend_env(self) -> dict[str, str]:
        return {HOST_ENV: str(self.fd)}

    def qemu_args(self) -> list[str]:
        """The region as the guest's ivshmem device: QEMU opens the memfd through its own descriptor of it
        (inherited at the same number), shared, so that the guest's writes land in the memfd's pages."""
        return ["-object", f"memory-backend-file,id={QEMU_ID},mem-path=/proc/self/fd/{self.fd},"
                           f"size={self.size},share=on",
                "-device", f"ivshmem-plain,memdev={QEMU_ID}"]

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Region:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
