"""Remoting across the VM boundary, without waiting for a guest: the plan and QEMU's command line of a
remoting VM carry exactly one way out (the forwarded backend address), its backend is the container's
(sandboxed, capped), the relay splits one guest stream into one backend session per client, and a VM
and its backend end together (QEMU ended: the backend goes; the backend killed or refusing the guest's
bytes: the VM goes, `ps -a` says why, and `stop` leaves nothing); two VMs keep a backend each. Real
QEMU, real `ggml-rpc-server`; the guest idles and is never waited for. Where a test needs the guest's bytes, it
hands the relay one end of a socketpair in place of QEMU's chardev stream (QEMU is that socket's
listener, and only a booted guest writes into it)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import shutil
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.remoting import apir_hosts, backends, rpc_client, rpc_server, supervised
from apirctl.serve import options
from apirctl.serve.provision import local_plan
from apirctl.vm import accel, boot, machines, relay
from apirctl.vm.region import APIR_REGION_BYTES, HOST_ENV, REGION_BYTES, Region
from apirctl.vm.relay import Relay
from apirctl.vm.rootfs import RootFs
from tests.remoting.test_shm_native import RING0_HEAD, SHM_CAPS_MAGIC, hello
from tests.support.ports import free_port
from tests.support.waiting import wait_for

REGION_FEATURE = 2  # the shm capability's bit: rings in the region (llama_patches/ 0024)
needs_qemu = pytest.mark.skipif(shutil.which(machines.QEMU) is None, reason="QEMU is needed")
GIB = 1 << 30


@pytest.fixture
def vm_build(llama_build, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(llama_build.root))
    return llama_build


def test_the_serve_planner_gives_a_remoting_vm_a_backend_of_its_own_at_the_one_forwarded_address() -> None:
    plan = local_plan(options("smollm2", isolation="vm", transport="rpc"))
    assert plan.transport == "rpc" and plan.needs_backend and plan.rpc_link == "unix"
    assert plan.llama_args[:2] == ["--rpc", machines.GUEST_RPC_ENDPOINT]
    assert not plan.network_mode and not plan.devices  # nothing of a container's wiring
    assert local_plan(options("smollm2", isolation="vm", transport="none")).transport == "none"
    with pytest.raises(ApirctlError, match="remotes with --transport rpc or virtgpu"):
        local_plan(options("smollm2", isolation="vm", transport="gpu"))


def test_the_serve_planner_gives_an_apir_vm_an_apir_host_of_its_own_at_the_one_forwarded_address(
        vm_build: object) -> None:
    """APIR in a VM: an apir-host of its own, which the guest's frontend dials over TCP at the one forwarded
    address, its buffers in the host backend's memory (the region holds the transfers, not the weights)."""
    plan = local_plan(options("smollm2", isolation="vm", transport="virtgpu"))
    assert plan.transport == "virtgpu" and plan.needs_apir_host and not plan.needs_backend
    assert plan.environment == {"GGML_VIRTGPU_SOCKET": f"tcp:{machines.GUEST_RPC_ENDPOINT}",
                                "GGML_VIRTGPU_SHARED_BUFFERS": "0"}
    assert not plan.network_mode and not plan.devices and not plan.mounts


def test_auto_in_a_vm_picks_remoting_where_it_is_faster_and_says_why(vm_build: object, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "kvm_problem", lambda: "this host's KVM is PVM")  # emulation (TCG)
    chosen = local_plan(options("smollm2", isolation="vm"))
    assert chosen.transport == "rpc" and chosen.needs_backend and chosen.requested == "auto"
    assert chosen.notice and "tcg emulation" in chosen.notice
    monkeypatch.setattr(accel, "kvm_problem", lambda: None)  # a KVM that boots ordinary guests, a CPU host
    kept = local_plan(options("smollm2", isolation="vm"))
    assert kept.transport == "none" and kept.notice and "own CPU" in kept.notice
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(tmp_path))  # no usable host build: nothing to remote to
    alone = local_plan(options("smollm2", isolation="vm"))
    assert alone.transport == "none" and alone.notice and "the VM's own CPU" in alone.notice


def _record(name: str, rpc_instance: str = "", port: int = 18080) -> machines.VmRecord:
    from apirctl.podman.servers import L_API, L_ISOLATION, L_MODEL, L_RPC_INSTANCE, L_RPC_LINK, L_TRANSPORT, L_VERSION

    labels = {L_VERSION: "0", L_MODEL: "demo", L_API: f"http://127.0.0.1:{port}/v1", L_ISOLATION: "vm",
              L_TRANSPORT: "rpc" if rpc_instance else "none"}
    if rpc_instance:
        labels |= {L_RPC_LINK: "unix", L_RPC_INSTANCE: rpc_instance}
    return machines.VmRecord(name=name, id=secrets.token_hex(32), labels=labels, image="img", port=port,
                             created=time.time(), accel="tcg", memory_mb=256, cpus=1, rpc_instance=rpc_instance)


def _option(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


def test_qemu_of_a_remoting_vm_forwards_exactly_one_address_to_a_socket_in_its_private_folder(tmp_path: Path) -> None:
    files = boot.BootFiles(kernel=tmp_path / "k", initrd=tmp_path / "i", version="v")
    rootfs = RootFs(path=tmp_path / "root.img", image_id="x", entrypoint=[], env={})
    plain = machines.qemu_command(_record("plain"), files, rootfs, tmp_path / "m.gguf", "", 8000, "127.0.0.1")
    assert "guestfwd" not in " ".join(plain) and "-chardev" not in plain
    command = machines.qemu_command(_record("remote", "abcd1234"), files, rootfs, tmp_path / "m.gguf", "", 8000,
                                    "127.0.0.1")
    (netdev,) = _option(command, "-netdev")
    parts = netdev.split(",")
    assert "restrict=on" in parts
    forwards = [p for p in parts if p.startswith("guestfwd=")]
    assert forwards == [f"guestfwd=tcp:{machines.GUEST_RPC_ENDPOINT}-chardev:rpc"]
    assert [p for p in parts if p.startswith("hostfwd=")] == ["hostfwd=tcp:127.0.0.1:18080-:8000"]
    (chardev,) = _option(command, "-chardev")  # one chardev: a Unix socket, no TCP listener
    assert chardev == f"socket,id=rpc,path={machines.folder('remote') / machines.RPC_SOCKET},server=on,wait=off"
    assert "host=" not in chardev and "port=" not in chardev
    assert "-object" not in command and "-device" in command and not any("ivshmem" in a for a in command)


def test_a_remoting_vms_shared_memory_is_its_backends_sealed_memfd_as_one_ivshmem_device(tmp_path: Path) -> None:
    files = boot.BootFiles(kernel=tmp_path / "k", initrd=tmp_path / "i", version="v")
    rootfs = RootFs(path=tmp_path / "root.img", image_id="x", entrypoint=[], env={})
    with Region.for_transport("rpc") as made:
        seals = fcntl.fcntl(made.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        assert os.fstat(made.fd).st_size == REGION_BYTES and REGION_BYTES & (REGION_BYTES - 1) == 0
        command = machines.qemu_command(_record("remote", "abcd1234"), files, rootfs, tmp_path / "m.gguf", "", 8000,
                                        "127.0.0.1", made)
        (memory,) = _option(command, "-object")
        assert memory == (f"memory-backend-file,id=apirshm,mem-path=/proc/self/fd/{made.fd},size={REGION_BYTES},"
                          "share=on")
        assert [d for d in _option(command, "-device") if "ivshmem" in d] == ["ivshmem-plain,memdev=apirshm"]
        assert made.backend_env() == {HOST_ENV: str(made.fd)}
        fd = made.fd
    with pytest.raises(OSError):
        os.fstat(fd)  # closed when apirctl no longer needs it


@pytest.fixture
def idle_guest(tmp_path: Path) -> tuple[boot.BootFiles, RootFs]:
    """Boot files of a guest that never exits and never writes: a multiboot image (header, then
    `cli; hlt; jmp $-1`) that QEMU loads as its kernel. The distribution's kernel on an empty disk
    panics and ends QEMU after 4 to 12 s of emulation, which would race every check of a VM that must
    still run; this one keeps QEMU up (idle) until it is ended."""
    magic, flags, base = 0x1BADB002, 0x00010000, 0x100000  # flags: the load addresses are in the header
    header = struct.pack("<8I", magic, flags, -(magic + flags) & 0xFFFFFFFF, base, base, 0, 0, base + 32)
    kernel, initrd, disk = tmp_path / "idle.kernel", tmp_path / "empty.initrd", tmp_path / "root.img"
    kernel.write_bytes((header + bytes([0xFA, 0xF4, 0xEB, 0xFD])).ljust(8192, b"\0"))
    initrd.write_bytes(b"")
    disk.write_bytes(bytes(1 << 20))
    return (boot.BootFiles(kernel=kernel, initrd=initrd, version="idle"),
            RootFs(path=disk, image_id="x", entrypoint=[], env={}))


def _seccomp(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Seccomp:"):
            return line.split()[1]
    return ""


def _environ(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/environ").read_text()
    return dict(e.split("=", 1) for e in text.split("\0") if "=" in e)


def _answers(instance: backends.Instance) -> int:
    """The backend's device count, on a connection of our own (HELLO first)."""
    with rpc_client.connect(instance.endpoint, timeout=30) as sock:
        assert rpc_client.hello(sock).startswith(f"{rpc_client.PROTOCOL_MAJOR}.")
        return rpc_client.device_count(sock)


def _closed(sock: socket.socket) -> bool:
    """The peer closed the stream (blocks until it does, or the socket's timeout)."""
    return sock.recv(1) == b""


def _gone(instance: backends.Instance) -> bool:
    """No process, socket directory, record or log of the backend is left."""
    return (not backends.is_backend_process(instance.pid) and backends.get(instance.id) is None
            and not Path(instance.directory).exists() and not Path(instance.log).exists())


def test_a_vms_backend_is_a_containers_sandboxed_and_capped_and_its_relay_serves_sessions_in_turn(
        vm_build: object) -> None:
    """The backend serve starts for a remoting VM is the one it starts for a container (one call, the
    same arguments): it enters its sandbox (seccomp filter on) and its shared memory is capped at the
    VM's memory. Through the relay, one stream carries three clients in turn, each its own session;
    a client's garbage costs it its session, not the backend."""
    instance = rpc_server.start_own_backend("vm-test", 1 * GIB)
    try:
        environ = _environ(instance.pid)
        assert environ.get(backends.SHM_CAP_ENV) == str(GIB) and environ.get("GGML_SANDBOX", "1") != "0"
        assert _seccomp(instance.pid) == "2"  # filter mode: the sandbox of llama_patches 0016
        assert stat.S_IMODE(Path(instance.directory).stat().st_mode) == 0o700

        guest, host = socket.socketpair()
        ended: list[str] = []
        running = threading.Thread(target=lambda: ended.append(Relay(host, instance).run()), daemon=True)
        running.start()
        guest.settimeout(30)
        for _ in range(3):
            assert rpc_client.hello(guest).startswith(f"{rpc_client.PROTOCOL_MAJOR}.")
            assert rpc_client.device_count(guest) >= 1
        guest.sendall(struct.pack("<BQ", 200, 4) + b"junk")  # an unknown command: the backend drops that session
        assert _closed(guest)  # and the relay closes the stream: its client would wait for ever otherwise
        running.join(timeout=30)
        assert not running.is_alive()
        assert ended == ["rpc backend refused the guest's session 3: Unknown command: 200"]
        log = Path(instance.log).read_text()
        assert log.count("Accepted client connection") == 4 and "session 3 began" in log  # a probe, then 3
        assert "session 4" not in log and f"ending the VM: {ended[0]}" in log
        assert backends.is_backend_process(instance.pid) and _answers(instance) >= 1  # refused, and serving
    finally:
        backends.stop(instance)


@needs_qemu
def test_a_remoting_vms_backend_ends_with_its_vm_and_stop_leaves_nothing(
        vm_build: object, idle_guest: tuple[boot.BootFiles, RootFs], podman: str) -> None:
    """Real QEMU (its guest idles): its chardev socket is its owner's alone, the relay keeps the backend
    (`ps` lists the VM as rpc on it, `logs` adds its lines), and ending the VM, by `stop` or by SIGKILL,
    ends the relay and the backend."""
    from apirctl import serve

    files, rootfs = idle_guest
    disk = rootfs.path
    for name, ending in (("vm-stopped", "stop"), ("vm-killed", "kill")):
        instance = rpc_server.start_own_backend(name, GIB)
        record = machines.launch(_record(name, instance.id, free_port()), files, rootfs, disk, ["/bin/true"], {}, 8000,
                                 "127.0.0.1")
        try:
            backends.hand_over(instance, record.relay_pid)
            where = machines.folder(name)
            assert stat.S_IMODE(where.stat().st_mode) == 0o700
            assert stat.S_IMODE((where / machines.RPC_SOCKET).stat().st_mode) == 0o600
            wait_for("the relay to run", lambda r=record: machines.relay_alive(r), timeout=10)
            assert backends.clean([]) == []  # kept by its relay, though no container keeps it
            if ending == "stop":
                listed = serve.find_server(name)
                assert listed.transport == "rpc" and listed.rpc_instance == instance.id and listed.isolation == "vm"
                shown = list(serve.logs(name))
                assert any(line.startswith(f"--- host backend of {name}: ggml-rpc-server") for line in shown)
                assert serve.stop(name) == [name]
            else:
                os.kill(record.pid, signal.SIGKILL)
            wait_for("the backend to end with its VM", lambda i=instance: not backends.is_backend_process(i.pid),
                     timeout=30)
            wait_for("the relay to end", lambda r=record: not machines.relay_alive(r), timeout=30)
            assert backends.get(instance.id) is None and not Path(instance.directory).exists()
            if ending == "kill":  # QEMU ended first: the relay records no reason of its own
                assert serve.find_server(name, all=True).why == "exited" and not machines.ended(name)
        finally:
            machines.remove(name)
            backends.stop(instance.id)
        assert not machines.folder(name).exists()


def _launch(name: str, memory: int, files: boot.BootFiles,
            rootfs: RootFs) -> tuple[backends.Instance, machines.VmRecord]:
    """A remoting VM as serve starts one: its own backend and shared memory, QEMU, and the relay that owns
    the backend."""
    with Region.create() as region:
        instance = rpc_server.start_own_backend(name, memory, region)
        try:
            record = machines.launch(_record(name, instance.id, free_port()), files, rootfs, rootfs.path,
                                     ["/bin/true"], {}, 8000, "127.0.0.1", region=region)
        except BaseException:
            backends.stop(instance)
            raise
    assert backends.get(instance.id).owner_pid == record.relay_pid  # type: ignore[union-attr]  # launch handed it over
    wait_for(f"the relay of {name} to run", lambda: machines.relay_alive(record), timeout=10)
    return instance, record


@contextlib.contextmanager
def _vms(memories: dict[str, int], files: boot.BootFiles,
         rootfs: RootFs) -> Iterator[dict[str, tuple[backends.Instance, machines.VmRecord]]]:
    """Remoting VMs launched as serve launches them (`_launch`), named by `memories`; afterwards each is
    removed, and nothing of it (folder, backend) may be left."""
    started: dict[str, tuple[backends.Instance, machines.VmRecord]] = {}
    try:
        for name, memory in memories.items():
            started[name] = _launch(name, memory, files, rootfs)
        yield started
    finally:
        for name, (instance, _) in started.items():
            machines.remove(name)
            backends.stop(instance.id)
    for name, (instance, _) in started.items():
        assert not machines.folder(name).exists() and _gone(instance)


@needs_qemu
def test_two_remoting_vms_keep_a_backend_each_and_garbage_on_one_stream_ends_that_vm_alone(
        vm_build: object, idle_guest: tuple[boot.BootFiles, RootFs], podman: str) -> None:
    """Two VMs at once: each has its own backend (process, socket, cap: its VM's memory) and relay.
    Garbage on VM A's stream (handed to A's relay as QEMU hands the guest's bytes over): A's backend
    refuses it, the relay ends VM A (its real QEMU) and A's backend, `ps -a` says why, and `stop`
    leaves nothing of A; VM B, its relay and its backend run on, and B's backend answers."""
    from apirctl import serve

    with _vms({"vm-a": GIB, "vm-b": 2 * GIB}, *idle_guest) as started:
        (a, vm_a), (b, vm_b) = started["vm-a"], started["vm-b"]
        assert a.id != b.id and a.pid != b.pid and a.socket != b.socket and vm_a.relay_pid != vm_b.relay_pid
        assert _environ(a.pid)[backends.SHM_CAP_ENV] == str(GIB)
        assert _environ(b.pid)[backends.SHM_CAP_ENV] == str(2 * GIB)
        for instance, record in started.values():
            assert backends.get(instance.id).owner_pid == record.relay_pid  # type: ignore[union-attr]
        listed = {s.name: s for s in serve.list_servers(all=True, probe_health=False)}
        assert (listed["vm-a"].rpc_instance, listed["vm-b"].rpc_instance) == (a.id, b.id)

        guest, host = socket.socketpair()
        guest.settimeout(30)
        ended: list[str] = []
        stream = threading.Thread(target=lambda: ended.append(relay.serve_vm(host, a, "vm-a")), daemon=True)
        stream.start()
        assert rpc_client.hello(guest) and rpc_client.device_count(guest) >= 1  # A's guest is served
        guest.sendall(struct.pack("<BQ", 200, 4) + b"junk")
        assert _closed(guest)
        stream.join(timeout=30)
        assert ended == ["rpc backend refused the guest's session 1: Unknown command: 200"]
        wait_for("VM A's QEMU to end", lambda: not machines.alive(vm_a), timeout=30)
        wait_for("VM A's relay to end", lambda: not machines.relay_alive(vm_a), timeout=30)
        wait_for("VM A's backend to be gone", lambda: _gone(a), timeout=30)
        shown = serve.find_server("vm-a", all=True)
        assert not shown.running and shown.why == f"exited: {ended[0]}"
        assert f"--- apirctl: the VM was ended: {ended[0]}" in list(serve.logs("vm-a"))

        assert machines.alive(vm_b) and machines.relay_alive(vm_b) and backends.is_backend_process(b.pid)
        assert _answers(b) >= 1  # B's backend answers HELLO and the device count
        assert serve.stop("vm-a") == ["vm-a"] and not machines.folder("vm-a").exists()
        assert machines.alive(vm_b) and _answers(b) >= 1


def _qemus_region(record: machines.VmRecord) -> mmap.mmap:
    """The VM's shared memory as its guest sees it: QEMU's own descriptor of the memfd, mapped here."""
    (memory,) = _option(record.command, "-object")
    number = memory.split("mem-path=/proc/self/fd/")[1].split(",")[0]
    fd = os.open(f"/proc/{record.pid}/fd/{number}", os.O_RDWR)
    try:
        return mmap.mmap(fd, REGION_BYTES)
    finally:
        os.close(fd)


@needs_qemu
def test_garbage_in_one_vms_shared_memory_ends_that_vm_alone(
        vm_build: object, idle_guest: tuple[boot.BootFiles, RootFs], podman: str) -> None:
    """A guest that asked for its rings in the VM's shared memory, then writes a position past the ring
    into it (written here into QEMU's own mapping of the region, as the guest's would land): A's backend
    refuses the session, the relay ends VM A and its backend, and VM B, with a region and a backend of its
    own, serves on."""
    with _vms({"vm-a": GIB, "vm-b": GIB}, *idle_guest) as started:
        (a, vm_a), (b, vm_b) = started["vm-a"], started["vm-b"]
        assert _environ(a.pid)[HOST_ENV] and _environ(b.pid)[HOST_ENV]

        guest, host = socket.socketpair()
        guest.settimeout(30)
        ended: list[str] = []
        stream = threading.Thread(target=lambda: ended.append(relay.serve_vm(host, a, "vm-a")), daemon=True)
        stream.start()
        answer = hello(guest, struct.pack("<IIQQ", SHM_CAPS_MAGIC, 1, 0, REGION_FEATURE))
        assert struct.unpack_from("<Q", answer, len(answer) - 8)[0] & REGION_FEATURE  # A's backend made rings
        with _qemus_region(vm_a) as region:
            struct.pack_into("<Q", region, RING0_HEAD, 1 << 40)
        stream.join(timeout=30)
        assert len(ended) == 1 and ended[0].startswith("rpc backend refused the guest's session 1"), ended
        assert "corrupted the ring's write position" in ended[0]
        wait_for("VM A's QEMU to end", lambda: not machines.alive(vm_a), timeout=30)
        wait_for("VM A's backend to be gone", lambda: not backends.is_backend_process(a.pid), timeout=30)

        assert machines.alive(vm_b) and machines.relay_alive(vm_b) and _answers(b) >= 1


@needs_qemu
def test_garbage_on_an_apir_vms_stream_ends_that_vm_and_its_apir_host(
        vm_build: object, idle_guest: tuple[boot.BootFiles, RootFs], podman: str) -> None:
    """A VM on APIR: its apir-host (with the VM's 256 MiB region) is kept while the VM exists, its relay
    pipes the one stream (no session split), and a message the host refuses ends the VM and the host,
    with the host's own line as the reason."""
    files, rootfs = idle_guest
    record = _record("vm-apir", port=free_port()).model_copy(update={"rpc_instance": ""})
    with Region.for_transport("virtgpu") as region:
        host = apir_hosts.start(vm_build, "vm-apir", region=region)  # type: ignore[arg-type]
        try:
            record.apir_host = host.id
            record = machines.launch(record, files, rootfs, rootfs.path, ["/bin/true"], {}, 8000, "127.0.0.1",
                                     region=region)
        except BaseException:
            apir_hosts.stop(host)
            raise
    try:
        assert apir_hosts.get(host.id).container == record.id  # type: ignore[union-attr]  # kept by the VM
        (memory,) = _option(record.command, "-object")
        assert f"size={APIR_REGION_BYTES}," in memory
        assert "a region of 256 MiB shared with the client" in Path(host.log).read_text()
        guest, end = socket.socketpair()
        guest.settimeout(30)
        ended: list[str] = []
        stream = threading.Thread(
            target=lambda: ended.append(relay.serve_vm(end, relay.Backend.of_apir_host(host), "vm-apir")), daemon=True)
        stream.start()
        guest.sendall(struct.pack("<IIIIQ", 0x31535041, 99, 0, 0, 0))  # APS1, an unknown message type
        assert _closed(guest)
        stream.join(timeout=30)
        assert len(ended) == 1 and ended[0].startswith("apir-host refused the guest's session 1"), ended
        assert "unknown message type 99" in ended[0]
        wait_for("the VM's QEMU to end", lambda: not machines.alive(record), timeout=30)
        wait_for("its apir-host to be gone", lambda: apir_hosts.get(host.id) is None, timeout=30)
        assert not supervised.is_process(host.pid, apir_hosts.BINARY)
    finally:
        machines.remove(record.name)
        apir_hosts.stop(host.id)
    assert not machines.folder(record.name).exists() and not Path(host.directory).exists()


@needs_qemu
def test_a_killed_host_backend_ends_its_vm_which_ps_shows_and_stop_leaves_nothing(
        vm_build: object, idle_guest: tuple[boot.BootFiles, RootFs], podman: str) -> None:
    """SIGKILL of a remoting VM's backend (no session open: the guest never connected): the relay
    sees it at once, ends the VM's real QEMU and removes the backend's record, socket and log; `ps -a`
    shows the VM exited with `rpc backend down` (a container on a dead backend says the same), `logs`
    says why, and `stop` removes the VM's folder: no process, record or file is left."""
    from apirctl import serve

    instance, record = _launch("vm-orphan", GIB, *idle_guest)
    try:
        running = {s.name for s in serve.list_servers(probe_health=False)}
        assert machines.alive(record) and "vm-orphan" in running
        os.kill(instance.pid, signal.SIGKILL)
        wait_for("QEMU to end with its backend", lambda: not machines.alive(record), timeout=30)
        wait_for("the relay to end", lambda: not machines.relay_alive(record), timeout=30)
        wait_for("the backend's record, socket and log to be gone", lambda: _gone(instance), timeout=30)
        why = f"rpc backend down: {backends.BINARY} pid {instance.pid} ended"
        shown = serve.find_server("vm-orphan", all=True)
        assert not shown.running and shown.why == f"exited: {why}"
        assert f"--- apirctl: the VM was ended: {why}" in list(serve.logs("vm-orphan"))
        assert machines.folder("vm-orphan").is_dir()  # kept for `logs` until stop
        assert serve.stop("vm-orphan") == ["vm-orphan"]
        assert not machines.folder("vm-orphan").exists()
        assert "vm-orphan" not in {s.name for s in serve.list_servers(all=True, probe_health=False)}
    finally:
        machines.remove("vm-orphan")
        backends.stop(instance.id)
    assert _gone(instance) and not machines.alive(record) and not machines.relay_alive(record)
