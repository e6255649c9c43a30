"""A VM's root filesystem, made from the same inference image a container runs.

`podman export` of a container created (never started) from the image gives its files; `mke2fs -d`
turns that folder into an ext4 image without mounting anything. The image is made once per image id
and shared read-only by every VM of that image (each VM gets tmpfs for /tmp and /models). The image's
entry point and environment are kept beside it: the VM runs what the container would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, ensure

#: Mount points init needs in the root (an image FROM scratch has none of them).
MOUNT_POINTS = ("proc", "sys", "dev", "tmp", "models")
#: Room left free in the ext4 image beyond the files (inodes, journal-less metadata).
SLACK = 1.25
MIN_EXTRA = 16 << 20


@dataclass(frozen=True)
class RootFs:
    """An ext4 image of an inference image's files, with what its containers run."""

    path: Path
    image_id: str
    entrypoint: list[str]
    env: dict[str, str]


def _podman(*args: str) -> str:
    try:
        done = subprocess.run(["podman", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise ApirctlError("podman is not installed", hint="run scripts/system-deps.sh") from exc
    if done.returncode != 0:
        raise ApirctlError(f"podman {args[0]} failed: {tail(done.stderr)}")
    return done.stdout


def _image_config(image_ref: str) -> tuple[str, list[str], dict[str, str]]:
    data = json.loads(_podman("image", "inspect", image_ref))[0]
    config = data.get("Config") or {}
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    return data["Id"], list(config.get("Entrypoint") or []), env


def _size_of(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*"))


def ensure_rootfs(image_ref: str) -> RootFs:
    """The ext4 image of `image_ref` (made the first time an image id is asked for)."""
    image_id, entrypoint, env = _image_config(image_ref)
    folder = ensure(dirs().cache / "vm")
    path = folder / f"rootfs-{image_id[:16]}.ext4"
    meta = path.with_suffix(".json")
    if not (path.is_file() and meta.is_file()):
        _build(image_ref, path)
        meta.write_text(json.dumps({"image": image_id, "entrypoint": entrypoint, "env": env}))
    return RootFs(path=path, image_id=image_id, entrypoint=entrypoint, env=env)


def _build(image_ref: str, path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".rootfs-") as tmp:
        work = Path(tmp)
        tar_path, tree = work / "image.tar", work / "tree"
        container = _podman("create", image_ref).strip()
        try:
            _podman("export", "-o", str(tar_path), container)
        finally:
            subprocess.run(["podman", "rm", "-f", container], capture_output=True, check=False)
        tree.mkdir()
        subprocess.run(["tar", "-C", str(tree), "-xf", str(tar_path)], capture_output=True, check=True)
        tar_path.unlink()
        for name in MOUNT_POINTS:
            target = tree / name
            if target.is_symlink() or target.is_file():
                target.unlink()
            target.mkdir(exist_ok=True)
        size = max(int(_size_of(tree) * SLACK), 0) + MIN_EXTRA
        staged = work / "rootfs.ext4"
        try:
            done = subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-L", "apirctl-root",
                                   "-d", str(tree), str(staged), f"{size // 1024}k"],
                                  capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            raise ApirctlError("mke2fs is not installed (it makes the VM's root filesystem)",
                               hint="run scripts/system-deps.sh (Debian: e2fsprogs)") from exc
        if done.returncode != 0:
            raise ApirctlError(f"mke2fs failed: {tail(done.stderr)}")
        shutil.move(staged, path)
