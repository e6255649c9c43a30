"""`apirctl bench --modes vm-cpu,vm-remoting`: llama-bench in a real QEMU VM booted from the inference image,
on the VM's own CPU and through a backend of its own on the host (the seeds' Lima comparison), beside
native, in one run. Where KVM cannot boot ordinary guests the VM runs on QEMU's emulation, as in
test_vm_serve (whose fixtures pick the build it can run)."""

from __future__ import annotations

import json
from pathlib import Path

from apirctl.vm import machines
from tests.vm.test_vm_serve import cli, vm_build, vm_image  # noqa: F401 (fixtures)
from tests.vm.test_vm_serve import pytestmark as vm_marks

pytestmark = vm_marks


def test_bench_runs_llama_bench_in_a_vm_on_its_cpu_and_through_remoting_and_leaves_nothing(
        podman: str, vm_image: str, demo_model: Path, vm_build: object) -> None:  # noqa: F811
    done = cli("bench", str(demo_model), "--modes", "native,vm-cpu,vm-remoting", "--reps", "1", "--pp", "16",
               "--tg", "4", "--json")
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    rows = {(r["mode"], r["test"]): r for r in run["rows"]}
    for mode in ("native", "vm-cpu", "vm-remoting"):
        for test in ("pp16", "tg4"):
            row = rows[(mode, test)]
            assert row["skipped_reason"] is None and row["tps_mean"] > 0, row
    for test in ("pp16", "tg4"):
        cpu, remoting = rows[("vm-cpu", test)], rows[("vm-remoting", test)]
        assert cpu["client"] == remoting["client"] == "vm"
        assert "RPC" not in (cpu["backend"] or "")  # the VM's own CPU
        assert "RPC" in (remoting["backend"] or "") and remoting["transport"] == "rpc-vm-relay"
    assert run["system"]["extra"]["vm"].split(":")[0] in ("kvm", "tcg")
    left = [r.name for r in machines.records() if r.labels.get("apirctl.role") == "bench"]
    assert left == []
