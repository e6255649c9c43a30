"""Fixtures for the macOS path on Linux: fakes of podman/codesign/lsof on PATH, real arm64 Mach-O
files from a macOS wheel arranged as Homebrew's krunkit -> libkrun -> libvirglrenderer chain, and
upstream-shaped API-remoting releases.

What the fakes model (and what not) is in tests/support/fakes/README.md and docs/macos.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apirctl.podman import containers
from tests.support.podman_double import MemoryPodman

#: A macOS arm64 wheel whose vendored dylibs are real, signed Mach-O files linked by @loader_path.
WHEEL = ("pillow", "13.0.0")
#: Three of its dylibs form a chain with lots of header room: demux -> webp -> sharpyuv.
CHAIN = ("libwebpdemux.2.dylib", "libwebp.7.dylib", "libsharpyuv.0.dylib")
OTHERS = ("libwebpmux.3.dylib", "libz.1.3.1.zlib-ng.dylib", "liblzma.5.dylib", "libjpeg.62.4.0.dylib",
          "libXau.6.dylib")
VERSION = "b6298-remoting-0.1.6_b5"
IMAGE = "localhost/llama-cpp-apir:b6298"


def _cache_dir() -> Path:
    return Path(os.environ["APIRCTL_CACHE_DIR"]) / "macos-machO" / f"{WHEEL[0]}-{WHEEL[1]}"


@pytest.fixture
def macho_files() -> Path:
    """Real arm64 Mach-O dylibs, fetched once from the package index into the shared test cache."""
    target = _cache_dir()
    if all((target / n).is_file() for n in CHAIN + OTHERS):
        return target
    download = target.parent / "wheel"
    download.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
         "macosx_11_0_arm64", "--python-version", "3.11", f"{WHEEL[0]}=={WHEEL[1]}", "-d", str(download)],
        capture_output=True, text=True, timeout=600, check=False)
    wheels = list(download.glob(f"{WHEEL[0]}-{WHEEL[1]}-*macosx*arm64.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"cannot fetch the macOS {WHEEL[0]} wheel: {proc.stderr.strip()[-200:]}")
    tmp = target.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheels[0]) as zf:
        for name in CHAIN + OTHERS:
            (tmp / name).write_bytes(zf.read(f"PIL/.dylibs/{name}"))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def set_reference(path: Path, old: str, new: str) -> None:
    """Test arrangement only: rewrite a dylib reference (as Homebrew's build would have linked it)."""
    from macholib.MachO import MachO

    macho = MachO(str(path))
    macho.rewriteLoadCommands(lambda name: new if name == old else None)
    with path.open("r+b") as fh:
        macho.write(fh)


def references(path: Path) -> list[str]:
    from macholib.MachO import MachO

    return [name for _i, _k, name in MachO(str(path)).headers[0].walkRelocatables()]


class FakeMac:
    """The fakes' shared state: machines, processes, signatures, failures, call log; `podman` is the
    machine's Podman API (an in-memory double of the seam: no Podman service runs here for it)."""

    def __init__(self, root: Path) -> None:
        self.podman = MemoryPodman()
        self.root = root
        self.bin = root / "bin"
        self.state_file = root / "state.json"

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    def update(self, change: Callable[[dict[str, Any]], None]) -> None:
        state = self.state()
        change(state)
        self.state_file.write_text(json.dumps(state, indent=2))

    def calls(self, tool: str | None = None) -> list[dict[str, Any]]:
        log = self.root / "calls.jsonl"
        if not log.exists():
            return []
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return [r for r in rows if tool is None or r["tool"] == tool]

    def machine_calls(self, sub: str) -> list[dict[str, Any]]:
        return [c for c in self.calls("podman") if c["argv"][:2] == ["machine", sub]]

    def add_machine(self, name: str = "podman-machine-default", provider: str = "libkrun",
                    running: bool = False) -> None:
        def change(s: dict[str, Any]) -> None:
            s.setdefault("machines", {})[name] = {"name": name, "provider": provider, "default": True,
                                                  "state": "stopped", "created": "2026-11-01T10:00:00Z"}
        self.update(change)
        if running:
            env = dict(os.environ, CONTAINERS_MACHINE_PROVIDER=provider)
            subprocess.run([str(self.bin / "podman"), "machine", "start", name], env=env, check=True,
                           capture_output=True)

    def fail(self, key: str, exit_code: int = 125, stderr: str | None = None, times: int | None = None) -> None:
        def change(s: dict[str, Any]) -> None:
            spec: dict[str, Any] = {"exit": exit_code, "stderr": stderr or f"Error: {key} failed (injected)"}
            if times is not None:
                spec["times"] = times
            s.setdefault("fail", {})[key] = spec
        self.update(change)

    def krunkit(self) -> dict[str, Any] | None:
        procs = [p for p in self.state().get("processes", {}).values() if p["command"] == "krunkit"]
        return procs[0] if procs else None


@pytest.fixture
def fake_mac(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMac]:
    """Fake `podman`, `codesign` and `lsof` first on PATH, the machine's Podman API as an in-memory
    double, and apirctl told it runs on macOS."""
    from tests.support import fake_tools

    fake = FakeMac(tmp_path / "fake-mac")
    fake_tools.install(fake.bin, monkeypatch, ("podman", "codesign", "lsof"))
    fake_tools.machine_state(fake.state_file, monkeypatch, "applehv")
    monkeypatch.setenv("APIRCTL_PLATFORM", "macos")
    for var in ("CONTAINERS_MACHINE_PROVIDER", "CONTAINERS_HELPER_BINARY_DIR", "DYLD_LIBRARY_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("apirctl.macos.machine.KRUNKIT_WAIT_S", 3.0)
    with containers.use(fake.podman):
        yield fake


class Homebrew:
    """A Homebrew prefix holding krunkit -> libkrun-efi -> libvirglrenderer, linked by absolute paths."""

    def __init__(self, prefix: Path, files: Path) -> None:
        self.prefix = prefix
        self.files = files
        self.libkrun = prefix / "opt/libkrun-efi/lib/libkrun-efi.1.dylib"
        self.virgl = prefix / "opt/virglrenderer/lib/libvirglrenderer.1.dylib"
        self.krunkit = prefix / "bin/krunkit"

    def install_krunkit(self, source: str, version: str) -> Path:
        """(Re)install krunkit from one of the wheel's dylibs, as `brew upgrade` would."""
        cellar = self.prefix / "Cellar/krunkit" / version / "bin/krunkit"
        cellar.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.files / source, cellar)
        old = next(r for r in references(cellar) if r.startswith("@loader_path/libwebp."))
        set_reference(cellar, old, str(self.libkrun))
        cellar.chmod(0o755)
        self.krunkit.parent.mkdir(parents=True, exist_ok=True)
        self.krunkit.unlink(missing_ok=True)
        self.krunkit.symlink_to(cellar)
        return cellar


@pytest.fixture
def homebrew(tmp_path: Path, macho_files: Path) -> Homebrew:
    brew = Homebrew(tmp_path / "homebrew", macho_files)
    virgl = brew.prefix / "Cellar/virglrenderer/1.1.0/lib/libvirglrenderer.1.dylib"
    virgl.parent.mkdir(parents=True)
    shutil.copy2(macho_files / CHAIN[2], virgl)
    libkrun = brew.prefix / "Cellar/libkrun-efi/1.14.0/lib/libkrun-efi.1.dylib"
    libkrun.parent.mkdir(parents=True)
    shutil.copy2(macho_files / CHAIN[1], libkrun)
    set_reference(libkrun, f"@loader_path/{CHAIN[2]}", str(brew.virgl))
    for link, target in ((brew.prefix / "opt/libkrun-efi", libkrun.parent.parent),
                         (brew.prefix / "opt/virglrenderer", virgl.parent.parent)):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
    brew.install_krunkit(CHAIN[0], "1.0.0")
    return brew


@pytest.fixture
def homebrew_on_mac(fake_mac: FakeMac, homebrew: Homebrew, monkeypatch: pytest.MonkeyPatch) -> Homebrew:
    """The Homebrew chain on PATH and registered with the fakes: podman's default krunkit, signed as
    shipped."""
    monkeypatch.setenv("PATH", f"{os.environ['PATH']}{os.pathsep}{homebrew.krunkit.parent}")

    def change(s: dict[str, Any]) -> None:
        s["helpers"] = {"krunkit": str(homebrew.krunkit)}
        shipped = [homebrew.krunkit, homebrew.libkrun, homebrew.virgl, *homebrew.files.iterdir()]
        s["trusted_sha256"] = [hashlib.sha256(p.read_bytes()).hexdigest() for p in shipped]
    fake_mac.update(change)
    return homebrew


def make_release(where: Path, files: Path, version: str | None = VERSION, image: str | None = IMAGE,
                 extra: dict[str, bytes] | None = None) -> Path:
    """An upstream-shaped API-remoting release directory (real Mach-O files under the upstream names)."""
    top = where / f"llama_cpp-api_remoting-{version or 'unknown'}"
    (top / "bin").mkdir(parents=True)
    shutil.copy2(files / "liblzma.5.dylib", top / "bin/libggml-virtgpu-backend.dylib")
    shutil.copy2(files / "libjpeg.62.4.0.dylib", top / "bin/libggml-metal.dylib")
    shutil.copy2(files / "libz.1.3.1.zlib-ng.dylib", top / "bin/libvirglrenderer.1.dylib")
    (top / "src_info").mkdir()
    if version:
        (top / "src_info/version.txt").write_text(version + "\n")
    if image:
        (top / "src_info/ramalama.image-info.txt").write_text(image + "\n")
    for rel, data in (extra or {}).items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(data)
    return top


def make_tarball(release: Path) -> Path:
    out = release.parent / f"{release.name}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(release, arcname=release.name)
    return out


@pytest.fixture
def release(tmp_path: Path, macho_files: Path) -> Path:
    return make_release(tmp_path / "release", macho_files)


@pytest.fixture
def installed(release: Path) -> Any:
    """The release installed and active."""
    from apirctl.macos import bundle

    b, _ = bundle.import_from(str(release))
    return b
