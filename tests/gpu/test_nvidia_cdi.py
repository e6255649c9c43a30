"""`apirctl gpu cdi`: a CDI spec for the NVIDIA driver, for hosts without the NVIDIA container toolkit.

This machine has no NVIDIA GPU. The spec is made from the same facts a driver gives (device nodes,
the loader's cache, nvidia-smi's path) pointed at harmless files, then Podman consumes it for real
and hands the container what it names. On a host with the driver the facts are the real ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from apirctl.gpu import cdi, nvidia

LDCONFIG = """1234 libs found in cache `/etc/ld.so.cache'
	libnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
	libnvidia-ml.so.1 (libc6) => /usr/lib/i386-linux-gnu/libnvidia-ml.so.1
	libcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1
	libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
	libcuda.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so
	libnvidia-ptxjitcompiler.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1
	libm.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libm.so.6
"""


def fake_dev(root: Path, *names: str) -> Path:
    dev = root / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).symlink_to("/dev/null")
    return dev


def test_the_loaders_cache_gives_the_64_bit_driver_libraries() -> None:
    assert nvidia.libraries_from_ldconfig(LDCONFIG) == {
        "libnvidia-ml.so.1": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "libcuda.so.1": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "libnvidia-ptxjitcompiler.so.1": "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1",
    }


def test_the_spec_names_each_gpu_and_all_with_the_control_nodes_and_libraries(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, "nvidia1", "nvidia0", "nvidia10", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null")
    driver = nvidia.find_driver(dev, LDCONFIG, smi="/usr/bin/nvidia-smi", machine="x86-64")
    assert list(driver.gpus) == ["0", "1", "10"]
    assert driver.control_nodes == [str(dev / "nvidiactl"), str(dev / "nvidia-uvm")]
    assert driver.missing_libraries == ["libnvidia-nvvm.so.4"]
    assert nvidia.problem(driver) is None
    text = nvidia.render(nvidia.spec(driver))
    devices = {d.qualified: d for d in cdi.parse_spec(text, "/etc/cdi/" + nvidia.SPEC_NAME)}  # as `doctor` reads it
    assert list(devices) == ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=10", "nvidia.com/gpu=all"]
    assert devices["nvidia.com/gpu=1"].device_nodes == [str(dev / "nvidia1"), *driver.control_nodes]
    assert devices["nvidia.com/gpu=all"].device_nodes[:3] == [str(dev / f"nvidia{i}") for i in (0, 1, 10)]
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in devices["nvidia.com/gpu=0"].mounts
    assert "/usr/bin/nvidia-smi" in devices["nvidia.com/gpu=0"].mounts
    mounts = yaml.safe_load(text)["containerEdits"]["mounts"]
    assert all(m["options"] == ["ro", "nosuid", "nodev", "bind"] for m in mounts)
    assert nvidia.generated_by_apirctl("/etc/cdi/" + nvidia.SPEC_NAME)
    assert not nvidia.generated_by_apirctl("/etc/cdi/nvidia.yaml")


@pytest.mark.parametrize(
    ("nodes", "ldconfig", "words"),
    [
        ((), LDCONFIG, "no NVIDIA GPU device node"),
        (("nvidia0",), LDCONFIG, "no /dev/nvidiactl"),
        (("nvidia0", "nvidiactl"), "", "libcuda.so.1 is not in the loader's cache"),
    ],
)
def test_what_is_missing_is_said(tmp_path: Path, nodes: tuple[str, ...], ldconfig: str, words: str) -> None:
    driver = nvidia.find_driver(fake_dev(tmp_path, *nodes), ldconfig, smi="", machine="x86-64")
    assert words in (nvidia.problem(driver) or "")


def test_write_replaces_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "cdi" / nvidia.SPEC_NAME
    nvidia.write("first\n", target)
    nvidia.write("second\n", target)
    assert target.read_text() == "second\n" and oct(target.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in target.parent.iterdir()] == [nvidia.SPEC_NAME]  # no temporary file left


def test_on_a_host_without_the_driver_it_is_one_clear_error() -> None:
    done = subprocess.run([sys.executable, "-m", "apirctl", "gpu", "cdi"], capture_output=True, text=True, timeout=60)
    if nvidia.problem(nvidia.find_driver()) is None:
        pytest.skip("this host has an NVIDIA driver")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("apirctl: error: no CDI spec written: no NVIDIA GPU device node")
    assert lines[1].startswith("hint:")


CDI_DIR = Path("/etc/cdi")


@pytest.fixture
def spec_on_disk(tmp_path: Path) -> Iterator[dict[str, object]]:
    """The spec of a driver made of harmless files (its GPU nodes /dev/null, its libraries small files),
    under a test kind, in /etc/cdi where Podman reads it."""
    with contextlib.suppress(OSError):
        CDI_DIR.mkdir(exist_ok=True)
    if not os.access(CDI_DIR, os.W_OK):
        pytest.skip(f"{CDI_DIR} is not writable by this user (Podman reads CDI specs only there and in /var/run/cdi)")
    tmp_path.chmod(0o755)
    dev = fake_dev(tmp_path, "nvidia0", "nvidiactl", "nvidia-uvm")
    libs = tmp_path / "lib"
    libs.mkdir(mode=0o755)
    for name in nvidia.LIBRARIES:
        (libs / name).write_text(f"the driver's {name}\n")
        (libs / name).chmod(0o644)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    cache = "".join(f"\t{name} (libc6,x86-64) => {libs / name}\n" for name in nvidia.LIBRARIES)
    driver = nvidia.find_driver(dev, cache, smi=str(smi), machine="x86-64")
    kind = f"test{uuid.uuid4().hex[:8]}.apirctl.dev/gpu"
    path = CDI_DIR / f"apirctl-test-{kind.split('.')[0]}.yaml"
    nvidia.write(nvidia.render(nvidia.spec(driver, kind=kind)), path)
    try:
        yield {"kind": kind, "driver": driver, "libs": libs}
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.integration
def test_podman_hands_over_what_the_spec_names(podman: str, llama_image: str, demo_model: Path, name: str,
                                               port: int, spec_on_disk: dict[str, object]) -> None:
    from tests.serve.conftest import apirctl

    driver = spec_on_disk["driver"]
    assert isinstance(driver, nvidia.NvidiaDriver)
    done = apirctl("serve", str(demo_model), "--gpu-device", f"{spec_on_disk['kind']}=all", "--image", llama_image,
                   "--port", str(port), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    try:
        from apirctl.podman import engine

        root = Path(f"/proc/{engine.client().containers.get(name).attrs['State']['Pid']}/root")
        for node in [*driver.gpus.values(), *driver.control_nodes]:
            found = os.stat(root / node.lstrip("/"))
            assert stat.S_ISCHR(found.st_mode) and (os.major(found.st_rdev), os.minor(found.st_rdev)) == (1, 3)
        for soname, path in driver.libraries.items():
            assert (root / path.lstrip("/")).read_text() == f"the driver's {soname}\n"
        assert driver.smi and (root / driver.smi.lstrip("/")).exists()
        listed = json.loads(apirctl("ps", "--json").stdout)
        assert any(s["name"] == name and s["transport"] == "gpu" for s in listed)
    finally:
        assert apirctl("stop", name).returncode == 0
