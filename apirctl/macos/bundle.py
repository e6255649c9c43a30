"""API-remoting bundles: the host libraries krunkit loads, versioned side by side, one active.

A bundle is an upstream API-remoting release (or a local build of one): `bin/` with the
ggml-virtgpu backend library, ggml-metal and the API-remoting virglrenderer, and `src_info/`
with the version and the container image that serves it. `apirctl install` copies it under
the data directory (`bundles/<version>/`) with the sha256 of every file in `bundle.json`, so
that `install --list` can tell a bundle that was modified since. The active one is named in
`bundles/active`; the macOS machine and `serve --transport virtgpu` use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field

from apirctl import host
from apirctl.build import llamacpp
from apirctl.digest import sha256_file
from apirctl.errors import ApirctlError
from apirctl.macos import krunkit
from apirctl.paths import dirs, ensure

MANIFEST = "bundle.json"
ACTIVE = "active"
VERSION_FILE = "src_info/version.txt"
IMAGE_FILE = "src_info/ramalama.image-info.txt"
#: Backend library names, newest first (upstream renamed ggml-remotingbackend to ggml-virtgpu-backend).
BACKEND_LIBRARIES = ("libggml-virtgpu-backend", "libggml-remotingbackend")
#: GGML libraries a bundle's backend can load, with their registration symbols, best first.
GGML_LIBRARIES = (("libggml-metal", "ggml_backend_metal_reg"), ("libggml-cuda", "ggml_backend_cuda_reg"),
                  ("libggml-cpu", "ggml_backend_cpu_reg"))
#: Files a release may carry that the krunkit patch makes for this host instead.
PATCH_OUTPUTS = re.compile(r"^(krunkit|libkrun[^/]*\.dylib)$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")

ProgressFn = Callable[[int, int | None], None]


class Bundle(BaseModel):
    """An installed bundle, as recorded in its `bundle.json`."""

    version: str
    path: Path
    image: str | None = None
    source: str
    installed_at: str
    files: dict[str, str] = Field(default_factory=dict)  # relative path -> sha256
    backend_library: str  # file name in bin/
    ggml_library: str  # file name in bin/
    ggml_reg: str
    virglrenderer: str | None = None  # file name in bin/ (absent in builds made without one)
    active: bool = False

    @property
    def bin_dir(self) -> Path:
        return self.path / "bin"

    @property
    def backend_path(self) -> Path:
        return self.bin_dir / self.backend_library

    @property
    def ggml_path(self) -> Path:
        return self.bin_dir / self.ggml_library

    def version_on_disk(self) -> str | None:
        """The version the bundle itself states (`src_info/version.txt`); None when unreadable."""
        try:
            text = (self.path / VERSION_FILE).read_text().strip()
        except OSError:
            return None
        return text or None

    def modified(self) -> list[str]:
        """Files whose content no longer matches the digest recorded at install (or are gone)."""
        changed = []
        for rel, digest in sorted(self.files.items()):
            path = self.path / rel
            if not path.is_file() or sha256_file(path) != digest:
                changed.append(rel)
        return changed


def root() -> Path:
    return dirs().bundles


def _load(path: Path) -> Bundle | None:
    try:
        data = json.loads((path / MANIFEST).read_text())
        data["path"] = str(path)
        return Bundle.model_validate(data)
    except (OSError, ValueError):
        return None


def active_version() -> str | None:
    try:
        text = (root() / ACTIVE).read_text().strip()
    except OSError:
        return None
    return text or None


def list_bundles() -> list[Bundle]:
    """Installed bundles, sorted by version, with `active` set."""
    base = root()
    if not base.is_dir():
        return []
    current = active_version()
    found = []
    for child in sorted(base.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            loaded = _load(child)
            if loaded is not None:
                loaded.active = loaded.version == current
                found.append(loaded)
    return found


def get(version: str) -> Bundle:
    for bundle in list_bundles():
        if bundle.version == version:
            return bundle
    known = ", ".join(b.version for b in list_bundles()) or "none"
    raise ApirctlError(f"no bundle {version} is installed (installed: {known})",
                       hint="see `apirctl install --list`")


def active() -> Bundle | None:
    """The active bundle, or None (no bundle installed, or the active one was removed by hand)."""
    current = active_version()
    if current is None:
        return None
    for bundle in list_bundles():
        if bundle.version == current:
            return bundle
    return None


def require_active() -> Bundle:
    found = active()
    if found is None:
        raise ApirctlError("no API-remoting bundle is installed", exit_code=127,
                           hint="run `apirctl install --from RELEASE.tar.gz` (or a directory or URL)")
    return found


def _write_active(version: str | None) -> None:
    base = ensure(root())
    if version is None:
        (base / ACTIVE).unlink(missing_ok=True)
        return
    tmp = base / f".{ACTIVE}.tmp"
    tmp.write_text(version + "\n")
    os.replace(tmp, base / ACTIVE)


def activate(version: str) -> Bundle:
    bundle = get(version)
    _write_active(bundle.version)
    bundle.active = True
    return bundle


# --- import ---------------------------------------------------------------------------------------


def _find_root(tree: Path) -> Path:
    """The directory of an unpacked release that holds `bin/` (the tree itself or its one child)."""
    if (tree / "bin").is_dir():
        return tree
    children = [c for c in tree.iterdir() if c.is_dir() and not c.name.startswith(".")]
    if len(children) == 1 and (children[0] / "bin").is_dir():
        return children[0]
    raise ApirctlError(f"{tree.name} is not an API-remoting release: no bin/ directory",
                       hint="pass the release tarball, or the directory that holds bin/ and src_info/")


def _pick(bin_dir: Path, stems: tuple[str, ...]) -> str | None:
    for stem in stems:
        for suffix in (".dylib", ".so"):
            if (bin_dir / f"{stem}{suffix}").is_file():
                return f"{stem}{suffix}"
    return None


def _describe(tree: Path) -> dict[str, str | None]:
    bin_dir = tree / "bin"
    backend = _pick(bin_dir, BACKEND_LIBRARIES)
    if backend is None:
        raise ApirctlError(f"{tree.name}/bin has no ggml-virtgpu backend library "
                           f"({' or '.join(s + '.dylib' for s in BACKEND_LIBRARIES)})",
                           hint="this does not look like an API-remoting release")
    found = [(name, reg) for stem, reg in GGML_LIBRARIES if (name := _pick(bin_dir, (stem,))) is not None]
    if not found:
        raise ApirctlError(f"{tree.name}/bin has no GGML backend library for the host (libggml-metal.dylib)",
                           hint="this does not look like an API-remoting release")
    ggml, reg = found[0]
    virgl = sorted(p.name for p in bin_dir.glob("libvirglrenderer*.dylib"))
    return {"backend_library": backend, "ggml_library": ggml, "ggml_reg": reg,
            "virglrenderer": ("libvirglrenderer.1.dylib" if "libvirglrenderer.1.dylib" in virgl
                              else (virgl[0] if virgl else None))}


def _safe_extract(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise ApirctlError(f"{archive.name} holds an unsafe path: {member.name}")
                if member.issym() or member.islnk():
                    target = Path(member.linkname)
                    if target.is_absolute() or ".." in (name.parent / target).parts:
                        raise ApirctlError(f"{archive.name} holds a link out of the bundle: {member.name}")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # pragma: no cover - Python < 3.11.4: members were checked above
                tar.extractall(dest)
    except tarfile.ReadError:
        raise ApirctlError(f"cannot unpack {archive.name}: not a tar archive (plain, gzip, bzip2 or xz)",
                           hint="pass an upstream API-remoting release tarball (.tar.gz)") from None
    except (tarfile.TarError, OSError) as exc:
        raise ApirctlError(f"cannot unpack {archive.name}: {' '.join(str(exc).split())}",
                           hint="pass an upstream API-remoting release tarball (.tar.gz)") from exc


def download(url: str, dest: Path, expected_sha256: str | None = None,
             progress: ProgressFn | None = None) -> Path:
    """Download `url` into `dest` (streamed, with progress), checking the digest when given."""
    import httpx

    digest = hashlib.sha256()
    try:
        with httpx.stream("GET", url, follow_redirects=True, timeout=60.0) as response:
            if response.status_code != 200:
                raise ApirctlError(f"download of {url} failed: HTTP {response.status_code}")
            total = int(response.headers.get("content-length") or 0) or None
            done = 0
            with dest.open("wb") as fh:
                for chunk in response.iter_bytes(1 << 16):
                    fh.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if progress:
                        progress(done, total)
    except httpx.HTTPError as exc:
        raise ApirctlError(f"download of {url} failed: {exc}") from exc
    if expected_sha256 and digest.hexdigest() != expected_sha256.lower():
        dest.unlink(missing_ok=True)
        raise ApirctlError(f"{url} does not match the expected sha256 "
                           f"(got {digest.hexdigest()}, expected {expected_sha256.lower()})")
    return dest


def import_from(source: str, *, sha256_digest: str | None = None, version: str | None = None,
                image: str | None = None, progress: ProgressFn | None = None) -> tuple[Bundle, bool]:
    """Install a release from a tarball, a directory or an http(s) URL.

    Returns the bundle and whether anything was installed (False: the same files were already
    installed under that version). Nothing is left behind on failure: the bundle is staged in a
    temporary directory beside the others and renamed into place.
    """
    made = _first_missing(root())  # made here: removed again if the import fails
    base = ensure(root())
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=base))
    installed = False
    try:
        if source.startswith(("http://", "https://")):
            name = source.rstrip("/").rsplit("/", 1)[-1] or "bundle.tar.gz"
            archive = download(source, staging / name, sha256_digest, progress)
            _safe_extract(archive, staging / "tree")
            archive.unlink()
            tree = _find_root(staging / "tree")
        else:
            path = Path(source).expanduser()
            if not path.exists():
                raise ApirctlError(f"{source} does not exist",
                                   hint="pass a release tarball, a directory or an http(s) URL")
            if path.is_dir():
                tree = _find_root(path)
            else:
                if sha256_digest and sha256_file(path) != sha256_digest.lower():
                    raise ApirctlError(f"{path.name} does not match the expected sha256")
                _safe_extract(path, staging / "tree")
                tree = _find_root(staging / "tree")
        result = _stage(tree, staging, source, version, image)
        installed = True
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not installed and made is not None:  # a failed first import leaves no empty folders
            for folder in [base, *base.parents]:
                if folder == made.parent:
                    break
                try:
                    folder.rmdir()
                except OSError:
                    break


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None when it exists)."""
    missing = None
    for folder in [path, *path.parents]:
        if folder.exists():
            return missing
        missing = folder
    return missing


def _stage(tree: Path, staging: Path, source: str, version: str | None,
           image: str | None) -> tuple[Bundle, bool]:
    described = _describe(tree)
    stated = None
    if (tree / VERSION_FILE).is_file():
        stated = (tree / VERSION_FILE).read_text().strip() or None
    chosen = version or stated
    if chosen is None:
        raise ApirctlError(f"{Path(source).name} has no {VERSION_FILE}: its version is unknown",
                           exit_code=20, hint="give it one with --version VERSION")
    if not _VERSION_RE.match(chosen):
        raise ApirctlError(f"invalid bundle version {chosen!r}: use letters, digits, '.', '_', '+' and '-'")
    if image is None and (tree / IMAGE_FILE).is_file():
        image = (tree / IMAGE_FILE).read_text().strip() or None

    out = staging / "bundle"
    skipped = []
    for sub in ("bin", "src_info", "entitlement"):
        if not (tree / sub).is_dir():
            continue
        for src in sorted((tree / sub).rglob("*")):
            rel = src.relative_to(tree)
            if sub == "bin" and PATCH_OUTPUTS.match(src.name):
                skipped.append(src.name)  # made for the release author's krunkit; we patch our own
                continue
            dst = out / rel
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst, follow_symlinks=True)
    (out / "src_info").mkdir(parents=True, exist_ok=True)
    (out / VERSION_FILE).write_text(chosen + "\n")
    if image:
        (out / IMAGE_FILE).write_text(image + "\n")
    files = {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*")) if p.is_file()}
    bundle = Bundle(version=chosen, path=root() / chosen, image=image, source=source,
                    installed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), files=files,
                    **described)  # type: ignore[arg-type]
    existing = _load(root() / chosen)
    if existing is not None:
        if existing.files == files:
            existing.active = existing.version == active_version()
            return existing, False
        raise ApirctlError(f"bundle {chosen} is already installed with different files",
                           hint=f"remove it first with `apirctl uninstall {chosen}`, or pass --version")
    if (root() / chosen).exists():
        shutil.rmtree(root() / chosen)  # a directory without a manifest: an interrupted install
    (out / MANIFEST).write_text(json.dumps(bundle.model_dump(mode="json", exclude={"path", "active"}),
                                           indent=2))
    os.rename(out, root() / chosen)
    if active_version() is None or active() is None:
        _write_active(chosen)
    bundle.active = bundle.version == active_version()
    return bundle, True


# --- removal --------------------------------------------------------------------------------------


def virglrenderer_path(bundle: Bundle) -> Path | None:
    """The bundle's API-remoting virglrenderer (what krunkit must map), if it ships one."""
    return bundle.bin_dir / bundle.virglrenderer if bundle.virglrenderer else None


def in_use(bundle: Bundle) -> bool:
    """Whether a running krunkit mapped this bundle's virglrenderer (only ever true on macOS)."""
    expected = virglrenderer_path(bundle)
    if expected is None or shutil.which("podman") is None:
        return False
    _pid, virgl = krunkit.mapped_virglrenderers()
    return any(krunkit.same_file(v, expected) for v in virgl)


def uninstall(version: str | None = None) -> Bundle:
    """Remove a bundle (default: the active one); refuses the one the running machine uses."""
    if version is None:
        bundle = active()
        if bundle is None:
            installed = list_bundles()
            if not installed:
                raise ApirctlError("no bundle is installed", hint="see `apirctl install --help`")
            if len(installed) != 1:
                raise ApirctlError("which bundle? none is active",
                                   hint="name one: see `apirctl install --list`")
            bundle = installed[0]
    else:
        bundle = get(version)
    if in_use(bundle):
        raise ApirctlError(f"bundle {bundle.version} is in use by the running machine",
                           hint="run `apirctl machine restart` (without --remoting) or "
                                "`apirctl machine stop` first")
    trash = root() / f".remove-{bundle.version}"
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(bundle.path, trash)
    if bundle.active:
        _write_active(None)
    shutil.rmtree(trash, ignore_errors=True)
    return bundle


def backend_libraries(library: Path | None = None, ggml_library: Path | None = None,
                      reg: str | None = None) -> tuple[Path, Path, str]:
    """The backend library, GGML library and registration symbol to drive (selftest, probes).

    What the caller left out comes from the active bundle on macOS (what krunkit will load), else
    from the host build; the files must exist.
    """
    if library is None or ggml_library is None or reg is None:
        d_lib, d_ggml, d_reg = _default_libraries()
        library = library or d_lib
        ggml_library = ggml_library or d_ggml
        reg = reg or d_reg
    for what, path in (("backend library", library), ("GGML library", ggml_library)):
        if not path.is_file():
            raise ApirctlError(f"{what} {path} does not exist",
                               hint="pass --library/--ggml-library, or run `apirctl setup`")
    return library.resolve(), ggml_library.resolve(), reg


def _default_libraries() -> tuple[Path, Path, str]:
    if host.is_macos():
        chosen = active()
        if chosen is not None:
            return chosen.backend_path, chosen.ggml_path, chosen.ggml_reg
    build = llamacpp.require_build()
    stem = {"cuda": "ggml-cuda", "metal": "ggml-metal"}.get(build.backend, "ggml-cpu")
    symbol = {"cuda": "ggml_backend_cuda_reg", "metal": "ggml_backend_metal_reg"}.get(
        build.backend, "ggml_backend_cpu_reg")
    return build.library("ggml-virtgpu-backend"), build.library(stem), symbol


# --- a local build (macOS) ------------------------------------------------------------------------


def build(virglrenderer: Path, *, image: str | None = None, version: str | None = None,
          progress: Callable[[int, int, str], None] | None = None) -> tuple[Bundle, bool]:
    """Build the host backend and ggml-metal from the pinned llama.cpp source into a bundle.

    The API-remoting virglrenderer is not released upstream yet, so the user names one.
    """
    if not host.os_is_macos():
        raise ApirctlError("install --build makes a macOS bundle (ggml-metal): run it on a Mac",
                           hint="on Linux, remoting needs no bundle: `apirctl machine restart --remoting`")
    if not virglrenderer.is_file():
        raise ApirctlError(f"--virglrenderer {virglrenderer}: no such file",
                           hint="pass the libvirglrenderer.1.dylib of a virglrenderer built with APIR")
    options = llamacpp.host_options("metal")  # the same build as `apirctl setup`'s: cached once
    if not options.virtgpu_backend:
        options = options.model_copy(update={"virtgpu_backend": True})
    built = llamacpp.build(options, progress=progress)
    base = ensure(root())
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=base))
    try:
        tree = work / "tree"
        (tree / "bin").mkdir(parents=True)
        for lib in built.shared_libraries():
            shutil.copy2(lib, tree / "bin" / lib.name, follow_symlinks=True)
        shutil.copy2(virglrenderer, tree / "bin" / "libvirglrenderer.1.dylib", follow_symlinks=True)
        key = built.options.key() if built.options else "local"
        chosen = version or f"b{llamacpp.LLAMA_BUILD_NUMBER}-apirctl-{key}"
        return _stage(tree, work, f"build:{built.root}", chosen, image)
    finally:
        shutil.rmtree(work, ignore_errors=True)
