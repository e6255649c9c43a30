"""The krunkit patch: make Podman's krunkit load the bundle's API-remoting virglrenderer.

krunkit links libkrun, which links libvirglrenderer by absolute Homebrew paths. We copy
krunkit and its libkrun into the bundle's `bin/`, point krunkit at
`@executable_path/<libkrun>` and libkrun at `@executable_path/<bundle virglrenderer>`, and
re-sign both ad hoc with our entitlements. The load commands are rewritten with macholib,
so no Xcode command-line tools (`otool`, `install_name_tool`) are needed; only `codesign`,
which ships with macOS.

The patch is verified (every other load command and every byte after the header must be
unchanged), idempotent (a record of the source digests says when nothing is to be done, and
a Homebrew upgrade of krunkit changes them) and atomic (built in a temporary directory next
to `bin/`, then renamed into place; the previous files come back on failure).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apirctl.digest import sha256_file
from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, package_data

KRUNKIT = "krunkit"
LIBKRUN_PREFIX = "libkrun"
VIRGL_PREFIX = "libvirglrenderer"
RECORD = "krunkit-patch.json"
#: Where Homebrew and the Podman installer put krunkit (Apple silicon first).
KNOWN_LOCATIONS = ("/opt/homebrew/bin/krunkit", "/opt/podman/bin/krunkit", "/usr/local/bin/krunkit")


def entitlements_file() -> Path:
    """Our entitlements: the hypervisor, and library validation disabled (correctly spelled)."""
    return package_data("krunkit_patches", "krunkit.entitlements")


# --- reading Mach-O files -----------------------------------------------------------------------


@dataclass(frozen=True)
class Dylib:
    """One dylib reference of a Mach-O file (an LC_LOAD_DYLIB-like command)."""

    index: int  # position among the header's load commands
    kind: str  # load_dylib, load_weak_dylib, reexport_dylib, ...
    name: str


@dataclass
class MachOInfo:
    """What the patch reads from a file: dylib references, rpaths, raw load commands per slice."""

    path: Path
    dylibs: list[Dylib]
    rpaths: list[str]
    commands: list[list[bytes]] = field(default_factory=list)  # raw bytes of each command, per slice
    tails: list[str] = field(default_factory=list)  # sha256 of each slice after its header area


def _open(path: Path) -> Any:
    from macholib.MachO import MachO

    try:
        return MachO(str(path))
    except (ValueError, struct.error, OSError, AssertionError) as exc:
        raise ApirctlError(f"{path} is not a readable Mach-O file ({exc})",
                           hint="pass the real krunkit with --krunkit PATH") from exc


def read(path: Path) -> MachOInfo:
    """Read the load commands of every slice (macholib), and the raw bytes for verification."""
    from macholib import mach_o

    macho = _open(path)
    blob = path.read_bytes()
    info = MachOInfo(path=path, dylibs=[], rpaths=[])
    for n, header in enumerate(macho.headers):
        raw: list[bytes] = []
        pos = header.offset + _header_size(header)
        for lc, _cmd, _data in header.commands:
            raw.append(blob[pos:pos + lc.cmdsize])
            pos += lc.cmdsize
        info.commands.append(raw)
        info.tails.append(hashlib.sha256(blob[header.offset + header.low_offset:
                                              header.offset + header.size]).hexdigest())
        if n == 0:
            info.dylibs = [Dylib(idx, kind, name) for idx, kind, name in header.walkRelocatables()]
            for lc, cmd, data in header.commands:
                if lc.cmd == mach_o.LC_RPATH:
                    start = cmd.path - _fixed_size(lc, cmd)
                    info.rpaths.append(data[start:data.find(b"\x00", start)].decode())
    return info


def _fixed_size(lc: object, cmd: object) -> int:
    from macholib.ptypes import sizeof

    return int(sizeof(lc.__class__) + sizeof(cmd.__class__))


def _header_size(header: object) -> int:
    from macholib.ptypes import sizeof

    return int(sizeof(header.mach_header))  # type: ignore[attr-defined]


def _expand(path: str, loader: Path, executable: Path) -> Path:
    if path.startswith("@loader_path"):
        return loader.parent / path.removeprefix("@loader_path").lstrip("/")
    if path.startswith("@executable_path"):
        return executable.parent / path.removeprefix("@executable_path").lstrip("/")
    return Path(path)


def resolve(ref: str, loader: Path, executable: Path, rpaths: list[str]) -> Path | None:
    """Where dyld would find `ref` (without DYLD_* variables); None when no file exists there."""
    if ref.startswith("@rpath/"):
        rest = ref.removeprefix("@rpath/")
        candidates = [_expand(rpath, loader, executable) / rest for rpath in rpaths]
    else:
        candidates = [_expand(ref, loader, executable)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    return None


def _find_ref(info: MachOInfo, prefix: str) -> Dylib | None:
    for dylib in info.dylibs:
        if Path(dylib.name).name.startswith(prefix):
            return dylib
    return None


# --- the running krunkit -------------------------------------------------------------------------


def process_files() -> tuple[int | None, list[str]]:
    """The pid of the running krunkit and the files it has open or mapped (`lsof -c krunkit -Fn`)."""
    exe = shutil.which("lsof")
    if exe is None:
        return None, []
    try:
        proc = subprocess.run([exe, "-c", "krunkit", "-Fn"], capture_output=True, text=True, timeout=30,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, []
    pid: int | None = None
    names: list[str] = []
    for line in proc.stdout.splitlines():
        if line.startswith("p") and pid is None:
            pid = int(line[1:]) if line[1:].isdigit() else None
        elif line.startswith("n"):
            names.append(line[1:])
    return pid, names


def mapped_virglrenderers() -> tuple[int | None, list[str]]:
    """The running krunkit's pid and the virglrenderer libraries it mapped."""
    pid, names = process_files()
    return pid, [n for n in names if Path(n).name.startswith("libvirglrenderer")]


def same_file(a: str | Path, b: str | Path) -> bool:
    """Compared by real path, never by a substring of a version."""
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


# --- finding krunkit ------------------------------------------------------------------------------


def _inside_bundles(path: Path) -> bool:
    try:
        path.resolve().relative_to(dirs().bundles.resolve())
        return True
    except ValueError:
        return False


def find(explicit: str | None = None) -> Path:
    """The krunkit to patch: --krunkit, else CONTAINERS_HELPER_BINARY_DIR, Homebrew, the Podman
    installer, PATH. Patched copies inside apirctl's bundles are skipped (a restart with remoting
    points CONTAINERS_HELPER_BINARY_DIR there)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ApirctlError(f"krunkit not found at {path}", exit_code=127,
                               hint="install it with `brew tap slp/krunkit && brew install krunkit`")
        return path.resolve()
    candidates: list[Path] = []
    helper_dir = os.environ.get("CONTAINERS_HELPER_BINARY_DIR")
    if helper_dir:
        candidates.append(Path(helper_dir) / KRUNKIT)
    candidates += [Path(p) for p in KNOWN_LOCATIONS]
    on_path = shutil.which(KRUNKIT)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and not _inside_bundles(candidate):
            return candidate.resolve()
    raise ApirctlError("krunkit is not installed", exit_code=127,
                       hint="install it with `brew tap slp/krunkit && brew install krunkit`, "
                            "or pass --krunkit PATH")


# --- the patch ------------------------------------------------------------------------------------


@dataclass
class PatchPlan:
    """The files and references one patch run works on."""

    krunkit_src: Path
    libkrun_src: Path
    libkrun_ref: str  # krunkit's reference to libkrun, as found
    virgl_ref: str  # libkrun's reference to libvirglrenderer, as found
    virgl_name: str  # the bundle's virglrenderer file name in bin/

    @property
    def libkrun_name(self) -> str:
        """The leaf name krunkit asks for (Homebrew's file may be a versioned name behind symlinks)."""
        return Path(self.libkrun_ref).name

    @property
    def new_libkrun_ref(self) -> str:
        return f"@executable_path/{self.libkrun_name}"

    @property
    def new_virgl_ref(self) -> str:
        return f"@executable_path/{self.virgl_name}"


class PatchResult(dict):
    """JSON-able summary of a patch run (what `machine restart --json` can show)."""


def bundle_virglrenderer(bin_dir: Path) -> Path:
    """The API-remoting virglrenderer a bundle ships."""
    found = sorted(p for p in bin_dir.glob(f"{VIRGL_PREFIX}*.dylib") if p.is_file())
    if not found:
        raise ApirctlError(f"the bundle in {bin_dir.parent} has no {VIRGL_PREFIX}*.dylib in bin/",
                           hint="reinstall the bundle with `apirctl install --from ...`")
    exact = [p for p in found if p.name == f"{VIRGL_PREFIX}.1.dylib"]
    return (exact or found)[0]


def plan(bin_dir: Path, krunkit: str | None = None) -> PatchPlan:
    """Find krunkit, the libkrun it links and libkrun's virglrenderer reference."""
    src = find(krunkit)
    kinfo = read(src)
    lk = _find_ref(kinfo, LIBKRUN_PREFIX)
    if lk is None:
        raise ApirctlError(f"{src} does not link a {LIBKRUN_PREFIX} library; is it krunkit?",
                           hint="pass the real krunkit with --krunkit PATH")
    lk_path = resolve(lk.name, src, src, kinfo.rpaths)
    if lk_path is None:
        raise ApirctlError(f"{src} links {lk.name}, which does not exist",
                           hint="reinstall krunkit: `brew reinstall krunkit`")
    linfo = read(lk_path)
    vg = _find_ref(linfo, VIRGL_PREFIX)
    if vg is None:
        raise ApirctlError(f"{lk_path} does not link a {VIRGL_PREFIX} library (no GPU support)",
                           hint="install the GPU-enabled libkrun-efi that krunkit ships with")
    virgl = bundle_virglrenderer(bin_dir)
    return PatchPlan(krunkit_src=src, libkrun_src=lk_path, libkrun_ref=lk.name, virgl_ref=vg.name,
                     virgl_name=virgl.name)


def _record(bin_dir: Path) -> Path:
    return bin_dir.parent / RECORD


def read_record(bin_dir: Path) -> dict | None:
    try:
        data = json.loads(_record(bin_dir).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(bin_dir: Path, p: PatchPlan) -> bool:
    """True when bin/ holds a patch of exactly these sources with these entitlements, untouched since."""
    rec = read_record(bin_dir)
    if not rec:
        return False
    try:
        return (rec["krunkit_source"]["sha256"] == sha256_file(p.krunkit_src)
                and rec["libkrun_source"]["sha256"] == sha256_file(p.libkrun_src)
                and rec["virglrenderer"] == p.virgl_name
                and rec["entitlements_sha256"] == sha256_file(entitlements_file())
                and all((bin_dir / name).is_file() and sha256_file(bin_dir / name) == digest
                        for name, digest in rec["outputs"].items()))
    except (KeyError, TypeError, OSError):
        return False


def _rewrite(path: Path, old: str, new: str) -> None:
    """Rewrite one dylib reference in every slice, refusing when the header has no room."""
    macho = _open(path)

    def change(name: str) -> str | None:
        return new if name == old else None

    # macholib prints a warning on stdout when a header grows past its room; we check ourselves.
    with contextlib.redirect_stdout(io.StringIO()):
        header_changes = [header.rewriteLoadCommands(change) for header in macho.headers]
    if not any(header_changes):
        raise ApirctlError(f"{path.name} has no reference to {old}")
    for header in macho.headers:
        needed = header.total_size + header.sizediff
        if needed > header.low_offset:
            raise ApirctlError(
                f"not enough Mach-O header space in {path.name} to write {new} "
                f"(needs {needed} bytes, room for {header.low_offset})",
                hint="it was linked without header padding (-headerpad_max_install_names)")
    with path.open("r+b") as fh:
        macho.write(fh)


def _check(before: MachOInfo, after: MachOInfo, old: str, new: str) -> None:
    """Exactly one kind of change: the `old` references now read `new`; all else byte-identical."""
    if after.tails != before.tails or len(after.commands) != len(before.commands):
        raise ApirctlError(f"patching {after.path.name} changed more than its load commands")
    for slice_before, slice_after in zip(before.commands, after.commands, strict=True):
        if len(slice_before) != len(slice_after):
            raise ApirctlError(f"patching {after.path.name} changed the number of load commands")
        for raw_b, raw_a in zip(slice_before, slice_after, strict=True):
            if raw_b == raw_a:
                continue
            # a rewritten dylib command: same type and fields, only the name differs
            if raw_b[:4] != raw_a[:4] or raw_b[8:24] != raw_a[8:24]:
                raise ApirctlError(f"patching {after.path.name} changed an unrelated load command")
            name_b = raw_b[24:].split(b"\x00", 1)[0].decode()
            name_a = raw_a[24:].split(b"\x00", 1)[0].decode()
            if (name_b, name_a) != (old, new):
                raise ApirctlError(f"patching {after.path.name} rewrote {name_b} into {name_a}")
    names = [d.name for d in after.dylibs]
    if old in names or new not in names:
        raise ApirctlError(f"after patching, {after.path.name} does not reference {new}")


def codesign(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("codesign")
    if exe is None:
        raise ApirctlError("codesign not found: the patched krunkit must be signed on macOS", exit_code=127)
    return subprocess.run([exe, *args], capture_output=True, text=True, check=False)


def _sign_and_verify(path: Path) -> None:
    signed = codesign("--force", "-s", "-", "--entitlements", str(entitlements_file()), str(path))
    if signed.returncode != 0:
        why = tail(signed.stderr or signed.stdout, default=f"exit {signed.returncode}")
        raise ApirctlError(f"codesign could not sign {path.name}: {why}")
    verified = codesign("--verify", str(path))
    if verified.returncode != 0:
        why = tail(verified.stderr or verified.stdout, default=f"exit {verified.returncode}")
        raise ApirctlError(f"codesign --verify rejected {path.name}: {why}")


def patch(bin_dir: Path, krunkit: str | None = None, force: bool = False) -> PatchResult:
    """Patch krunkit into `bin_dir` (a bundle's bin/); a no-op when the current patch is still valid."""
    p = plan(bin_dir, krunkit)
    result = PatchResult(krunkit=str(bin_dir / KRUNKIT), libkrun=str(bin_dir / p.libkrun_name),
                         krunkit_source=str(p.krunkit_src), libkrun_source=str(p.libkrun_src),
                         virglrenderer=str(bin_dir / p.virgl_name))
    if not force and is_current(bin_dir, p):
        result["changed"] = False
        return result
    previous = read_record(bin_dir)
    reason = "first patch"
    if previous:
        old_sha = previous.get("krunkit_source", {}).get("sha256")
        reason = "krunkit was upgraded" if old_sha and old_sha != sha256_file(p.krunkit_src) else "patch refreshed"
    work = Path(tempfile.mkdtemp(prefix=".krunkit-patch-", dir=bin_dir.parent))
    try:
        new_krunkit = work / KRUNKIT
        new_libkrun = work / p.libkrun_name
        shutil.copy2(p.krunkit_src, new_krunkit)
        shutil.copy2(p.libkrun_src, new_libkrun)
        new_krunkit.chmod(0o755)
        for path, old, new in ((new_krunkit, p.libkrun_ref, p.new_libkrun_ref),
                               (new_libkrun, p.virgl_ref, p.new_virgl_ref)):
            before = read(path)
            _rewrite(path, old, new)
            _check(before, read(path), old, new)
        for path in (new_krunkit, new_libkrun):
            _sign_and_verify(path)
        record = {
            "krunkit_source": {"path": str(p.krunkit_src), "sha256": sha256_file(p.krunkit_src)},
            "libkrun_source": {"path": str(p.libkrun_src), "sha256": sha256_file(p.libkrun_src)},
            "references": {KRUNKIT: p.new_libkrun_ref, p.libkrun_name: p.new_virgl_ref},
            "virglrenderer": p.virgl_name,
            "entitlements_sha256": sha256_file(entitlements_file()),
            "outputs": {KRUNKIT: sha256_file(new_krunkit), p.libkrun_name: sha256_file(new_libkrun)},
        }
        (work / RECORD).write_text(json.dumps(record, indent=2))
        _install(work, bin_dir, [KRUNKIT, p.libkrun_name])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["changed"] = True
    result["reason"] = reason
    return result


def _install(work: Path, bin_dir: Path, names: list[str]) -> None:
    """Rename the new files into bin/ and the record beside it; put the old ones back on failure."""
    backup = work / "previous"
    backup.mkdir()
    targets = [(work / n, bin_dir / n) for n in names] + [(work / RECORD, _record(bin_dir))]
    moved: list[tuple[Path, Path | None]] = []
    try:
        for src, dst in targets:
            saved: Path | None = None
            if dst.exists():
                saved = backup / dst.name
                os.replace(dst, saved)
            moved.append((dst, saved))
            os.replace(src, dst)
    except OSError as exc:
        for dst, saved in reversed(moved):
            if saved is not None:
                os.replace(saved, dst)
            else:
                dst.unlink(missing_ok=True)
        raise ApirctlError(f"could not install the patched krunkit into {bin_dir}: {exc}") from exc


def verify(bin_dir: Path) -> list[str]:
    """Problems with an installed patch (empty when sound): references, digests, signature."""
    rec = read_record(bin_dir)
    if not rec:
        return ["krunkit is not patched into this bundle"]
    problems: list[str] = []
    for name, digest in rec.get("outputs", {}).items():
        path = bin_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        if sha256_file(path) != digest:
            problems.append(f"{name} changed since it was patched")
    for name, ref in rec.get("references", {}).items():
        path = bin_dir / name
        if path.is_file() and ref not in [d.name for d in read(path).dylibs]:
            problems.append(f"{name} does not reference {ref}")
    return problems
