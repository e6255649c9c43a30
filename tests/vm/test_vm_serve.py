"""`apirctl serve --isolation vm`, end to end: a real QEMU VM booting Debian's kernel with the inference
image as its root, serving the demo model. Its greedy tokens equal a container's; ps, logs and stop
work; a killed VM and a failed start leave nothing behind; two VMs run side by side.

It needs a KVM that boots ordinary guests. A host whose /dev/kvm is PVM (some cloud sandboxes) or
absent is skipped with that reason; APIRCTL_VM_TCG=1 runs it there on QEMU's emulation instead
(minutes per boot)."""

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

from apirctl.vm import accel, machines
from tests.support.waiting import wait_for

PROBLEM = accel.kvm_problem()
TCG = os.environ.get("APIRCTL_VM_TCG") == "1"
pytestmark = pytest.mark.skipif(PROBLEM is not None and not TCG,
                                reason=f"no KVM for ordinary guests: {PROBLEM} (APIRCTL_VM_TCG=1 runs it emulated)")
LIMIT = 900.0 if PROBLEM else 180.0


def cli(*args: str, timeout: float = LIMIT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, APIRCTL_VM_ACCEL="tcg") if PROBLEM else dict(os.environ)
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def serve_vm(model: Path, name: str, *extra: str) -> dict[str, object]:
    done = cli("serve", str(model), "--isolation", "vm", "--name", name, "--port", str(_free_port()),
               "--ctx-size", "512", "--json", "--timeout", str(LIMIT), *extra)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
        podman: str, llama_image: str, demo_model: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    first, second, box = f"vm-a-{tag}", f"vm-b-{tag}", f"ct-{tag}"
    try:
        a = serve_vm(demo_model, first, "--memory", "1g", "--cpus", "1")
        b = serve_vm(demo_model, second)
        assert a["isolation"] == b["isolation"] == "vm" and a["health"] == "ok"
        record = machines._read(first)
        assert record is not None and record.memory_mb == 1024 and record.cpus == 1
        assert f"127.0.0.1:{a['port']}-:" in " ".join(record.command)  # published on loopback only

        container = cli("serve", str(demo_model), "--transport", "none", "--name", box, "--port",
                        str(_free_port()), "--ctx-size", "512", "--json")
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
        podman: str, llama_image: str, demo_model: Path) -> None:
    name = f"vm-bad-{uuid.uuid4().hex[:6]}"
    done = cli("serve", str(demo_model), "--isolation", "vm", "--name", name, "--port", str(_free_port()),
               "--timeout", str(LIMIT), "--", "--no-such-flag")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "the VM ended before its server was ready" in done.stderr
    assert "no-such-flag" in done.stderr  # the console's last lines: llama-server's own refusal
    assert not machines.folder(name).exists()
