"""The micro-VMs `serve --isolation vm` runs: started, listed, logged and stopped like containers.

Each VM is one QEMU process with a folder of its own under the runtime directory (`vms/NAME`:
its record, QEMU's pid file and the console log, which holds llama-server's output). The record
carries the same labels a server's container would, so `ps` lists a VM with `podman.servers`'
own reading of labels. `stop` ends QEMU and removes the folder; a VM whose QEMU died shows as
exited (its console log is still there for `logs`) until `stop` removes it.

The disks are the cached root filesystem (`rootfs`) and the model file itself, both read-only;
the server's port is forwarded from 127.0.0.1 only by QEMU's user network, which is restricted
(the guest reaches nothing outside). The kernel's command line carries llama-server's arguments
to the initramfs's init (`boot`).

A VM served with remoting (`rpc_instance`: its backend of its own, `apirctl.remoting.backends`; or
`apir_host`: its apir-host of its own, `apirctl.remoting.apir_hosts`)
reaches that one backend and nothing else: the restricted network's single `guestfwd` sends the
guest's connections to `GUEST_RPC` into a QEMU chardev, a Unix socket in the VM's folder (0700; the
socket 0600), which the VM's relay (`relay`) carries to the backend's socket, a session at a time.
QEMU listens on no port for it. Stopping the VM ends QEMU, then the relay, which stops the backend;
a backend that dies or refuses the guest's bytes makes the relay `end` the VM, with the reason that
`ps -a` shows, its folder kept until `stop`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, private_dir
from apirctl.podman.servers import Server, from_listed
from apirctl.remoting import apir_hosts, backends, supervised
from apirctl.vm import accel
from apirctl.vm.boot import BootFiles
from apirctl.vm.region import Region
from apirctl.vm.rootfs import RootFs

QEMU = "qemu-system-x86_64"
CONSOLE = "console.log"
PIDFILE = "qemu.pid"
RECORD = "vm.json"
#: Why apirctl ended the VM (`end`: its backend went), one line for `ps -a`.
ENDED = "ended"
#: QEMU's end of the guest's RPC stream (a chardev socket in the VM's folder).
RPC_SOCKET = "rpc-guest.sock"
#: The address the guest's llama.cpp dials for its backend: forwarded to `RPC_SOCKET`, nothing else.
GUEST_RPC = ("10.0.2.100", 50052)
GUEST_RPC_ENDPOINT = f"{GUEST_RPC[0]}:{GUEST_RPC[1]}"
#: The relay's module (`relay`), run with this interpreter; not imported here, so `-m` runs its only copy.
RELAY_MODULE = "apirctl.vm.relay"
STOP_TIMEOUT = 10.0
#: Characters the kernel's command line cannot carry inside one argument.
_UNSAFE = set('"\n\0')


class VmRecord(BaseModel):
    """What `ps` needs of a VM: its labels (a container's), port, QEMU's pid and how it was started."""

    name: str
    id: str
    labels: dict[str, str]
    image: str
    port: int
    pid: int = 0
    created: float
    accel: str
    memory_mb: int
    cpus: int
    command: list[str] = Field(default_factory=list)
    rpc_instance: str = ""  # its backend of its own (remoting), carried by the relay
    apir_host: str = ""  # or its apir-host of its own (remoting over APIR), carried by the relay
    relay_pid: int = 0

    @property
    def remoting(self) -> bool:
        """The guest reaches a host process of its own through its one forwarded address and relay."""
        return bool(self.rpc_instance or self.apir_host)


def root() -> Path:
    return dirs().runtime / "vms"


def folder(name: str) -> Path:
    return root() / name


def exists(name: str) -> bool:
    return (folder(name) / RECORD).is_file()


def _read(name: str) -> VmRecord | None:
    try:
        return VmRecord.model_validate_json((folder(name) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _write(record: VmRecord) -> None:
    path = folder(record.name) / RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json())
    tmp.replace(path)


def records() -> list[VmRecord]:
    base = root()
    if not base.is_dir():
        return []
    found = [_read(entry.name) for entry in sorted(base.iterdir())]
    return [r for r in found if r is not None]


def alive(record: VmRecord) -> bool:
    """QEMU of this VM still runs (a recycled pid is not it: its command names the VM's folder)."""
    if record.pid <= 0 or not supervised.is_process(record.pid, QEMU):
        return False
    with contextlib.suppress(OSError):
        return str(folder(record.name)) in Path(f"/proc/{record.pid}/cmdline").read_bytes().decode(errors="replace")
    return False


def server_of(record: VmRecord) -> Server:
    running = alive(record)
    item = {"Labels": record.labels, "Names": [record.name], "Id": record.id, "State": "running" if running
            else "exited", "Created": record.created, "Image": record.image, "StartedAt": record.created}
    return from_listed(item)


def servers(all: bool = False) -> list[Server]:  # noqa: A002
    """The VMs as servers, newest first; `all` adds those whose QEMU has ended."""
    found = [server_of(r) for r in records()]
    return [s for s in found if all or s.running]


# --- starting -------------------------------------------------------------------------------------


def kernel_command_line(model_file: str, argv: list[str], env: dict[str, str]) -> str:
    """console, panic → exit, and init's inputs: the model's name and the image's environment (the
    kernel hands init each KEY=VALUE it does not know) and, after `--`, the server's argv (each quoted)."""
    for key, value in env.items():
        if not key.replace("_", "").isalnum() or set(value) & (_UNSAFE | {" "}):
            raise ApirctlError(f"the image's environment variable {key} cannot be passed into a VM",
                               hint="run this image in a container")
    for arg in [model_file, *argv]:
        if _UNSAFE & set(arg):
            raise ApirctlError(f"the argument {arg!r} cannot be passed into a VM (it holds a quote or a newline)",
                               hint="leave that character out")
    quoted = " ".join(f'"{a}"' if (" " in a or not a) else a for a in argv)
    variables = " ".join(f"{k}={v}" for k, v in env.items())
    return f"console=ttyS0 quiet panic=-1 {variables} APIRCTL_MODEL={model_file} -- {quoted}"


def qemu_command(record: VmRecord, boot: BootFiles, rootfs: RootFs, model: Path, cmdline: str,
                 guest_port: int, host_ip: str, region: Region | None = None) -> list[str]:
    where = folder(record.name)
    machine = ["-M", "q35", "-accel", "kvm", "-cpu", "host,-arch-capabilities"] if record.accel == "kvm" else \
        ["-M", "q35", "-accel", "tcg,thread=multi", "-cpu", "max"]
    netdev = "user,id=net0,restrict=on"
    if record.port:  # a one-shot program's VM (a benchmark) publishes nothing
        netdev += f",hostfwd=tcp:{host_ip}:{record.port}-:{guest_port}"
    rpc: list[str] = []
    if record.remoting:  # the one way out of the VM: its backend, through QEMU's chardev socket
        netdev += f",guestfwd=tcp:{GUEST_RPC_ENDPOINT}-chardev:rpc"
        rpc = ["-chardev", f"socket,id=rpc,path={where / RPC_SOCKET},server=on,wait=off"]
        if region is not None:  # and the rings of its transport, in memory the backend maps too
            rpc += region.qemu_args()
    return [
        QEMU, *machine, "-m", str(record.memory_mb), "-smp", str(record.cpus),
        "-name", f"apirctl-{record.name}", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(boot.kernel), "-initrd", str(boot.initrd), "-append", cmdline,
        "-serial", f"file:{where / CONSOLE}",
        "-drive", f"id=root,file={rootfs.path},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-pci,drive=root",
        "-drive", f"id=model,file={model},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-pci,drive=model",
        *rpc, "-netdev", netdev, "-device", "virtio-net-pci,netdev=net0",
        "-daemonize", "-pidfile", str(where / PIDFILE),
    ]


def launch(record: VmRecord, boot: BootFiles, rootfs: RootFs, model: Path, argv: list[str], env: dict[str, str],
           guest_port: int, host_ip: str, model_file: str | None = None, region: Region | None = None) -> VmRecord:
    """Start QEMU for `record` (its folder made here); returns the record with QEMU's pid. QEMU's own
    refusal (no /dev/kvm access, a taken port) is one line; the folder is removed then. The guest sees
    the model as /models/`model_file` (default: the file's own name), the name llama-server's
    arguments give it: a model from the store is a blob whose name is its digest. A remoting VM's
    `region` (the memfd its backend was started with) becomes the guest's ivshmem device, and its
    backend is handed to its relay, which stops it with the VM."""
    base = private_dir(root())
    where = base / record.name
    try:
        where.mkdir(mode=0o700)
    except FileExistsError as exc:
        raise ApirctlError(f"a VM named {record.name} exists already",
                           hint=f"stop it with `apirctl stop {record.name}` or pick another --name") from exc
    try:
        cmdline = kernel_command_line(model_file or model.name, argv, env)
        record.command = qemu_command(record, boot, rootfs, model, cmdline, guest_port, host_ip,
                                      region if record.remoting else None)
        _write(record)
        inherited = (region.fd,) if region is not None and record.remoting else ()
        try:
            done = subprocess.run(record.command, capture_output=True, text=True, check=False, timeout=60,
                                  pass_fds=inherited)
        except FileNotFoundError as exc:
            raise ApirctlError(f"{QEMU} is not installed", hint="run scripts/system-deps.sh") from exc
        if done.returncode != 0:
            raise ApirctlError(f"QEMU did not start the VM: {tail(done.stderr, telling=('rror', 'annot', 'denied'))}",
                               hint=accel.HINT if "kvm" in done.stderr.lower() else "see the line above")
        record.pid = int((where / PIDFILE).read_text().strip())
        _write(record)
        if record.remoting:
            (where / RPC_SOCKET).chmod(0o600)  # its folder is 0700 already: the owner's alone, twice
            record.relay_pid = _start_relay(record)
            _write(record)
            # the relay stops it with the VM from now on; an apir-host is kept while the VM exists
            if record.rpc_instance and (instance := backends.get(record.rpc_instance)) is not None:
                backends.hand_over(instance, record.relay_pid)
            elif record.apir_host and (host := apir_hosts.get(record.apir_host)) is not None:
                apir_hosts.attach(host, record.id)
        return record
    except BaseException:
        remove(record.name)
        raise


def _start_relay(record: VmRecord) -> int:
    """The relay between QEMU's chardev socket and the VM's backend, in a session of its own: it
    outlives this serve; when QEMU ends it stops the backend, and when the backend goes it ends QEMU."""
    where = folder(record.name)
    with (where / "relay.log").open("ab") as log:
        backend = ["--instance", record.rpc_instance] if record.rpc_instance else ["--apir-host", record.apir_host]
        command = [sys.executable, "-m", RELAY_MODULE, "--guest", str(where / RPC_SOCKET), *backend,
                   "--vm", record.name, "--qemu-pid", str(record.pid)]
        child = subprocess.Popen(command,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    supervised.adopt(child)
    return child.pid


def relay_alive(record: VmRecord) -> bool:
    """The VM's relay still runs (a recycled pid is not it: its command names the VM's folder)."""
    if record.relay_pid <= 0 or (supervised.proc_state(record.relay_pid) or ("Z",))[0] in ("Z", "X"):
        return False
    with contextlib.suppress(OSError):
        cmdline = Path(f"/proc/{record.relay_pid}/cmdline").read_bytes().decode(errors="replace")
        return RELAY_MODULE in cmdline and str(folder(record.name)) in cmdline
    return False


# --- logs and stop --------------------------------------------------------------------------------


def console_path(name: str) -> Path:
    return folder(name) / CONSOLE


def logs(name: str, tail_lines: int | None = None, follow: bool = False,
         timeout: float | None = None) -> Iterator[str]:
    """The VM's console: the kernel's and init's lines, then the program's output. `follow` goes on
    until QEMU ends (a VM still running after `timeout` seconds is an error); a line is given once it
    is whole, or at the end."""
    try:
        stream = console_path(name).open(errors="replace")
    except OSError:
        return
    with stream:
        *lines, partial = stream.read().split("\n")
        lines = [line.rstrip("\r") for line in lines]  # a serial console ends lines with CR LF
        if not follow and partial:
            lines.append(partial.rstrip("\r"))
            partial = ""
        yield from lines[-tail_lines:] if tail_lines else lines
        record = _read(name) if follow else None
        deadline = time.monotonic() + timeout if timeout is not None else None
        while record is not None:
            running = alive(record)
            *complete, partial = (partial + stream.read()).split("\n")
            yield from (line.rstrip("\r") for line in complete)
            if not running:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise ApirctlError(f"the VM's program did not end within {timeout:g} s",
                                   hint="fewer or shorter runs end sooner; an emulated VM is slow")
            time.sleep(0.1)
        if partial:
            yield partial.rstrip("\r")


def follow_to_end(record: VmRecord, timeout: float, on_line: Callable[[str], None] | None = None) -> str:
    """A one-shot VM's console until its program ends (QEMU exits with it), each line given to `on_line`
    as it comes; a VM still running after `timeout` seconds is an error (the caller removes it)."""
    lines = []
    for line in logs(record.name, follow=True, timeout=timeout):
        lines.append(line)
        if on_line is not None:
            on_line(line)
    return "\n".join(lines)


_KERNEL_LINE = re.compile(r"^\[\s*\d+\.\d+\]")


def server_tail(name: str, lines: int) -> str:
    """The console's last lines from init and llama-server: the kernel's own (the panic that follows
    the server's exit, a stack trace) left out, as they say nothing about why the server ended."""
    kept = [line for line in logs(name) if not _KERNEL_LINE.match(line)]
    return "\n".join(kept[-lines:])


def _end_qemu(record: VmRecord, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout`; polls, never a fixed sleep. Only this VM's QEMU."""
    if not alive(record):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(record):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.02)


def wait_gone(name: str, timeout: float) -> bool:
    """Wait up to `timeout` seconds for the VM's QEMU to end by itself; whether it did."""
    record = _read(name)
    deadline = time.monotonic() + timeout
    while record is not None and alive(record):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def end(name: str, why: str, timeout: float = STOP_TIMEOUT) -> None:
    """End the VM's QEMU because of `why` (one line, which `ps -a` shows after `exited:`), keeping its
    folder, so that `logs` still reads its console until `stop` removes it. The relay calls it when the
    VM's backend is gone (see `relay`: a VM does not outlive its backend)."""
    record = _read(name)
    if record is None or not alive(record):  # ended already: by `stop`, a kill, or another reason first
        return
    with contextlib.suppress(OSError), (folder(name) / ENDED).open("x") as fh:  # the first reason stays
        fh.write((why.splitlines() or ["ended"])[0])
    _end_qemu(record, timeout)


def ended(name: str) -> str:
    """Why apirctl ended the VM (`end`), or "" when it did not (stopped, killed, or its server exited)."""
    try:
        return (folder(name) / ENDED).read_text().strip()
    except OSError:
        return ""


def remove(name: str, timeout: float = STOP_TIMEOUT) -> bool:
    """End the VM's QEMU (SIGTERM, then SIGKILL after `timeout`) and remove its folder; False when
    there was no such VM."""
    where = folder(name)
    if not where.is_dir():
        return False
    record = _read(name)
    if record is not None:
        _end_qemu(record, timeout)
        _end_relay(record, timeout)
    shutil.rmtree(where, ignore_errors=True)
    return True


def _end_relay(record: VmRecord, timeout: float) -> None:
    """The relay ends by itself once QEMU's stream closes (stopping the backend on its way out);
    wait for that, and end it only if it does not."""
    deadline = time.monotonic() + timeout
    while relay_alive(record):
        supervised.reap()
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.relay_pid, signal.SIGTERM if time.monotonic() < deadline + timeout else signal.SIGKILL)
        time.sleep(0.02)
