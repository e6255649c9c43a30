"""`apirctl gpu cdi`: a CDI spec for the NVIDIA driver, for hosts without the NVIDIA container toolkit.

This machine has no NVIDIA GPU. The spec is made from the same facts a driver gives (device nodes,
the loader's cache, nvidia-smi's path) pointed at harmless files; tests/serve/test_serve_gpu.py has
Podman consume such a spec for real. On a host with the driver the facts are the real ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from apirctl import host
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


def test_a_driver_outside_the_loaders_folders_is_mounted_where_the_loader_looks(tmp_path: Path) -> None:
    """The GPU machine's driver is under /usr/local/nvidia/lib64, found there through the host's loader
    cache; an image has no such cache (its `nvidia-smi -L` could not load libnvidia-ml.so)."""
    ldconfig = LDCONFIG.replace("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1")
    driver = nvidia.find_driver(fake_dev(tmp_path, "nvidia0", "nvidiactl"), ldconfig, smi="/usr/local/nvidia/bin/"
                                "nvidia-smi", machine="x86-64")
    mounts = {m["hostPath"]: m["containerPath"] for m in yaml.safe_load(nvidia.render(nvidia.spec(driver)))[
        "containerEdits"]["mounts"]}
    first = host.loader_search_dirs()[0]
    assert mounts["/usr/local/nvidia/lib64/libcuda.so.1"] == f"{first}/libcuda.so.1"
    # where the loader looks already, a library stays where the host has it; nvidia-smi is run by its path
    assert mounts["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"] == "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    assert mounts["/usr/local/nvidia/bin/nvidia-smi"] == "/usr/local/nvidia/bin/nvidia-smi"


@pytest.mark.skipif(sys.platform != "linux", reason="a glibc loader")
def test_the_loaders_own_folders_hold_the_c_library() -> None:
    searched = host.loader_search_dirs()
    assert searched and all(d.startswith("/") for d in searched)
    out = subprocess.run(["ldd", "/bin/sh"], capture_output=True, text=True).stdout
    libc = next(line.split("=>")[1].split()[0] for line in out.splitlines() if "libc.so" in line)
    assert str(Path(libc).parent) in searched


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
