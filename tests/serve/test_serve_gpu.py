"""`serve --transport gpu` for real: Podman hands the container a CDI device from a spec the test writes.

The spec is harmless: its device node is /dev/null under another name, plus an environment variable
and a read-only bind mount of a file, which is everything a vendor's spec (the NVIDIA container
toolkit's) does for a GPU. Podman reads specs only from /etc/cdi and /var/run/cdi, so the test needs
to write there (root, as in CI); elsewhere it says so and skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.gpu import nvidia
from tests.serve.conftest import apirctl

pytestmark = pytest.mark.integration

CDI_DIR = Path("/etc/cdi")
KIND = "test.apirctl.dev/device"


@pytest.fixture
def cdi_device(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A CDI spec in /etc/cdi for one device: /dev/null as /dev/apirctl-test-<id>, an env var, a mount."""
    with contextlib.suppress(OSError):
        CDI_DIR.mkdir(exist_ok=True)
    if not os.access(CDI_DIR, os.W_OK):
        pytest.skip(f"{CDI_DIR} is not writable by this user (Podman reads CDI specs only there and in /var/run/cdi)")
    ident = uuid.uuid4().hex[:10]
    marker = tmp_path / "marker.txt"
    marker.write_text(f"mounted by CDI {ident}\n")
    marker.chmod(0o644)
    tmp_path.chmod(0o755)
    node = f"/dev/apirctl-test-{ident}"
    spec = {
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": [{"name": ident, "containerEdits": {
            "deviceNodes": [{"path": node, "hostPath": "/dev/null"}],
            "env": [f"APIRCTL_CDI_TEST={ident}"],
            "mounts": [{"hostPath": str(marker), "containerPath": "/apirctl-cdi/marker.txt",
                        "options": ["ro", "nosuid", "nodev", "bind"]}],
        }}],
    }
    path = CDI_DIR / f"apirctl-test-{ident}.json"
    path.write_text(json.dumps(spec))
    try:
        yield {"name": f"{KIND}={ident}", "ident": ident, "node": node, "marker": marker.read_text()}
    finally:
        path.unlink(missing_ok=True)


def _container_pid(name: str) -> int:
    from apirctl.podman import engine

    return int(engine.client().containers.get(name).attrs["State"]["Pid"])


def test_the_container_gets_the_cdi_device_its_env_and_mounts(podman: str, llama_image: str, demo_model: Path,
                                                              name: str, port: int,
                                                              cdi_device: dict[str, str]) -> None:
    done = apirctl("serve", str(demo_model), "--gpu-device", cdi_device["name"], "--image", llama_image,
                   "--port", str(port), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["transport"] == "gpu"
    try:
        root = Path(f"/proc/{_container_pid(name)}")
        environ = (root / "environ").read_bytes().split(b"\0")
        assert f"APIRCTL_CDI_TEST={cdi_device['ident']}".encode() in environ
        node = os.stat(root / "root" / cdi_device["node"].lstrip("/"))
        assert stat.S_ISCHR(node.st_mode) and (os.major(node.st_rdev), os.minor(node.st_rdev)) == (1, 3)
        assert (root / "root" / "apirctl-cdi" / "marker.txt").read_text() == cdi_device["marker"]
        info = json.loads(apirctl("info", "--json").stdout)["gpu_passthrough"]
        assert cdi_device["name"] in [f"{d['kind']}={d['name']}" for d in info["cdi_devices"]]
        doctor = json.loads(apirctl("doctor", "--json").stdout)
        check = next(c for c in doctor["checks"] if c["name"] == "GPU passthrough")
        assert cdi_device["name"] in check["detail"]
        listed = apirctl("ps", "--json")
        assert any(s["name"] == name and s["transport"] == "gpu" for s in json.loads(listed.stdout))
    finally:
        assert apirctl("stop", name).returncode == 0


def test_a_router_hands_its_cdi_device_to_every_model(podman: str, llama_image: str, demo_model: Path, name: str,
                                                     port: int, cdi_device: dict[str, str], tmp_path: Path) -> None:
    """Several models over passthrough: the router's container gets the device, and each model's
    llama-server (a child of the router, in the same container) runs with it and answers."""
    import httpx

    from tests.serve.test_serve_router import named_copy

    models = [named_copy(demo_model, tmp_path / f"{model}.gguf") for model in ("first-model", "second-model")]
    done = apirctl("serve", *map(str, models), "--gpu-device", cdi_device["name"], "--image", llama_image,
                   "--port", str(port), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)
    assert server["transport"] == "gpu" and server["router"] is True
    try:
        for model in ("first-model", "second-model"):
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                               json={"model": model, "messages": [{"role": "user", "content": "Say hi."}],
                                     "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            # the model's own llama-server: a child of the router, with the device in its view
            router = _container_pid(name)  # its children are listed under the thread that started each
            children = [c for task in Path(f"/proc/{router}/task").iterdir()
                        for c in (task / "children").read_text().split()]
            assert children, "the router started no model"
            seen = 0
            for child in children:
                try:  # a model the router is unloading may end between the listing and the look
                    node = os.stat(Path(f"/proc/{child}/root") / cdi_device["node"].lstrip("/"))
                    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                except FileNotFoundError:
                    state = Path(f"/proc/{child}/stat")
                    assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] in "ZX", \
                        f"model process {child} runs without the device in its view"
                    continue
                assert stat.S_ISCHR(node.st_mode)
                assert f"APIRCTL_CDI_TEST={cdi_device['ident']}".encode() in environ
                seen += 1
            assert seen, "no model process of the router was there to look at"
    finally:
        assert apirctl("stop", name).returncode == 0


def test_a_device_without_a_spec_is_one_clear_error(podman: str, llama_image: str, demo_model: Path, name: str,
                                                    port: int, cdi_device: dict[str, str]) -> None:
    missing = f"{KIND}=absent-{uuid.uuid4().hex[:6]}"
    done = apirctl("serve", str(demo_model), "--gpu-device", missing, "--image", llama_image,
                   "--port", str(port), "--name", name)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 2, done.stderr
    assert f"cannot give the container the GPU: no CDI device {missing}" in lines[0]
    assert KIND in lines[0]  # the specs it did find
    assert "CDI spec" in lines[1]
    from apirctl import gpu

    if not any(d.vendor == "nvidia" for d in gpu.inventory().devices):  # the fix names the NVIDIA toolkit
        nvidia = apirctl("serve", str(demo_model), "--gpu-device", "nvidia.com/gpu=all", "--port", str(port),
                         "--name", name)
        assert nvidia.returncode != 0 and "nvidia-ctk cdi generate" in nvidia.stderr, nvidia.stderr


def test_podmans_own_refusal_of_a_cdi_device_says_how_to_fix_it(podman: str, llama_image: str, name: str) -> None:
    """The engine is asked directly (apirctl's own check bypassed): Podman's error gets the fix."""
    from apirctl.errors import ApirctlError
    from apirctl.podman import containers

    spec = containers.ContainerSpec(image=llama_image, name=name, devices=[f"{KIND}=never-{uuid.uuid4().hex[:6]}"])
    api = containers.connect()
    with pytest.raises(ApirctlError) as err:  # at create or at start, depending on the Podman version
        api.start(api.create(spec), name)
    assert "cannot give the container the device" in err.value.message and "CDI" in err.value.message
    assert err.value.hint and "nvidia-ctk cdi generate" in err.value.hint


@pytest.fixture
def nvidia_spec_on_disk(tmp_path: Path) -> Iterator[dict[str, object]]:
    """`apirctl gpu cdi`'s spec of a driver made of harmless files (its GPU nodes /dev/null, its libraries small files),
    under a test kind, in /etc/cdi where Podman reads it."""
    with contextlib.suppress(OSError):
        CDI_DIR.mkdir(exist_ok=True)
    if not os.access(CDI_DIR, os.W_OK):
        pytest.skip(f"{CDI_DIR} is not writable by this user (Podman reads CDI specs only there and in /var/run/cdi)")
    tmp_path.chmod(0o755)
    dev = tmp_path / "dev"
    dev.mkdir()
    for node in ("nvidia0", "nvidiactl", "nvidia-uvm"):  # /dev/null's device under the driver's names
        try:
            os.mknod(dev / node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root")
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


def test_podman_hands_over_what_apirctls_nvidia_spec_names(podman: str, llama_image: str, demo_model: Path, name: str,
                                               port: int, nvidia_spec_on_disk: dict[str, object]) -> None:
    driver = nvidia_spec_on_disk["driver"]
    assert isinstance(driver, nvidia.NvidiaDriver)
    device = f"{nvidia_spec_on_disk['kind']}=all"
    done = apirctl("serve", str(demo_model), "--gpu-device", device, "--image", llama_image, "--port", str(port),
                   "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    try:
        from apirctl.podman import engine

        root = Path(f"/proc/{engine.client().containers.get(name).attrs['State']['Pid']}/root")
        for node in [*driver.gpus.values(), *driver.control_nodes]:
            found = os.stat(root / node.lstrip("/"))
            assert stat.S_ISCHR(found.st_mode) and (os.major(found.st_rdev), os.minor(found.st_rdev)) == (1, 3)
        for soname, path in driver.libraries.items():
            inside = nvidia.library_in_container(soname, path)
            assert (root / inside.lstrip("/")).read_text() == f"the driver's {soname}\n"
        assert driver.smi and (root / driver.smi.lstrip("/")).exists()
        listed = json.loads(apirctl("ps", "--json").stdout)
        assert any(s["name"] == name and s["transport"] == "gpu" for s in listed)
    finally:
        assert apirctl("stop", name).returncode == 0
