"""`apirctl serve --isolation vm`, end to end: a real QEMU VM booting Debian's kernel with the inference
image as its root, serving the demo model. Its greedy tokens equal a container's; ps, logs and stop
work; a killed VM and a failed start leave nothing behind; two VMs run side by side. With `--transport rpc`
the VMs compute on backends of their own on the host (one each), whose logs show the graphs, and which
end with their VMs.

Where KVM cannot boot ordinary guests (absent, or PVM as in some cloud sandboxes) the VMs run on
QEMU's emulation (TCG): about a minute for the module on an idle 2-core machine. APIRCTL_VM_TCG=0 skips
it there instead. Emulation stops at AVX2: on a host CPU with AVX-512 the VMs boot an image of a build
for any AVX2 CPU (the `portable_image` fixture; serve is told `native_cpu` false), which the containers
they are compared with run too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from apirctl import config
from apirctl.apir import trace as apir_trace
from apirctl.remoting import apir_hosts, backends, supervised
from apirctl.vm import accel, machines
from tests.support.model_sources import ollama_store
from tests.support.ports import free_port
from tests.support.waiting import wait_for

PROBLEM = accel.kvm_problem()
# emulated, on a CPU with an instruction set that emulation lacks: the VMs need a build without it
PORTABLE = PROBLEM is not None and accel.tcg_unemulated() is not None and config.settings().native_cpu
pytestmark = pytest.mark.skipif(PROBLEM is not None and os.environ.get("APIRCTL_VM_TCG") == "0",
                                reason=f"no KVM for ordinary guests: {PROBLEM} (and APIRCTL_VM_TCG=0)")
LIMIT = 900.0 if PROBLEM else 180.0


def cli(*args: str, timeout: float = LIMIT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, APIRCTL_VM_ACCEL="tcg") if PROBLEM else dict(os.environ)
    if PORTABLE:
        env["APIRCTL_NATIVE_CPU"] = "false"
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def serve_vm(model: Path | str, name: str, *extra: str) -> dict[str, object]:
    done = cli("serve", str(model), "--isolation", "vm", "--name", name, "--port", str(free_port()),
               "--ctx-size", "512", "--json", "--timeout", str(LIMIT), *extra)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def greedy_tokens(url: str) -> list[int]:
    base = url.removesuffix("/v1")
    answer = httpx.post(f"{base}/completion", json={"prompt": "The capital of France is", "n_predict": 8,
                                                    "temperature": 0, "return_tokens": True}, timeout=LIMIT)
    answer.raise_for_status()
    return list(answer.json()["tokens"])


def ps(*flags: str) -> list[dict[str, object]]:
    done = cli("ps", "--json", *flags)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_a_vm_serves_like_a_container_is_listed_logged_stopped_and_leaves_nothing(
        podman: str, vm_image: str, demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = uuid.uuid4().hex[:6]
    first, second, box = f"vm-a-{tag}", f"vm-b-{tag}", f"ct-{tag}"
    # the second VM's model by name from a store, whose file is a blob named by its digest: the guest
    # must see it under the name llama-server is given (`sha256-....gguf`), not the blob's
    ollama_store(tmp_path / "ollama", "registry.ollama.ai", "library", "tiny-text", "1b", {"model": demo_model})
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    try:
        a = serve_vm(demo_model, first, "--transport", "none", "--memory", "1g", "--cpus", "1")
        b = serve_vm("tiny-text:1b", second, "--transport", "none")
        assert a["isolation"] == b["isolation"] == "vm" and a["health"] == "ok"
        record = machines._read(first)
        assert record is not None and record.memory_mb == 1024 and record.cpus == 1
        assert f"127.0.0.1:{a['port']}-:" in " ".join(record.command)  # published on loopback only

        container = cli("serve", str(demo_model), "--transport", "none", "--name", box, "--port",
                        str(free_port()), "--ctx-size", "512", "--json")
        assert container.returncode == 0, container.stderr
        expected = greedy_tokens(json.loads(container.stdout)["url"])
        assert greedy_tokens(str(a["url"])) == expected
        assert greedy_tokens(str(b["url"])) == expected

        listed = {s["name"]: s for s in ps()}
        assert listed[first]["isolation"] == "vm" and listed[first]["health"] == "ok"
        assert listed[second]["state"] == "running"
        logs = cli("logs", first)
        assert "apirctl-init: starting /app/bin/llama-server" in logs.stdout and "load_model" in logs.stdout

        assert cli("stop", first).returncode == 0
        assert not machines.folder(first).exists()
        assert greedy_tokens(str(b["url"])) == expected  # the other VM keeps serving

        killed = machines._read(second)
        assert killed is not None
        os.kill(killed.pid, signal.SIGKILL)
        wait_for("the killed VM's QEMU to end", lambda: not machines.alive(killed), timeout=30)
        gone = {s["name"]: s for s in ps("-a")}[second]
        assert gone["state"] == "exited"
        assert cli("stop", second).returncode == 0
        assert not machines.folder(second).exists() and not any(machines.root().iterdir())
    finally:
        cli("stop", first)
        cli("stop", second)
        cli("stop", box)


def test_a_vm_whose_server_fails_is_one_error_with_its_console_and_leaves_nothing(
        podman: str, vm_image: str, demo_model: Path) -> None:
    name = f"vm-bad-{uuid.uuid4().hex[:6]}"
    done = cli("serve", str(demo_model), "--isolation", "vm", "--transport", "none", "--name", name, "--port",
               str(free_port()), "--timeout", str(LIMIT), "--", "--no-such-flag")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "the VM ended before its server was ready" in done.stderr
    assert "no-such-flag" in done.stderr  # the console's last lines: llama-server's own refusal
    assert not machines.folder(name).exists()


@pytest.fixture
def vm_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The host build the VM's backend runs from (a container's comes from the same place): the suite's,
    or where the VMs need it, the build for any AVX2 CPU."""
    build = request.getfixturevalue("portable_build" if PORTABLE else "llama_build")
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(build.root))
    return build


@pytest.fixture
def vm_image(request: pytest.FixtureRequest) -> str:
    """The image the VMs boot, and the containers they are compared with run."""
    return str(request.getfixturevalue("portable_image" if PORTABLE else "llama_image"))


def _left_behind(record: machines.VmRecord, instance: backends.Instance) -> list[str]:
    """What of a remoting VM still exists on the host: processes, records, sockets, folders."""
    found = []
    if machines.alive(record):
        found.append("QEMU")
    if machines.relay_alive(record):
        found.append("the relay")
    if backends.is_backend_process(instance.pid):
        found.append("the backend")
    if backends.get(instance.id) is not None:
        found.append("the backend's record")
    for path in (machines.folder(record.name), Path(instance.directory)):
        if path.exists():
            found.append(str(path))
    return found


def test_a_vm_with_remoting_computes_on_its_own_host_backend_and_leaves_nothing(
        podman: str, vm_image: str, demo_model: Path, vm_build: object) -> None:
    """`--transport rpc` in a VM: the guest's llama.cpp reaches a backend of its own on the host through
    the one forwarded address and the VM's shared memory; its greedy tokens equal a container's on its own
    CPU; stop ends it; a killed VM takes its backend with it."""
    tag = uuid.uuid4().hex[:6]
    first, second, box = f"vm-rpc-a-{tag}", f"vm-rpc-b-{tag}", f"ct-{tag}"
    try:
        a = serve_vm(demo_model, first, "--transport", "rpc", "--memory", "1g")
        b = serve_vm(demo_model, second, "--transport", "rpc")
        assert b["health"] == "ok"
        assert a["transport"] == "rpc" and a["isolation"] == "vm" and a["health"] == "ok"
        rec_a, rec_b = machines._read(first), machines._read(second)
        assert rec_a is not None and rec_b is not None
        inst_a, inst_b = backends.get(rec_a.rpc_instance), backends.get(rec_b.rpc_instance)
        assert inst_a is not None and inst_b is not None and inst_a.pid != inst_b.pid  # a backend each
        assert inst_a.owner_pid == rec_a.relay_pid and machines.relay_alive(rec_a)
        assert f"--rpc {machines.GUEST_RPC_ENDPOINT}" in " ".join(rec_a.command)

        container = cli("serve", str(demo_model), "--transport", "none", "--name", box, "--port",
                        str(free_port()), "--ctx-size", "512", "--json")
        assert container.returncode == 0, container.stderr
        expected = greedy_tokens(json.loads(container.stdout)["url"])
        assert greedy_tokens(str(a["url"])) == expected
        log = Path(inst_a.log).read_text()
        # the guest's requests move through the rings in the VM's shared memory (its ivshmem device): the
        # relay carries each session's HELLO alone
        assert "Accepted client connection" in log and "shared-memory transport in a region" in log, log[-2000:]

        answered = cli("chat", "--name", first, "--max-tokens", "8", "--temp", "0", "Say hello.")
        assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr  # a chat answers
        listed = {s["name"]: s for s in ps()}
        assert listed[first]["transport"] == "rpc" and listed[first]["health"] == "ok"
        assert a["rpc_link"] == listed[first]["rpc_link"] == "shm"
        assert "load_model" in cli("logs", first).stdout

        assert cli("stop", first).returncode == 0
        wait_for("the stopped VM's host processes to end", lambda: not _left_behind(rec_a, inst_a), timeout=30)

        os.kill(rec_b.pid, signal.SIGKILL)  # the per-VM backend ends with its VM
        wait_for("the killed VM's backend and relay to end",
                 lambda: not (machines.relay_alive(rec_b) or backends.is_backend_process(inst_b.pid)), timeout=30)
        gone = {s["name"]: s for s in ps("-a")}[second]
        assert gone["state"] == "exited"
        assert cli("stop", second).returncode == 0
        assert not _left_behind(rec_b, inst_b)
    finally:
        cli("stop", first)
        cli("stop", second)
        cli("stop", box)


def test_a_vm_on_apir_computes_on_its_own_apir_host_through_its_shared_memory_and_leaves_nothing(
        podman: str, vm_image: str, demo_model: Path, vm_build: object) -> None:
    """`--transport virtgpu` in a VM: the guest's APIR frontend reaches an apir-host of its own through
    the one forwarded address, its resources ranges of the VM's shared memory (llama_patches/ 0025); its
    greedy tokens equal a container's on its own CPU; ps lists it as virtgpu; stop leaves no QEMU, relay,
    apir-host, record or folder."""
    tag = uuid.uuid4().hex[:6]
    name, box = f"vm-apir-{tag}", f"ct-apir-{tag}"
    try:
        served = serve_vm(demo_model, name, "--transport", "virtgpu", "--apir-trace")
        assert served["transport"] == "virtgpu" and served["isolation"] == "vm" and served["health"] == "ok"
        record = machines._read(name)
        assert record is not None and record.apir_host and not record.rpc_instance
        host = apir_hosts.get(record.apir_host)
        assert host is not None and host.container == record.id and machines.relay_alive(record)
        container = cli("serve", str(demo_model), "--transport", "none", "--name", box, "--port",
                        str(free_port()), "--ctx-size", "512", "--json")
        assert container.returncode == 0, container.stderr
        assert greedy_tokens(str(served["url"])) == greedy_tokens(json.loads(container.stdout)["url"])
        log = Path(host.log).read_text(errors="replace")
        assert "a region of 256 MiB shared with the client" in log, log[-2000:]
        # the graphs were computed by the apir-host: its trace of the guest's commands
        assert host.trace is not None
        names = [r.name for r in apir_trace.read(Path(host.trace).read_bytes())]
        assert sum(n in ("ext_graph_run", "ext_graph_delta", "backend_graph_compute") for n in names) >= 8, names[-20:]
        answered = cli("chat", "--name", name, "--max-tokens", "8", "--temp", "0", "Say hello.")
        assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr  # a chat answers
        listed = {s["name"]: s for s in ps()}
        assert listed[name]["transport"] == "virtgpu" and listed[name]["health"] == "ok"
        assert cli("stop", name).returncode == 0
        wait_for("the VM's host processes to end",
                 lambda: not (machines.alive(record) or machines.relay_alive(record)
                              or apir_hosts.get(record.apir_host) is not None
                              or supervised.is_process(host.pid, apir_hosts.BINARY)), timeout=30)
        assert not machines.folder(name).exists() and not Path(host.directory).exists()
    finally:
        cli("stop", name)
        cli("stop", box)
