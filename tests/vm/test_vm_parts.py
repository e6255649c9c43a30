"""The micro-VM's parts, real: the initramfs made from Debian's kernel and busybox packages, the root
filesystem made from the inference image, the accelerator decision, and the one-line refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl import config
from apirctl.errors import ApirctlError
from apirctl.vm import accel, boot, machines, region, rootfs

needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="the VM's kernel comes from apt (Debian)")


def _cpio_entries(data: bytes) -> dict[str, bytes]:
    """The files of a newc cpio archive (the initramfs apirctl writes), by name, in order."""
    entries: dict[str, bytes] = {}
    at = 0
    while True:
        header = data[at:at + 110]
        size, name_size = int(header[54:62], 16), int(header[94:102], 16)
        name = data[at + 110:at + 110 + name_size - 1].decode()
        if name == "TRAILER!!!":
            return entries
        at += 110 + name_size
        at += -at % 4
        entries[name] = data[at:at + size]
        at += size
        at += -at % 4


def _cpio_names(data: bytes) -> list[str]:
    return list(_cpio_entries(data))


def _cpio_file(data: bytes, name: str) -> bytes:
    return _cpio_entries(data)[name]


@needs_apt
def test_the_initramfs_carries_init_busybox_and_each_module_after_its_dependencies() -> None:
    files = boot.ensure_boot_files()
    names = _cpio_names(files.initrd.read_bytes())
    assert {"init", "bin/busybox", "modules.order"} <= set(names)
    order = [n.removeprefix("modules/").removesuffix(".ko") for n in names if n.startswith("modules/")]
    for module, before in (("virtio_pci", "virtio_ring"), ("virtio_blk", "virtio"), ("ext4", "crc32c_generic"),
                           ("ext4", "jbd2"), ("virtio_net", "net_failover")):
        assert order.index(before) < order.index(module), (before, module)
    assert files.kernel.stat().st_size > 1 << 20
    assert boot.ensure_boot_files() == files  # cached: the same files again
    init = _cpio_file(files.initrd.read_bytes(), "init").decode()
    # a remoting VM's shared memory: the ivshmem device's BAR, named to llama.cpp
    assert "= 0x1110 ]" in init and f"export {region.GUEST_ENV}=$d/resource2" in init


def test_a_dependency_missing_from_the_kernel_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.ko").write_bytes(b"\0license=GPL\0depends=nosuchmodule\0")
    with pytest.raises(ApirctlError, match="no module nosuchmodule"):
        boot.module_order(tmp_path, ("a",))


@pytest.mark.skipif(shutil.which("debugfs") is None, reason="debugfs (e2fsprogs) reads the image")
def test_the_root_filesystem_is_the_image_with_the_mount_points_init_needs(podman: str, llama_image: str) -> None:
    made = rootfs.ensure_rootfs(llama_image)
    listing = subprocess.run(["debugfs", "-R", "ls -p /", str(made.path)], capture_output=True, text=True).stdout
    top = {line.split("/")[5] for line in listing.splitlines() if line.count("/") >= 6}
    assert set(rootfs.MOUNT_POINTS) <= top
    found = subprocess.run(["debugfs", "-R", "stat /app/bin/llama-server", str(made.path)], capture_output=True,
                           text=True)
    assert "Type: regular" in found.stdout
    assert made.entrypoint == ["/app/bin/llama-server"] and made.env["LD_LIBRARY_PATH"] == "/app/bin"
    again = rootfs.ensure_rootfs(llama_image)
    assert again.path == made.path and again.path.stat().st_mtime == made.path.stat().st_mtime  # cached by id


def test_the_accelerator_is_kvm_only_where_it_runs_ordinary_guests(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    device, modules = tmp_path / "kvm", tmp_path / "module"
    modules.mkdir()
    assert "absent" in (accel.kvm_problem(device, modules) or "")
    device.write_bytes(b"")
    device.chmod(0o600)
    (modules / "kvm_pvm").mkdir()
    assert "PVM" in (accel.kvm_problem(device, modules) or "")
    (modules / "kvm_amd").mkdir()
    assert accel.kvm_problem(device, modules) is None
    monkeypatch.setattr(accel, "kvm_problem", lambda: "this host's KVM is PVM")
    assert accel.choose("auto").name == "tcg" and "PVM" in accel.choose("auto").why
    with pytest.raises(ApirctlError, match="cannot run a VM on KVM") as refused:
        accel.choose("kvm")
    assert refused.value.hint and "kvm" in refused.value.hint


def test_the_kernel_command_line_refuses_what_it_cannot_carry() -> None:
    line = machines.kernel_command_line("m.gguf", ["/app/bin/llama-server", "--alias", "a b"], {"PATH": "/app/bin"})
    assert line.endswith('-- /app/bin/llama-server --alias "a b"') and " PATH=/app/bin " in line
    with pytest.raises(ApirctlError, match="cannot be passed into a VM"):
        machines.kernel_command_line("m.gguf", ["--api-key", 'a"b'], {})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))


def test_serve_in_a_vm_refuses_other_transports_in_one_line(podman: str, demo_model: Path) -> None:
    done = _cli("serve", str(demo_model), "--isolation", "vm", "--transport", "gpu")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--isolation vm remotes with --transport rpc or virtgpu, not --transport gpu" in done.stderr
    sized = _cli("serve", str(demo_model), "--cpus", "2")
    assert sized.returncode != 0 and "--cpus sizes a VM" in sized.stderr and "Traceback" not in sized.stderr
    bad = _cli("serve", str(demo_model), "--isolation", "jail")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "'container' or 'vm'" in bad.stderr


def test_doctor_says_whether_micro_vms_can_use_kvm() -> None:
    done = _cli("doctor")
    line = next(line for line in done.stdout.splitlines() if "micro-VMs" in line)
    problem = accel.kvm_problem()
    if shutil.which(machines.QEMU) is None:
        assert "not installed" in line
    elif problem is None:
        assert line.startswith("✔")
    else:
        assert problem in line and "Traceback" not in done.stderr
        # where the VMs run emulated on a CPU with what emulation lacks, the fix names the setting
        assert ("native_cpu false" in done.stdout) == (accel.tcg_unemulated() is not None
                                                       and config.settings().native_cpu), done.stdout


def test_a_vm_whose_qemu_is_gone_is_listed_exited_logged_refused_a_restart_and_removed_by_stop(
        podman: str) -> None:
    """The listing, logs, restart and stop paths of a VM, on a record whose QEMU has ended (as after
    a kill): no boot needed, so this runs on every host."""
    from apirctl.podman.servers import L_API, L_ISOLATION, L_MODEL, L_TRANSPORT, L_VERSION

    name = "vm-gone-test"
    folder = machines.root() / name
    folder.mkdir(parents=True, mode=0o700)
    (folder / machines.CONSOLE).write_text("apirctl-init: starting /app/bin/llama-server\nllama-server said bye\n")
    labels = {L_VERSION: "0", L_MODEL: "demo", L_API: "http://127.0.0.1:1/v1", L_ISOLATION: "vm", L_TRANSPORT: "none"}
    machines._write(machines.VmRecord(name=name, id="ab" * 32, labels=labels, image="img", port=1, pid=2 ** 22 + 7,
                                      created=1.0e9, accel="kvm", memory_mb=512, cpus=1))
    listed = {s["name"]: s for s in json.loads(_cli("ps", "-a", "--json").stdout)}
    assert listed[name]["isolation"] == "vm" and listed[name]["state"] == "exited"
    assert name not in {s["name"] for s in json.loads(_cli("ps", "--json").stdout)}
    assert "llama-server said bye" in _cli("logs", name).stdout
    refused = _cli("restart", name)
    assert refused.returncode != 0 and "is a VM: restart is for containers" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert _cli("stop", name).returncode == 0
    assert not folder.exists()


def test_an_instruction_set_that_qemus_emulation_lacks_is_named(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 avx512f avx512dq\n\nprocessor\t: 1\n")
    assert accel.tcg_unemulated(cpuinfo) == "AVX-512"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\n")
    assert accel.tcg_unemulated(cpuinfo) is None
    assert accel.tcg_unemulated(tmp_path / "absent") is None


@pytest.mark.integration
@pytest.mark.skipif(accel.kvm_problem() is None or accel.tcg_unemulated() is None
                    or not config.settings().native_cpu,
                    reason="this host runs VMs on KVM, its CPU has nothing QEMU's emulation lacks, or the "
                           "builds are for any AVX2 CPU (native_cpu false)")
def test_an_emulated_vm_that_could_not_run_the_image_is_one_line_and_leaves_nothing(
        demo_model: Path, llama_image: str, podman: str) -> None:
    """Here VMs run emulated and the host build uses AVX-512: the VM's llama-server would die of an
    illegal instruction with nothing on its console. serve says so before a VM boots."""
    done = subprocess.run([sys.executable, "-m", "apirctl", "serve", str(demo_model), "--isolation", "vm",
                           "--transport", "none", "--name", "vm-tcg-refused", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("apirctl: error: a VM here runs on QEMU's emulation, which lacks AVX-512"), lines
    assert lines[1].startswith("hint: serve in a container; or build for any AVX2 CPU: `apirctl config set "
                               "native_cpu false`"), lines
    assert not machines.folder("vm-tcg-refused").exists()
    listed = subprocess.run([sys.executable, "-m", "apirctl", "ps", "-a", "--json"], capture_output=True, text=True,
                            timeout=60)
    assert "vm-tcg-refused" not in listed.stdout
