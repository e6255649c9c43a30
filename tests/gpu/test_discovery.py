"""GPU discovery: CDI specs (YAML and JSON, broken ones reported), render nodes, nvidia-ctk."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from apirctl.gpu import cdi, devices

NVIDIA_YAML = """\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidiactl
  mounts:
  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.1
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.1
    options: [ro, nosuid, nodev, bind]
"""


def _json_spec(kind: str, name: str) -> str:
    return json.dumps({"cdiVersion": "0.6.0", "kind": kind,
                       "devices": [{"name": name, "containerEdits": {"deviceNodes": [{"path": "/dev/null"}],
                                                                     "env": ["A=1"]}}]})


def test_yaml_and_json_specs_give_devices_with_their_edits(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    (etc / "nvidia.yaml").write_text(NVIDIA_YAML)
    (run / "amd.json").write_text(_json_spec("amd.com/gpu", "gpu0"))
    (run / "notes.txt").write_text("not a spec")
    found = cdi.inventory([etc, run], use_nvidia_ctk=False)
    assert [d.qualified for d in found.devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=all", "amd.com/gpu=gpu0"]
    every = found.find("nvidia.com/gpu=all")
    assert every is not None and every.vendor == "nvidia"
    assert every.device_nodes == ["/dev/nvidia0", "/dev/nvidiactl"]  # its own, then the spec-wide edits
    assert every.env == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert every.mounts == ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert [d.vendor for d in found.gpus()] == ["nvidia", "nvidia", "amd"] and found.problems == []


def test_a_broken_spec_is_reported_and_does_not_hide_the_others(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "b.yaml").write_text("cdiVersion: 0.5.0\ndevices: []\nkind: x.com/y\n")
    (tmp_path / "c.json").write_text(_json_spec("example.com/dev", "ok"))
    (tmp_path / "d.yaml").write_text("cdiVersion: 0.5.0\nkind: example.com/dev\ndevices:\n- name: 'bad name!'\n")
    found = cdi.inventory([tmp_path], use_nvidia_ctk=False)
    assert [d.qualified for d in found.devices] == ["example.com/dev=ok"]
    reasons = {Path(p.path).name: p.reason for p in found.problems}
    assert reasons["a.yaml"].startswith("not YAML or JSON")
    assert reasons["b.yaml"] == "no devices"
    assert "invalid device name" in reasons["d.yaml"]


def test_the_first_folder_wins_for_a_name_in_two(tmp_path: Path) -> None:
    first, second = tmp_path / "1", tmp_path / "2"
    first.mkdir()
    second.mkdir()
    (first / "x.json").write_text(_json_spec("example.com/dev", "one"))
    (second / "x.json").write_text(_json_spec("example.com/dev", "one"))
    found = cdi.inventory([first, second, tmp_path / "absent"], use_nvidia_ctk=False)
    assert len(found.devices) == 1 and found.devices[0].spec == str(first / "x.json")


@pytest.mark.parametrize(("text", "parsed"), [
    ("nvidia.com/gpu=all", ("nvidia.com/gpu", "all")),
    ("nvidia.com/gpu=GPU-3f2a:0", ("nvidia.com/gpu", "GPU-3f2a:0")),
    ("/dev/dri/renderD128", None),
    ("nvidia.com/gpu", None),
    ("gpu=all", None),
])
def test_qualified_names(text: str, parsed: tuple[str, str] | None) -> None:
    assert cdi.parse_qualified(text) == parsed


def test_nvidia_ctk_list_is_read_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in `nvidia-ctk` on PATH, printing as the real one does (log on stderr, names on stdout)."""
    tool = tmp_path / "nvidia-ctk"
    tool.write_text("#!/bin/sh\necho 'INFO[0000] Found 2 CDI devices' >&2\necho nvidia.com/gpu=0\n"
                    "echo nvidia.com/gpu=all\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = cdi.inventory([tmp_path / "none"])
    assert [(d.qualified, d.spec) for d in found.devices] == [("nvidia.com/gpu=0", "nvidia-ctk"),
                                                              ("nvidia.com/gpu=all", "nvidia-ctk")]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cdi.nvidia_ctk_list() is None


def test_render_nodes_kfd_and_drivers_from_dev_and_sysfs(tmp_path: Path) -> None:
    dev, sysfs = tmp_path / "dev", tmp_path / "sys"
    (dev / "dri").mkdir(parents=True)
    for name, driver in (("renderD128", "amdgpu"), ("renderD129", "virtio_gpu")):
        (dev / "dri" / name).write_text("")
        drv = sysfs / name / "device"
        drv.mkdir(parents=True)
        (drv / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")
    (dev / "dri" / "card0").write_text("")
    (dev / "kfd").write_text("")
    files = devices.scan(dev, sysfs)
    assert [(n.path.rsplit("/", 1)[-1], n.driver) for n in files.render_nodes] == [
        ("renderD128", "amdgpu"), ("renderD129", "virtio_gpu")]
    assert [n.driver for n in files.usable_render_nodes] == ["amdgpu"]  # a VM's virtio-gpu is no GPU to compute on
    assert files.kfd == str(dev / "kfd") and not files.nvidia
    (dev / "dri" / "renderD128").chmod(0)
    if os.geteuid() != 0:  # root opens anything
        assert not devices.scan(dev, sysfs).render_nodes[0].accessible
    (dev / "dri" / "renderD128").chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_this_host_scans_without_error() -> None:
    files = devices.scan()
    assert all(n.path.startswith("/dev/dri/renderD") for n in files.render_nodes)
