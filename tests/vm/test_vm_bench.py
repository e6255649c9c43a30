"""`apirctl bench --modes vm-cpu,vm-remoting`: llama-bench in a real QEMU VM booted from the inference image,
on the VM's own CPU and through a backend of its own on the host (the seeds' Lima comparison), beside
native, in one run. Where KVM cannot boot ordinary guests the VM runs on QEMU's emulation, as in
test_vm_serve (whose fixtures pick the build it can run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apirctl import vm
from apirctl.bench import modes
from apirctl.bench.llamabench import LlamaBench, Params
from apirctl.vm import machines
from tests.support.waiting import wait_for
from tests.vm.test_vm_serve import PORTABLE, PROBLEM, cli, vm_build, vm_image  # noqa: F401 (fixtures)
from tests.vm.test_vm_serve import pytestmark as vm_marks

pytestmark = vm_marks


def test_bench_runs_llama_bench_in_a_vm_on_its_cpu_and_through_remoting_and_leaves_nothing(
        podman: str, vm_image: str, demo_model: Path, vm_build: object) -> None:  # noqa: F811
    done = cli("bench", str(demo_model), "--modes", "native,vm-cpu,vm-remoting,vm-apir", "--reps", "1", "--pp",
               "16", "--tg", "4", "--json")
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    rows = {(r["mode"], r["test"]): r for r in run["rows"]}
    for mode in ("native", "vm-cpu", "vm-remoting", "vm-apir"):
        for test in ("pp16", "tg4"):
            row = rows[(mode, test)]
            assert row["skipped_reason"] is None and row["tps_mean"] > 0, row
    for test in ("pp16", "tg4"):
        cpu, remoting = rows[("vm-cpu", test)], rows[("vm-remoting", test)]
        assert cpu["client"] == remoting["client"] == "vm"
        assert "RPC" not in (cpu["backend"] or "")  # the VM's own CPU
        # the rings of its transport in the VM's shared memory (llama_patches/ 0024)
        assert "RPC" in (remoting["backend"] or "") and remoting["transport"] == "rpc-vm-region"
        # APIR: an apir-host of its own, the frontend's resources in the VM's shared memory (0025)
        apir = rows[("vm-apir", test)]
        assert apir["client"] == "vm" and "virtgpu" in (apir["backend"] or "")
        assert apir["transport"] == "virtgpu-vm-region"
    assert run["system"]["extra"]["vm"].split(":")[0] in ("kvm", "tcg")
    left = [r.name for r in machines.records() if r.labels.get("apirctl.role") == "bench"]
    assert left == []


def test_a_remoting_vm_whose_program_ends_is_not_noted_as_ended_by_its_relay(
        podman: str, vm_image: str, demo_model: Path, vm_build: object, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """When the guest's program ends, QEMU closes the relay's stream as it exits: the relay waits for it
    instead of ending it with a reason of its own, which `ps -a` would show as why the VM ended."""
    if PROBLEM:
        monkeypatch.setenv("APIRCTL_VM_ACCEL", "tcg")
    if PORTABLE:
        monkeypatch.setenv("APIRCTL_NATIVE_CPU", "false")
    noted: dict[str, str] = {}
    remove = vm.remove

    def noting_remove(name: str, timeout: float = machines.STOP_TIMEOUT) -> bool:
        relay = machines._read(name)
        if relay is not None:  # the relay ends once QEMU has: what it noted is final then
            wait_for("the VM's relay to end", lambda: not machines.relay_alive(relay), timeout=30)
        noted[name] = vm.ended(name)
        return remove(name, timeout)

    monkeypatch.setattr(vm, "remove", noting_remove)
    ctx = modes.Context(model_path=demo_model, program=LlamaBench(Params(pp=8, tg=2, reps=1, ngl=99)))
    outcome = modes.run_in_vm(ctx, "vm-remoting", remoting="rpc")
    assert outcome.results and outcome.backend and "RPC" in outcome.backend
    assert list(noted.values()) == [""]
