"""CDI (Container Device Interface) specs: the devices a container engine can hand over by name.

A vendor tool (the NVIDIA container toolkit's `nvidia-ctk cdi generate`, AMD's and Intel's
equivalents) writes a spec to `/etc/cdi` or `/var/run/cdi`; Podman reads the same folders and
turns `--device vendor.com/class=name` into the spec's device nodes, mounts, environment and hooks.
apirctl reads them to know what a container can be given before asking Podman for it, so that a
missing spec is one clear error with its fix instead of Podman's message mid-create.

Specs are YAML or JSON (JSON is YAML too); PyYAML reads both. A spec that does not parse is
reported with its reason, never a traceback: one broken file must not hide the others.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

#: Where Podman (and every CDI-aware engine) looks for specs, in priority order of the CDI standard.
SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
SPEC_SUFFIXES = (".yaml", ".yml", ".json")

#: `vendor.com/class=name`: the fully-qualified device name `--device` takes.
_QUALIFIED = re.compile(r"^(?P<kind>[A-Za-z0-9][A-Za-z0-9.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*)"
                        r"=(?P<name>[A-Za-z0-9][A-Za-z0-9_.:\-]*)$")

#: CDI kinds that are GPUs apirctl can use (the vendors' own tools write these).
GPU_KINDS = {"nvidia.com/gpu": "nvidia", "amd.com/gpu": "amd", "intel.com/gpu": "intel"}


class CdiDevice(BaseModel):
    """One device a spec names: `kind=name` is what `podman --device` takes."""

    kind: str  # vendor.com/class
    name: str
    spec: str  # the spec file (or "nvidia-ctk" for devices only that tool listed)
    device_nodes: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    mounts: list[str] = Field(default_factory=list)  # container paths

    @property
    def qualified(self) -> str:
        return f"{self.kind}={self.name}"

    @property
    def vendor(self) -> str | None:
        """nvidia, amd or intel for a GPU kind, else None (a CDI device that is not a GPU)."""
        return GPU_KINDS.get(self.kind)


class SpecProblem(BaseModel):
    path: str
    reason: str


class CdiInventory(BaseModel):
    """Every CDI device found, and the spec files that could not be read (with why)."""

    devices: list[CdiDevice] = Field(default_factory=list)
    problems: list[SpecProblem] = Field(default_factory=list)

    def find(self, qualified: str) -> CdiDevice | None:
        return next((d for d in self.devices if d.qualified == qualified), None)

    def gpus(self) -> list[CdiDevice]:
        return [d for d in self.devices if d.vendor is not None]


def parse_qualified(text: str) -> tuple[str, str] | None:
    """`nvidia.com/gpu=all` -> ("nvidia.com/gpu", "all"); None when `text` is not a CDI name."""
    m = _QUALIFIED.match(text.strip())
    return (m.group("kind"), m.group("name")) if m else None


def is_qualified(text: str) -> bool:
    return parse_qualified(text) is not None


def _edits(block: object) -> tuple[list[str], list[str], list[str]]:
    """(device node paths, env, mount container paths) of a `containerEdits` block."""
    if not isinstance(block, dict):
        return [], [], []
    nodes = [str(n.get("path")) for n in block.get("deviceNodes") or [] if isinstance(n, dict) and n.get("path")]
    env = [str(e) for e in block.get("env") or []]
    mounts = [str(m.get("containerPath")) for m in block.get("mounts") or []
              if isinstance(m, dict) and m.get("containerPath")]
    return nodes, env, mounts


def parse_spec(text: str, origin: str) -> list[CdiDevice]:
    """The devices of one spec's text; ValueError saying what is wrong with it."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML or JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ValueError("not a CDI spec (expected a mapping)")
    kind = doc.get("kind")
    if not isinstance(kind, str) or "/" not in kind:
        raise ValueError("no `kind: vendor.com/class`")
    if not doc.get("cdiVersion"):
        raise ValueError("no cdiVersion")
    devices = doc.get("devices")
    if not isinstance(devices, list) or not devices:
        raise ValueError("no devices")
    common_nodes, common_env, common_mounts = _edits(doc.get("containerEdits"))
    found: list[CdiDevice] = []
    for entry in devices:
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ValueError("a device without a name")
        nodes, env, mounts = _edits(entry.get("containerEdits"))
        device = CdiDevice(kind=kind, name=str(entry["name"]), spec=origin, device_nodes=[*nodes, *common_nodes],
                           env=[*env, *common_env], mounts=[*mounts, *common_mounts])
        if not is_qualified(device.qualified):
            raise ValueError(f"invalid device name {device.qualified!r}")
        found.append(device)
    return found


def spec_files(dirs: Iterable[Path] = SPEC_DIRS) -> list[Path]:
    files: list[Path] = []
    for folder in dirs:
        try:
            files += sorted(p for p in folder.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file())
        except OSError:
            continue  # absent or unreadable: nothing there for us (nor for a rootless engine)
    return files


def nvidia_ctk_list(timeout: float = 10.0) -> list[str] | None:
    """The device names `nvidia-ctk cdi list` prints, or None when the tool is not installed."""
    tool = shutil.which("nvidia-ctk")
    if tool is None:
        return None
    try:
        proc = subprocess.run([tool, "cdi", "list"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    # It logs "INFO[0000] Found N CDI devices" on stderr and one device name per line on stdout.
    return [line.strip() for line in proc.stdout.splitlines() if is_qualified(line.strip())]


def inventory(dirs: Iterable[Path] = SPEC_DIRS, use_nvidia_ctk: bool = True) -> CdiInventory:
    """Every CDI device of the spec folders, plus those `nvidia-ctk cdi list` knows of.

    When the same kind=name is in two folders, the first folder wins (as it does for Podman).
    """
    result = CdiInventory()
    seen: set[str] = set()
    for path in spec_files(dirs):
        try:
            text = path.read_text()
            devices = parse_spec(text, str(path))
        except OSError as exc:
            result.problems.append(SpecProblem(path=str(path), reason=exc.strerror or str(exc)))
            continue
        except ValueError as exc:
            result.problems.append(SpecProblem(path=str(path), reason=str(exc)))
            continue
        for device in devices:
            if device.qualified not in seen:
                seen.add(device.qualified)
                result.devices.append(device)
    for name in (nvidia_ctk_list() or []) if use_nvidia_ctk else []:
        parsed = parse_qualified(name)
        if parsed and name not in seen:
            seen.add(name)
            result.devices.append(CdiDevice(kind=parsed[0], name=parsed[1], spec="nvidia-ctk"))
    return result
