"""What a micro-VM boots: the distribution's kernel and an initramfs of its own.

Both come from Debian's packages, fetched with `apt-get download` and unpacked into apirctl's cache
(never installed into /boot): the kernel of `linux-image-amd64` and the static busybox of
`busybox-static`. The kernel builds virtio, ext4 and vsock as modules, so the initramfs carries
exactly the modules the VM needs (their dependencies found with `modinfo`), busybox, and `init`:
it loads the modules, brings up the network QEMU's user netdev expects, mounts the image's root
filesystem read-only, links the model's disk where llama-server looks for it, names a remoting VM's
shared memory (the ivshmem device's BAR, `region`) to llama.cpp, and hands PID 1 to
the server with `switch_root`. When the server ends, the kernel panics and QEMU exits
(`-no-reboot`, `panic=-1`): the VM lives exactly as long as the server.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, ensure
from apirctl.vm.region import GUEST_APIR_ENV, GUEST_ENV

KERNEL_PACKAGE = "linux-image-amd64"
BUSYBOX_PACKAGE = "busybox-static"
#: The modules init loads, in order (their dependencies first, found by `modinfo`).
MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "crc32c_generic", "ext4", "virtio_console",
           "vmw_vsock_virtio_transport")
#: Bumped when the initramfs's contents change, so a cached one is made again.
LAYOUT = "4"
#: Guest address, gateway and where the model's disk appears (the second virtio-blk disk).
GUEST_NET = ("10.0.2.15/24", "10.0.2.2")

INIT = r"""#!/bin/busybox sh
# apirctl's micro-VM init: modules, network, root filesystem, model disk; then the server as PID 1.
/bin/busybox mkdir -p /proc /sys /dev /newroot
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
for m in $(/bin/busybox cat /modules.order); do /bin/busybox insmod /modules/$m.ko 2>/dev/null; done
i=0
while [ ! -b /dev/vda ] || [ ! -b /dev/vdb ]; do
  i=$((i+1)); [ $i -gt 500 ] && { echo "apirctl-init: no disks"; exit 1; }
  /bin/busybox usleep 10000
done
/bin/busybox ip link set lo up
/bin/busybox ip link set eth0 up
/bin/busybox ip addr add @ADDR@ dev eth0
/bin/busybox ip route add default via @GW@
/bin/busybox mount -t ext4 -o ro /dev/vda /newroot || { echo "apirctl-init: cannot mount the root"; exit 1; }
/bin/busybox mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
/bin/busybox mount -t tmpfs tmpfs /newroot/models
/bin/busybox ln -s /dev/vdb "/newroot/models/$APIRCTL_MODEL"
# a remoting VM's shared memory (QEMU's ivshmem device, 1af4:1110): llama.cpp maps its BAR
for d in /sys/bus/pci/devices/*; do
  [ "$(/bin/busybox cat $d/vendor)" = 0x1af4 ] && [ "$(/bin/busybox cat $d/device)" = 0x1110 ] || continue
  echo 1 > $d/enable 2>/dev/null
  export @REGION_ENV@=$d/resource2 @APIR_REGION_ENV@=$d/resource2
done
/bin/busybox mount --move /dev /newroot/dev
/bin/busybox mount --move /proc /newroot/proc
/bin/busybox mount --move /sys /newroot/sys
echo "apirctl-init: starting $*"
exec /bin/busybox switch_root /newroot "$@"
"""


@dataclass(frozen=True)
class BootFiles:
    """The kernel and initramfs a VM boots, from the cache."""

    kernel: Path
    initrd: Path
    version: str


def _folder() -> Path:
    return dirs().cache / "vm"


def _run(args: list[str], cwd: Path | None = None, what: str = "") -> str:
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise ApirctlError(f"{args[0]} is not installed ({what or 'needed for VM isolation'})",
                           hint="run scripts/system-deps.sh") from exc
    if done.returncode != 0:
        raise ApirctlError(f"{' '.join(args[:3])} failed: {tail(done.stderr or done.stdout, telling=('E:', 'rror'))}",
                           hint="the VM's kernel comes from Debian's packages: apt-get must reach them")
    return done.stdout


def _package_version(package: str) -> str:
    """The exact package behind a metapackage (linux-image-amd64 → linux-image-6.1.0-NN-amd64), and its version."""
    shown = _run(["apt-cache", "policy", package], what="apt, to fetch the VM's kernel")
    for line in shown.splitlines():
        if line.strip().startswith("Candidate:"):
            return line.split(":", 1)[1].strip()
    raise ApirctlError(f"apt knows no package {package}", hint="run `apt-get update`")


def _kernel_package() -> str:
    """The versioned package linux-image-amd64 stands for (its first dependency on a linux-image)."""
    shown = _run(["apt-cache", "depends", KERNEL_PACKAGE], what="apt, to fetch the VM's kernel")
    for line in shown.splitlines():
        name = line.split(":", 1)[-1].strip()
        if line.strip().startswith("Depends:") and name.startswith("linux-image-"):
            return name
    raise ApirctlError(f"apt cannot tell which kernel {KERNEL_PACKAGE} stands for", hint="run `apt-get update`")


def _unpacked(package: str, into: Path) -> Path:
    """The package's files under `into` (downloaded once; an existing unpack is reused)."""
    if into.is_dir():
        return into
    with tempfile.TemporaryDirectory(dir=ensure(into.parent)) as tmp:
        _run(["apt-get", "download", package], cwd=Path(tmp), what="apt, to fetch the VM's kernel")
        debs = sorted(Path(tmp).glob("*.deb"))
        if not debs:
            raise ApirctlError(f"apt-get download {package} gave no package")
        staged = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(debs[0]), str(staged)])
        staged.rename(into)
    return into


def _kernel_tree(root: Path) -> tuple[Path, Path, str]:
    """(vmlinuz, the modules' folder, the kernel's release) of an unpacked kernel package."""
    found = sorted((root / "boot").glob("vmlinuz-*"))
    if not found:
        raise ApirctlError(f"the kernel package unpacked in {root} has no vmlinuz")
    release = found[-1].name.removeprefix("vmlinuz-")
    return found[-1], root / "lib" / "modules" / release, release


def _module_files(modules_dir: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in modules_dir.rglob("*.ko"):
        files[path.name.removesuffix(".ko").replace("-", "_")] = path
    return files


def _depends(path: Path) -> list[str]:
    """The modules a module needs: its `.modinfo` section's `depends=` string (what modinfo reads;
    kmod need not be installed)."""
    data = path.read_bytes()
    at = data.find(b"\0depends=")
    if at < 0:
        return []
    value = data[at + len(b"\0depends="):data.index(b"\0", at + 1)].decode()
    return [name.replace("-", "_") for name in value.split(",") if name]


def module_order(modules_dir: Path, wanted: tuple[str, ...] = MODULES) -> list[tuple[str, Path]]:
    """The modules to load, each after those it depends on."""
    files = _module_files(modules_dir)
    order: list[tuple[str, Path]] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        if name not in files:
            raise ApirctlError(f"the VM's kernel has no module {name}")
        for dep in _depends(files[name]):
            visit(dep)
        order.append((name, files[name]))

    for name in wanted:
        visit(name)
    return order


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive (the initramfs format) of (name, mode, data) entries."""
    out = io.BytesIO()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        encoded = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        out.write(b"070701" + b"".join(b"%08X" % value for value in fields) + encoded)
        out.write(b"\0" * (-out.tell() % 4))
        out.write(data)
        out.write(b"\0" * (-out.tell() % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        put(name, mode, data, ino)
    put("TRAILER!!!", 0, b"", 0)
    return out.getvalue()


def _initramfs(busybox: Path, modules: list[tuple[str, Path]]) -> bytes:
    directory, regular = 0o040755, 0o100755
    addr, gateway = GUEST_NET
    init = INIT
    for mark, value in (("@ADDR@", addr), ("@GW@", gateway), ("@APIR_REGION_ENV@", GUEST_APIR_ENV),
                        ("@REGION_ENV@", GUEST_ENV)):
        init = init.replace(mark, value)
    entries = [("bin", directory, b""), ("modules", directory, b""),
               ("bin/busybox", regular, busybox.read_bytes()), ("init", regular, init.encode()),
               ("modules.order", 0o100644, "\n".join(name for name, _ in modules).encode() + b"\n")]
    entries += [(f"modules/{name}.ko", 0o100644, path.read_bytes()) for name, path in modules]
    return _cpio(entries)


def ensure_boot_files() -> BootFiles:
    """The kernel and initramfs, made once per kernel version and initramfs layout. Once made, apt is
    not asked again (each apt-cache call costs seconds): a newer kernel is taken when the cache's
    `vm/boot-*` folders are removed."""
    made = sorted(p for p in _folder().glob(f"boot-*-l{LAYOUT}") if (p / "vmlinuz").is_file()
                  and (p / "initrd").is_file())
    if made:
        return BootFiles(kernel=made[-1] / "vmlinuz", initrd=made[-1] / "initrd", version=made[-1].name[5:])
    kernel_package = _kernel_package()
    kernel_version = f"{kernel_package.removeprefix('linux-image-')}-{_package_version(kernel_package)}"
    busybox_version = _package_version(BUSYBOX_PACKAGE)
    folder = ensure(_folder())
    key = f"{kernel_version}-bb{busybox_version}-l{LAYOUT}".replace(":", "_").replace("+", "_")
    ready = folder / f"boot-{key}"
    if (ready / "vmlinuz").is_file() and (ready / "initrd").is_file():
        return BootFiles(kernel=ready / "vmlinuz", initrd=ready / "initrd", version=key)
    kernel_root = _unpacked(kernel_package, folder / f"pkg-kernel-{kernel_version}".replace(":", "_"))
    busybox_root = _unpacked(BUSYBOX_PACKAGE, folder / f"pkg-busybox-{busybox_version}".replace(":", "_"))
    vmlinuz, modules_dir, _ = _kernel_tree(kernel_root)
    busybox = busybox_root / "bin" / "busybox"
    staged = Path(tempfile.mkdtemp(dir=folder, prefix=".boot-"))
    try:
        shutil.copyfile(vmlinuz, staged / "vmlinuz")
        (staged / "initrd").write_bytes(_initramfs(busybox, module_order(modules_dir)))
        try:
            staged.rename(ready)
        except OSError:  # another start made it first
            shutil.rmtree(staged)
        shutil.rmtree(kernel_root, ignore_errors=True)  # every module of the distribution: hundreds of MB
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return BootFiles(kernel=ready / "vmlinuz", initrd=ready / "initrd", version=key)
