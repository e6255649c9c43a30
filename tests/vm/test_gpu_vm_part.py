"""benchmarks/gpu_vm.py, the GPU machine's VM rows (issue 32), run here end to end on the CPU: the kit
packed from the real image, QEMU and boot files, then gpu_remoting.py's `vm` part booting llama-bench in
real VMs through RPC and APIR to host processes of their own (the CPU library in place of CUDA), on
KVM where it boots ordinary guests, else on emulation."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl import vm
from apirctl.build import image, llamacpp
from apirctl.podman import engine
from tests.vm.test_vm_serve import PROBLEM
from tests.vm.test_vm_serve import pytestmark as vm_marks

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = [vm_marks, pytest.mark.integration]


def _pack(tag: str, out: Path) -> subprocess.CompletedProcess[str]:
    boot = vm.ensure_boot_files()
    rootfs = vm.ensure_rootfs(tag)
    return subprocess.run([sys.executable, str(BENCHMARKS / "gpu_vm.py"), "pack", "--image", tag, "--rootfs",
                           str(rootfs.path), "--boot", str(boot.kernel.parent), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def kit_image(podman: str, portable_build: llamacpp.Build) -> Iterator[str]:
    """The portable build's image under a tag of the test's own. The shared tag is relabelled by every
    serve with the identity of the build it runs (the VM tests' serve runs the same files as an external
    build, another identity), and pack would rightly refuse it then (a CI run saw it)."""
    tag = f"localhost/apirctl/gpu-vm-kit-test:{uuid.uuid4().hex[:8]}"
    image.build_image(portable_build, tag)
    yield tag
    subprocess.run([engine.podman_binary(), "rmi", "-f", tag], env=engine.podman_env(), capture_output=True,
                   check=False)


def test_the_vm_part_runs_llama_bench_in_vms_through_both_transports(
        portable_build: llamacpp.Build, kit_image: str, demo_model: Path, tmp_path: Path) -> None:
    packed = _pack(kit_image, tmp_path / "kit")
    assert packed.returncode == 0, packed.stderr
    kit = json.loads((tmp_path / "kit" / "kit.json").read_text())
    assert kit["build_id"] == portable_build.identity and kit["options"]["native"] is False
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_remoting.py"), "--sdist", str(tmp_path / "unused.tar.gz"),
         "--prebuilt", str(portable_build.bin_dir.parent), "--model", str(demo_model), "--shapes", "demo",
         "--work", str(tmp_path / "work"), "--out", str(out), "--parts", "vm", "--vm-kit", str(tmp_path / "kit"),
         "--vm-accel", "tcg" if PROBLEM else "kvm", "--vm-cpus", "2", "--device", "CPU", "--server-threads", "1",
         "--reps", "1", "--passes", "1", "--vm-rows", "--deadline", "800"],
        capture_output=True, text=True, timeout=900, check=False)
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    assert steps.get("demo/vm_rpc_0", "").startswith("ok") and steps.get("demo/vm_apir_0", "").startswith("ok"), \
        f"{steps}\n{done.stdout[-3000:]}"
    bench = results["bench"]["demo"]
    for key in ("vm_rpc_0", "vm_apir_0"):
        assert bench[key]["client"] == "vm" and {r["n_prompt"] or r["n_gen"] for r in bench[key]["rows"]} == {512, 128}
        assert all(r["avg_ts"] > 0 for r in bench[key]["rows"])
    # the path each row names, which the part checks before it keeps a row: APIR's graphs in the
    # host's trace, one compute a generated token at least
    assert bench["vm_apir_0"]["apir"]["graph_computes"] >= 128
    ratios = results["vm"]["demo"]
    assert set(ratios["ratio"]) == {"vm_rpc_0", "vm_apir_0"} and ratios["order"][0] == "native"
    assert ratios["order"][-1] == "native_1"  # a native row on either side of the pass
    env = results["env"]["vm"]
    assert env["guest_image"]["build_id"] == portable_build.identity
    assert env["accel"] == ("tcg" if PROBLEM else "kvm")
    # nothing left: no VM folder, no QEMU of the part
    assert not any((tmp_path / "work" / "vm" / "home" / "run" / "vms").glob("*"))
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work" / "vm" / "qemu")], capture_output=True, check=False)
    assert left.returncode == 1, left.stdout


@pytest.mark.skipif(PROBLEM is None, reason="this host's KVM boots ordinary guests")
def test_a_vm_that_does_not_boot_ends_its_row_and_the_rest_are_skipped(
        portable_build: llamacpp.Build, kit_image: str, demo_model: Path, tmp_path: Path) -> None:
    """Where KVM boots no ordinary guest (PVM here; the GPU machine's, docs/vm.md) the kernel stops after
    its real-mode setup: the part gives the VM its boot time, ends it, and runs no further VM."""
    packed = _pack(kit_image, tmp_path / "kit")
    assert packed.returncode == 0, packed.stderr
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_remoting.py"), "--sdist", str(tmp_path / "unused.tar.gz"),
         "--prebuilt", str(portable_build.bin_dir.parent), "--model", str(demo_model), "--shapes", "demo",
         "--work", str(tmp_path / "work"), "--out", str(out), "--parts", "vm", "--vm-kit", str(tmp_path / "kit"),
         "--vm-accel", "kvm", "--vm-boot-timeout", "15", "--vm-cpus", "2", "--device", "CPU",
         "--server-threads", "1", "--reps", "1", "--passes", "1", "--vm-rows", "--deadline", "400"],
        capture_output=True, text=True, timeout=600, check=False)
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert "did not reach its init within 15 s on kvm" in steps["demo/vm_rpc_0"], steps
    assert "an earlier VM did not boot" in steps["demo/vm_apir_0"], steps
    assert steps["demo/vm-native-1"].startswith("ok")  # native rows go on
    assert not any((tmp_path / "work" / "vm" / "home" / "run" / "vms").glob("*"))
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work" / "vm" / "qemu")], capture_output=True, check=False)
    assert left.returncode == 1, left.stdout


def test_pack_refuses_an_image_of_another_build(podman: str, llama_image: str, llama_build: llamacpp.Build,
                                               tmp_path: Path) -> None:
    if not llama_build.options or not llama_build.options.native:
        pytest.skip("this host's build is the portable one: no other image to refuse")
    packed = _pack(llama_image, tmp_path / "kit")
    assert packed.returncode == 1
    first, hint = packed.stderr.strip().splitlines()
    assert "not this series' portable CPU build" in first and hint.startswith("hint: ")
    assert not (tmp_path / "kit" / "kit.json").exists()
