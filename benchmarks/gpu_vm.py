#!/usr/bin/env python3
"""Issue 32 on the GPU machine: llama-bench in a KVM micro-VM, its graphs computed on the host's GPU
through remoting, against native on the same GPU (gpu_remoting.py's `vm` part).

A VM here is the one `apirctl serve --isolation vm` and `apirctl bench --modes vm-remoting` boot
(apirctl/vm/): QEMU's q35 machine on KVM, Debian's kernel with apirctl's initramfs, the inference
image's files as the read-only root disk, the model as the second disk, QEMU's restricted user
network whose one `guestfwd` reaches a chardev socket, apirctl's relay between that socket and the VM's
own host process, and the memory they share as the guest's ivshmem device. The command lines come from
apirctl's own code (`machines.kernel_command_line`, `machines.qemu_command`, `Region`, `Relay`); only
the binaries differ: the host process is this build's `ggml-rpc-server` or `apir-host` over
libggml-cuda, and QEMU is Debian's, carried in a kit and run from its own folder.

The GPU machine has no QEMU and no Podman, so the parts are packed here first (`pack`) into a kit of
about 35 MiB that a call carries:

    benchmarks/gpu_vm.py pack --image localhost/apirctl/llama-server:TAG --rootfs ROOTFS.ext4 \\
        --boot BOOT_DIR --out .device/vmkit

- `qemu.tar.xz`: `qemu-system-x86_64`, the shared libraries it loads that are not glibc's, its TCG
  module (to try the part where KVM boots no ordinary guest), and the firmware a q35 machine with
  `-kernel` reads (SeaBIOS, the linuxboot and kvmvapic option ROMs, the virtio NIC's ROM);
- `vmlinuz`, `initrd`: apirctl's boot files (`vm.ensure_boot_files`);
- `rootfs.ext4.xz`: the root disk apirctl made of the image built for any AVX2 CPU (`native_cpu`
  false; `vm.ensure_rootfs`), and `kit.json`: the image, its build id, which must be the build key of
  this checkout's patch series (checked when packing), its entry point and environment.

Rows, per shape, in `--passes` alternated passes (the order of the VM rows reversed on every other
pass, a native row between passes and after the last): native; `vm_rpc` (llama-bench in the VM with
`--rpc` to the VM's forwarded address: the relay, then `ggml-rpc-server` on the GPU, the rings in the
ivshmem region); `vm_apir` (the guest's ggml-virtgpu frontend to an `apir-host` of the VM's own, its
resources in the region). A VM row counts only when its path is shown: RPC's rings in the region (the
guest's llama.cpp says so on the console) and, for APIR, the host's trace holding the row's graph
computes. Then once, for the first shape, `vm_cpu`: the VM's own CPU (the Lima-style row).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import lzma
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from gpu_harness import stop  # noqa: E402 - beside this file, on sys.path[0]

if TYPE_CHECKING:
    from gpu_harness import Runner

#: /dev/kvm's KVM_GET_API_VERSION ioctl: 12 on every KVM since Linux 2.6.22.
KVM_GET_API_VERSION = 0xAE00
#: The firmware a q35 machine booted with -kernel reads, the virtio NIC's option ROM, and what
#: vm_kvm_probe.sh boots with besides: the PVH entry's option ROM and microvm's qboot.
FIRMWARE = ("bios-256k.bin", "linuxboot_dma.bin", "kvmvapic.bin", "efi-virtio.rom", "pvh.bin", "bios-microvm.bin")
FIRMWARE_DIRS = (Path("/usr/share/qemu"), Path("/usr/share/seabios"), Path("/usr/lib/ipxe/qemu"))
#: QEMU's modules a VM here loads: TCG (`--vm-accel tcg`) is one in Debian's build; KVM needs none.
MODULE_DIR = Path("/usr/lib/x86_64-linux-gnu/qemu")
MODULES = ("accel-tcg-x86_64.so",)
#: glibc's own libraries: the machine's are used (the kit's binaries need one no newer than the packer's).
GLIBC = ("libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux", "libresolv.so",
         "linux-vdso")
VM_TIMEOUT = 420.0
#: Seconds from QEMU's start to init's line: KVM boots in a few; emulation on a loaded host takes tens.
#: A VM past it does not boot on this host (the GPU machine's KVM, docs/vm.md), and no later VM row runs.
BOOT_TIMEOUT = {"kvm": 60.0, "tcg": 300.0}
GUEST_LLAMA_BENCH = "llama-bench"


# --- packing, on a machine with apirctl's image and Debian's QEMU ----------------------------------


def pack(args: argparse.Namespace) -> int:
    from apirctl.build import llamacpp

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    labels = json.loads(subprocess.run(["podman", "image", "inspect", "--format", "{{json .Labels}}", args.image],
                                       capture_output=True, text=True, check=True).stdout)
    built = labels.get("apirctl.llama-cpp.build-id")
    portable = llamacpp.host_options("cpu").model_copy(update={"native": False})
    if built != portable.key():
        print(f"gpu_vm: {args.image} was built from {built}, not this series' portable CPU build "
              f"{portable.key()}", file=sys.stderr)
        print("hint: `apirctl config set native_cpu false && apirctl setup`, then pack again", file=sys.stderr)
        return 1
    meta = json.loads(args.rootfs.with_suffix(".json").read_text())
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        print("gpu_vm: qemu-system-x86_64 is not installed\nhint: run scripts/system-deps.sh", file=sys.stderr)
        return 1
    libraries = []
    for line in subprocess.run(["ldd", qemu], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > 2 and parts[2].startswith("/") and \
                not any(parts[0].startswith(g) for g in GLIBC):
            libraries.append(Path(parts[2]))
    firmware = []
    for name in FIRMWARE:
        found = next((d / name for d in FIRMWARE_DIRS if (d / name).exists()), None)
        if found is None:
            print(f"gpu_vm: no {name} in {', '.join(map(str, FIRMWARE_DIRS))}", file=sys.stderr)
            return 1
        firmware.append(found)
    with tarfile.open(out / "qemu.tar.xz", "w:xz") as tar:
        tar.add(qemu, "qemu/bin/qemu-system-x86_64")
        for lib in libraries:
            tar.add(lib.resolve(), f"qemu/lib/{lib.name}")
        for path in firmware:
            tar.add(path.resolve(), f"qemu/share/{path.name}")
        for module in MODULES:  # loaded from QEMU_MODULE_DIR (`qemu_env`)
            tar.add(MODULE_DIR / module, f"qemu/modules/{module}")
    with args.rootfs.open("rb") as src, lzma.open(out / "rootfs.ext4.xz", "wb", preset=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    for name in ("vmlinuz", "initrd"):
        shutil.copyfile(args.boot / name, out / name)
    version = subprocess.run([qemu, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    kit = {"image": args.image, "image_id": meta["image"], "build_id": built, "options": portable.model_dump(),
           "patch_digest": llamacpp.patches_digest(), "entrypoint": meta["entrypoint"], "env": meta["env"],
           "qemu": version, "libraries": [lib.name for lib in libraries], "boot": args.boot.name}
    (out / "kit.json").write_text(json.dumps(kit, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"gpu_vm: kit in {out}: {size / 2**20:.1f} MiB ({len(libraries)} libraries, {version})")
    return 0


# --- the part, on the GPU machine -----------------------------------------------------------------


def kvm_api_version() -> int:
    """/dev/kvm answers (the machine boots ordinary guests only where this is hardware KVM: the boot
    itself is the proof, and the console's first line is timed)."""
    fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    try:
        return fcntl.ioctl(fd, KVM_GET_API_VERSION)
    finally:
        os.close(fd)


class VmPart:
    """The `vm` part: unpack the kit, then alternate native and the VM rows per shape."""

    def __init__(self, runner: Runner) -> None:
        self.r = runner
        self.kit: Path = runner.args.vm_kit
        self.root = runner.work / "vm"
        # apirctl's runtime folders (a VM's folder, its console) go under the work folder
        os.environ["APIRCTL_HOME"] = str(self.root / "home")
        self.meta: dict[str, Any] = {}
        self.qemu = self.root / "qemu" / "bin" / "qemu-system-x86_64"
        self.cpus = max(1, min(runner.args.vm_cpus, os.cpu_count() or 1))

    def prepare(self) -> bool:
        self.root.mkdir(parents=True, exist_ok=True)
        self.meta = json.loads((self.kit / "kit.json").read_text())
        if not self.qemu.exists():
            with tarfile.open(self.kit / "qemu.tar.xz") as tar:
                tar.extractall(self.root, filter="data")
        rootfs = self.root / "rootfs.ext4"
        if not rootfs.exists():
            with lzma.open(self.kit / "rootfs.ext4.xz", "rb") as src, (self.root / "rootfs.tmp").open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            (self.root / "rootfs.tmp").replace(rootfs)
        version = subprocess.run([str(self.qemu), "--version"], env=self.qemu_env(), capture_output=True, text=True,
                                 check=True).stdout.splitlines()[0]
        self.r.results["env"]["vm"] = {"kvm_api": kvm_api_version() if self.r.args.vm_accel == "kvm" else None,
                                       "accel": self.r.args.vm_accel, "qemu": version, "cpus": self.cpus,
                                       "guest_image": {k: self.meta[k] for k in ("image", "image_id", "build_id",
                                                                                 "patch_digest", "options")},
                                       "kernel": self.meta.get("boot"), "kit_sha256": self.kit_digest()}
        self.r.log(f"vm: {version}, KVM API {self.r.results['env']['vm']['kvm_api']}, {self.cpus} vCPUs")
        return True

    def kit_digest(self) -> str:
        h = hashlib.sha256()
        for name in ("kit.json", "vmlinuz", "initrd"):
            h.update((self.kit / name).read_bytes())
        return h.hexdigest()[:12]

    def qemu_env(self) -> dict[str, str]:
        return dict(os.environ) | {"LD_LIBRARY_PATH": str(self.root / "qemu" / "lib"),
                                   "QEMU_MODULE_DIR": str(self.root / "qemu" / "modules")}

    # -- rows -------------------------------------------------------------------------------------
    def measure(self) -> None:
        r = self.r
        for index, shape in enumerate(r.args.shapes):
            keys: list[str] = []
            r.step(f"{shape}/vm-native-0", r.bench, "native", shape, [])
            keys.append("native")
            for n in range(r.args.passes):
                rows = [("vm_rpc", "rpc"), ("vm_apir", "apir")]
                for key, remoting in rows if n % 2 == 0 else reversed(rows):
                    name = f"{key}_{n}"
                    if r.step(f"{shape}/{name}", self.vm_row, shape, name, remoting, need=90) is not None:
                        keys.append(name)
                r.step(f"{shape}/vm-native-{n + 1}", r.bench, f"native_{n + 1}", shape, [])
                keys.append(f"native_{n + 1}")
            if index == 0 and "vm-cpu" in r.args.vm_rows and \
                    r.step(f"{shape}/vm_cpu", self.vm_row, shape, "vm_cpu", "", need=120) is not None:
                keys.append("vm_cpu")
            r.results.setdefault("vm", {})[shape] = self.ratios(shape, keys)
            r.save()
            r.log(f"{shape} vm: {json.dumps(r.results['vm'][shape]['ratio_range'])}")

    def ratios(self, shape: str, keys: list[str]) -> dict:
        """Each VM row's t/s over the mean of the native rows on either side of its pass (the rows are
        alternated: drift falls on both), and the range per row kind and test over every pass."""
        bench = self.r.results["bench"].get(shape, {})
        order = [k for k in keys if k in bench]
        per_row: dict[str, dict[str, float]] = {}
        ranges: dict[str, dict[str, list[float]]] = {}
        for i, key in enumerate(order):
            if key.startswith("native"):
                continue
            before = next((k for k in reversed(order[:i]) if k.startswith("native")), None)
            after = next((k for k in order[i + 1:] if k.startswith("native")), None)
            natives = [n for n in (before, after) if n is not None]
            for row in bench[key]["rows"]:
                test = f"{'pp' if row['n_prompt'] else 'tg'}{row['n_prompt'] or row['n_gen']}"
                base = [nr["avg_ts"] for n in natives for nr in bench[n]["rows"]
                        if (nr["n_prompt"], nr["n_gen"]) == (row["n_prompt"], row["n_gen"])]
                if not base:
                    continue
                ratio = round(row["avg_ts"] / (sum(base) / len(base)), 3)
                per_row.setdefault(key, {})[test] = ratio
                kind = key.rsplit("_", 1)[0] if key[-1].isdigit() else key
                ranges.setdefault(kind, {}).setdefault(test, []).append(ratio)
        return {"order": order, "ratio": per_row,
                "ratio_range": {k: {t: [min(v), max(v)] for t, v in d.items()} for k, d in ranges.items()}}

    def vm_row(self, shape: str, key: str, remoting: str) -> str:
        """llama-bench in a VM of its own; its rows into results["bench"][shape][key] as gpu_remoting's
        `bench` writes them. Returns the row's key."""
        from apirctl.vm import BootFiles, Region, RootFs, VmRecord, machines

        r = self.r
        if self.unbootable:
            raise RuntimeError("skipped: an earlier VM did not boot on this host")
        model = r.models[shape]
        reps = r.args.reps if remoting else min(r.args.reps, 2)
        argv = [f"/app/bin/{GUEST_LLAMA_BENCH}", "-m", f"/models/{model.name}", "-ngl", "99", "-p", "512", "-n", "128",
                "-r", str(reps), "-o", "jsonl", "-t", str(self.cpus)]
        env = dict(self.meta["env"])
        if remoting == "rpc":
            argv += ["--rpc", machines.GUEST_RPC_ENDPOINT]
        elif remoting == "apir":
            env |= {"GGML_VIRTGPU_SOCKET": f"tcp:{machines.GUEST_RPC_ENDPOINT}", "GGML_VIRTGPU_SHARED_BUFFERS": "0"}
        else:
            argv[argv.index("-ngl") + 1] = "0"
        name = f"{key}-{shape}-{secrets.token_hex(3)}"
        region = Region.for_transport("virtgpu" if remoting == "apir" else "rpc") if remoting else None
        trace = r.logs / f"vm-{name}.trace"
        record = VmRecord(name=name, id=secrets.token_hex(32), labels={}, image=self.meta["image"], port=0,
                          created=time.time(), accel=r.args.vm_accel, memory_mb=(model.stat().st_size >> 20) + 2048,
                          cpus=self.cpus, rpc_instance="host" if remoting == "rpc" else "",
                          apir_host="host" if remoting == "apir" else "")
        folder = machines.folder(name)
        folder.mkdir(parents=True, mode=0o700)
        host: subprocess.Popen[bytes] | None = None
        qemu_pid = 0
        relay_thread: threading.Thread | None = None
        try:
            if region is not None:
                host, sock, log = self.start_host(remoting, region, trace, name)
            boot = BootFiles(self.kit / "vmlinuz", self.kit / "initrd", self.meta.get("boot", ""))
            rootfs = RootFs(self.root / "rootfs.ext4", self.meta["image_id"], self.meta["entrypoint"], self.meta["env"])
            cmdline = machines.kernel_command_line(model.name, argv, env)
            command = machines.qemu_command(record, boot, rootfs, model, cmdline, 0, "", region)
            command = [str(self.qemu), "-L", str(self.root / "qemu" / "share"), *command[1:]]
            started = time.monotonic()
            done = subprocess.run(command, env=self.qemu_env(), capture_output=True, text=True, timeout=60,
                                  pass_fds=(region.fd,) if region is not None else ())
            if done.returncode != 0:
                raise RuntimeError(f"QEMU did not start: {done.stderr.strip()[-400:]}")
            qemu_pid = int((folder / machines.PIDFILE).read_text())
            if region is not None:
                region.close()  # QEMU and the host process hold it now
            if host is not None:
                relay_thread = self.relay(folder / machines.RPC_SOCKET, qemu_pid, host, sock, log, remoting)
            console = self.follow(folder / machines.CONSOLE, qemu_pid, started)
        finally:
            if qemu_pid and _alive(qemu_pid):
                os.kill(qemu_pid, signal.SIGKILL)
            if host is not None:
                stop(host)
            if relay_thread is not None:
                relay_thread.join(10)
            if region is not None:
                region.close()
            with contextlib.suppress(OSError):
                shutil.copyfile(folder / machines.CONSOLE, r.logs / f"vm-{name}.console")
            shutil.rmtree(folder, ignore_errors=True)
        rows = [json.loads(line[line.index("{"):]) for line in console.splitlines()
                if '"avg_ts"' in line and "{" in line]
        if not rows:
            raise RuntimeError(f"{key}: llama-bench in the VM gave no results (see logs/vm-{name}.console)")
        r.results["bench"].setdefault(shape, {})[key] = {
            "wall_s": round(time.monotonic() - started, 2), "cmd": " ".join(argv), "client": "vm",
            "boot_s": self.boot_seconds, "accel": r.args.vm_accel,
            "rows": [{k: v for k, v in row.items() if k not in ("samples_ns", "model_filename", "cpu_info")}
                     for row in rows]}
        self.check_path(shape, key, remoting, console, trace)
        summary = ", ".join(f"{'pp' if x['n_prompt'] else 'tg'}{x['n_prompt'] or x['n_gen']}={x['avg_ts']:.1f}"
                            for x in rows)
        r.log(f"{shape} {key}: {summary} (boot {self.boot_seconds} s)")
        return key

    def check_path(self, shape: str, key: str, remoting: str, console: str, trace: Path) -> None:
        """A remoting row counts only where its graphs went the way its name says."""
        from apirctl.remoting import backends

        r = self.r
        if remoting == "rpc" and backends.SHM_LOG_LINE not in console:
            r.results["bench"][shape].pop(key)
            raise RuntimeError(f"{key}: the guest's llama.cpp did not use the rings in the VM's shared memory")
        if remoting == "apir":
            from apirctl.apir import trace as apir_trace

            summary = apir_trace.summarize(apir_trace.read(trace.read_bytes())) if trace.exists() else None
            wanted = r.args.reps * 128
            if summary is None or summary.computes < wanted or summary.failed:
                r.results["bench"][shape].pop(key)
                raise RuntimeError(f"{key}: apir-host's trace has {summary.computes if summary else 0} graph computes "
                                   f"(at least {wanted} expected): the row did not run through it")
            r.results["bench"][shape][key]["apir"] = {"graph_computes": summary.computes,
                                                      "host_s": round(summary.host_ns / 1e9, 3)}

    boot_seconds: float | None = None
    unbootable = False  # a VM did not boot: the rows after it are skipped

    def follow(self, console: Path, qemu_pid: int, started: float) -> str:
        """The console until QEMU exits (the program's end powers the VM off); the boot time is QEMU's
        start to init's first line."""
        self.boot_seconds = None
        deadline = started + VM_TIMEOUT
        boot_timeout = self.r.args.vm_boot_timeout or BOOT_TIMEOUT[self.r.args.vm_accel]
        boot_deadline = started + boot_timeout
        while True:
            text = console.read_text(errors="replace") if console.exists() else ""
            if self.boot_seconds is None and "apirctl-init: starting" in text:
                self.boot_seconds = round(time.monotonic() - started, 2)
            if self.boot_seconds is None and time.monotonic() > boot_deadline:
                self.unbootable = True
                last = next((line for line in reversed(text.splitlines()) if line.strip()), "nothing")
                raise RuntimeError(f"the VM did not reach its init within {boot_timeout:g} s "
                                   f"on {self.r.args.vm_accel} (its console's last line: {last.strip()[:160]})")
            if not _alive(qemu_pid):
                return console.read_text(errors="replace") if console.exists() else ""
            if time.monotonic() > deadline:
                raise RuntimeError(f"the VM's program did not end within {VM_TIMEOUT:g} s")
            time.sleep(0.1)

    def start_host(self, remoting: str, region: Any, trace: Path,
                   name: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """The VM's own host process, inheriting the region: ggml-rpc-server on the GPU, or apir-host
        over libggml-cuda, each on a socket in a private folder."""
        r = self.r
        private = Path(tempfile.mkdtemp(prefix="apirv-"))
        sock = private / ("rpc.sock" if remoting == "rpc" else "apir.sock")
        log = r.logs / f"vm-{name}-host.log"
        env = dict(os.environ)
        if remoting == "rpc":
            args = [str(r.bin / "ggml-rpc-server"), "-H", f"unix:{sock}", "-d", r.args.device]
            env |= region.backend_env()
            ready = None
        else:
            args = r.apir_host_command(sock, trace, region.fd)[0]
            ready = f"apir-host: listening on {sock}".encode()
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(args)}\n")
        out = log.open("ab")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=(region.fd,))
        out.close()
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {proc.returncode} (see {log.name})")
            if ready is not None and ready in log.read_bytes():
                break
            if ready is None:
                with socket.socket(socket.AF_UNIX) as probe, contextlib.suppress(OSError):
                    probe.connect(str(sock))
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not listen within 60 s (see {log.name})")
            time.sleep(0.05)
        return proc, sock, log

    def relay(self, guest_socket: Path, qemu_pid: int, host: subprocess.Popen[bytes], sock: Path, log: Path,
              remoting: str) -> threading.Thread:
        """apirctl's relay between QEMU's chardev socket and the host process, in a thread."""
        from apirctl.vm import relay

        guest = relay.connect_guest(guest_socket, qemu_pid, 30)
        kind, binary = ("rpc backend", "ggml-rpc-server") if remoting == "rpc" else ("apir-host", "apir-host")
        backend = relay.Backend(kind, binary, host.pid, sock, log, remoting == "rpc", lambda: stop(host))
        thread = threading.Thread(target=relay.Relay(guest, backend).run, daemon=True)
        thread.start()
        return thread


def _alive(pid: int) -> bool:
    """The process runs (apirctl's own reading of /proc: an exited QEMU is gone or a zombie)."""
    from apirctl.remoting import supervised

    return (supervised.proc_state(pid) or ("X",))[0] not in ("Z", "X")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack the VM kit (QEMU, boot files, the guest's root disk) for the GPU machine")
    p.add_argument("--image", required=True, help="apirctl's inference image of the build for any AVX2 CPU")
    p.add_argument("--rootfs", type=Path, required=True, help="its root disk (vm.ensure_rootfs), beside its .json")
    p.add_argument("--boot", type=Path, required=True, help="the folder of apirctl's vmlinuz and initrd")
    p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    return pack(args)


if __name__ == "__main__":
    raise SystemExit(main())
