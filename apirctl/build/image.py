"""The local inference image: llama.cpp binaries in an image `FROM scratch`, built offline.

No registry is needed: the image holds the container build's executables and shared
libraries under `/app/bin`, plus exactly the system libraries they load (found with
`ldd`) at the paths the dynamic loader expects. Templates live in `templates/` and
are rendered with `string.Template` (`$$` escapes a literal `$`).

The CPU image (remoting and plain containers) carries no GPU backend. A GPU image (for
passthrough: `apirctl.gpu`) is made from a CUDA or Vulkan build and keeps that backend:
- CUDA: `libggml-cuda` and the CUDA runtime libraries it loads (cudart, cuBLAS), but not the
  driver's (`libcuda.so.1`, `libnvidia-*`): those must match the host's kernel module, and the
  NVIDIA CDI spec mounts them from the host.
- Vulkan: `libggml-vulkan`, the Vulkan loader, and the host's Mesa Vulkan drivers (the ICD
  manifests and their libraries: RADV, ANV, lavapipe), which a `/dev/dri` render node needs in
  user space; NVIDIA's Vulkan driver comes from its CDI spec like its CUDA driver.

Every image also carries the container's health check, `/app/bin/apirctl-health` (a small static
program built here from `templates/apirctl-health.c`: the image has no HTTP client), the door of a
router server, `/app/bin/apirctl-front` (`templates/apirctl-front.c`: it gives a request that names no
model the server's default model, which llama-server's router refuses), and the host's
`/bin/sh`, which `podman kube play` needs to run a Kubernetes probe (it wraps the probe's command in
`sh -c`). The image's tag ends with a digest of what goes into it besides the build (`recipe`), so an
image of an older recipe is never taken for the current one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from string import Template

from apirctl import host
from apirctl.build.llamacpp import IMAGE_ONLY_EXECUTABLES, SOURCE_DIST, SOURCE_VERSION, Build
from apirctl.errors import ApirctlError, tail
from apirctl.paths import package_data
from apirctl.podman import engine

IMAGE_REPO = "localhost/apirctl/llama-server"
IMAGE_EXECUTABLES = IMAGE_ONLY_EXECUTABLES
#: Backend modules the CPU image must not carry: remoting brings the GPU.
EXCLUDED_LIBRARIES = ("libggml-cuda", "libggml-metal", "libggml-vulkan", "libggml-virtgpu-backend")
#: Driver libraries no image carries: they come from the host (CDI), matching its kernel driver.
DRIVER_LIBRARIES = ("libcuda.so", "libnvidia-", "libnvcuvid", "libGLX_nvidia")
#: Where Vulkan drivers announce themselves (ICD manifests: JSON naming the driver library).
ICD_DIRS = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"))

_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)")


#: The container's health check (`templates/apirctl-health.c`), and what Podman runs: the server's
#: port inside the container is always 8000 (`CONTAINER_PORT` of apirctl.serve).
HEALTH_CHECK = "/app/bin/apirctl-health"
HEALTH_SOURCE = "apirctl-health.c"
#: A router server's entry point (`templates/apirctl-front.c`): it runs llama-server's router on
#: FRONT_UPSTREAM_PORT and passes requests on from the container's port, a default model added where a
#: request names none.
FRONT = "/app/bin/apirctl-front"
FRONT_SOURCE = "apirctl-front.c"
#: Compiler flags of the health check: warnings on, one static file that needs nothing from the image.
HEALTH_CFLAGS = ("-std=c11", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow")
#: A shell for `podman kube play`'s probes (`sh -c 'CHECK || exit 1'`); copied from the host.
SHELL = Path("/bin/sh")
#: Bump when stage_rootfs lays out the image differently (the tag changes with it).
LAYOUT = "5: health check, router front, /bin/sh, llama-perplexity, libraries outside the loader's folders linked " \
         "from /app/bin"


def recipe() -> str:
    """A digest of what makes an image besides the llama.cpp build: the layout, the Containerfile
    and the health check's source. It ends the tag, so serve's check for the tag finds no image of
    an older recipe (one without a health check) and builds the current one."""
    digest = hashlib.sha256(LAYOUT.encode())
    for name in ("Containerfile.llama-server", HEALTH_SOURCE, FRONT_SOURCE):
        digest.update(package_data("templates", name).read_bytes())
    return digest.hexdigest()[:8]


def tag_for(build: Build) -> str:
    """The image's tag; a build for any AVX2 CPU (`native_cpu` false) has its own, so that both images
    can be kept and neither replaces the other under a server that runs it."""
    portable = "-portable" if build.options is not None and not build.options.native else ""
    return f"{IMAGE_REPO}:{build.source_version}-{build.backend}{portable}-{recipe()}"


def compile_health_check(dest: Path, extra_flags: tuple[str, ...] = (), source_name: str = HEALTH_SOURCE) -> Path:
    """Build `apirctl-health` (or another of the image's small programs, `source_name`: the router's
    front) with the host's C compiler (the one llama.cpp was built with), static so it runs in any
    image; a host without a static C library gets a dynamic one (the image carries the C library
    llama-server loads, and `stage_rootfs` adds what it needs)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise ApirctlError("no C compiler to build the container's health check",
                           hint="install gcc or clang (llama.cpp's build needs one too)")
    source = package_data("templates", source_name)
    base = [compiler, *HEALTH_CFLAGS, *extra_flags, "-o", str(dest), str(source)]
    links: tuple[list[str], ...] = ([],) if extra_flags else (["-static", "-s"], [])  # sanitizers: dynamic
    for link in links:
        proc = subprocess.run([*base, *link], capture_output=True, text=True)
        if proc.returncode == 0:
            return dest
    program = Path(source_name).stem
    raise ApirctlError(f"the container's {program} did not compile:\n{tail(proc.stderr or proc.stdout, 8)}")


def render(template: str, **values: object) -> str:
    """Render a template from `templates/`; a missing value is an error, not an empty string."""
    path = package_data("templates", template)
    try:
        return Template(path.read_text()).substitute({k: str(v) for k, v in values.items()})
    except KeyError as exc:
        raise ApirctlError(f"template {template} needs a value for {exc.args[0]}") from None


def render_macos_remoting(base_image: str = "quay.io/fedora/fedora:42", jobs: int = 4) -> str:
    """The Containerfile of the macOS remoting image (built where a registry is reachable)."""
    return render("Containerfile.remoting-macos", base_image=base_image, source_dist=SOURCE_DIST,
                  source_pin=SOURCE_VERSION, build_number=SOURCE_VERSION.split(".")[0], jobs=jobs)


def excluded_libraries(backend: str) -> tuple[str, ...]:
    """The llama.cpp backend modules an image of this backend leaves out (it keeps its own)."""
    return tuple(name for name in EXCLUDED_LIBRARIES if name != f"libggml-{backend}")


def _is_driver(name: str) -> bool:
    return name.startswith(DRIVER_LIBRARIES)


def system_libraries(elf_files: list[Path], own_dir: bool = False) -> set[Path]:
    """Every library the loader resolves for these files, outside their own directory (`own_dir`:
    also inside it, for system files), except the GPU driver's (the host provides it through CDI;
    a host without the driver may lack it)."""
    found: set[Path] = set()
    for elf in elf_files:
        proc = subprocess.run(["ldd", str(elf)], capture_output=True, text=True)
        if "not a dynamic executable" in proc.stdout + proc.stderr:  # static: it loads nothing
            continue
        if proc.returncode != 0:
            raise ApirctlError(f"ldd {elf} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        for line in proc.stdout.splitlines():
            if _is_driver(line.strip()):
                continue
            if "not found" in line:
                raise ApirctlError(f"{elf.name} needs a library that is not installed: {line.strip()}")
            m = _LDD_LINE.match(line)
            if m:
                lib = Path(m.group(1))
                if own_dir or lib.parent != elf.parent:
                    found.add(lib)
    return found


def vulkan_drivers(icd_dirs: tuple[Path, ...] = ICD_DIRS) -> list[tuple[Path, Path]]:
    """(manifest, driver library) of each Vulkan driver installed here whose library exists."""
    found: list[tuple[Path, Path]] = []
    for folder in icd_dirs:
        for manifest in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                library = Path(json.loads(manifest.read_text())["ICD"]["library_path"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if library.is_absolute() and library.exists() and not _is_driver(library.name):
                found.append((manifest, library))
    return found


def _copy_into(rootfs: Path, path: Path) -> None:
    """Copy `path` to the same absolute path inside `rootfs`, following links to the real file."""
    dest = rootfs / path.relative_to("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path.resolve(), dest)


def stage_rootfs(build: Build, rootfs: Path) -> list[Path]:
    """Lay out the image's root filesystem; returns the files of /app/bin."""
    app_bin = rootfs / "app" / "bin"
    app_bin.mkdir(parents=True)
    placed: list[Path] = []
    for exe in IMAGE_EXECUTABLES:
        shutil.copy2(build.binary(exe), app_bin / exe)
        placed.append(app_bin / exe)
    placed.append(compile_health_check(rootfs / HEALTH_CHECK.lstrip("/")))
    placed.append(compile_health_check(rootfs / FRONT.lstrip("/"), source_name=FRONT_SOURCE))
    excluded = excluded_libraries(build.backend)
    for lib in build.shared_libraries():
        if lib.name.startswith(excluded):
            continue
        target = app_bin / lib.name
        if lib.is_symlink():
            target.symlink_to(lib.readlink())
        else:
            shutil.copy2(lib, target)
            placed.append(target)
    needed = system_libraries(placed)
    _copy_into(rootfs, SHELL)
    needed |= system_libraries([SHELL], own_dir=True)
    at_their_path: set[Path] = set()  # named by absolute path elsewhere (a Vulkan manifest)
    if build.backend == "vulkan":
        drivers = vulkan_drivers()
        for manifest, library in drivers:
            _copy_into(rootfs, manifest)
            at_their_path.add(library)
        needed |= system_libraries([library for _, library in drivers], own_dir=True)
    for lib in sorted(needed | at_their_path):
        _copy_into(rootfs, lib)
        if lib not in at_their_path and str(lib.parent) not in host.loader_search_dirs() and \
                not (app_bin / lib.name).exists():
            # found here through this host's loader cache or LD_LIBRARY_PATH (CUDA's runtime under
            # /usr/local/cuda): the image has neither, but /app/bin is on its LD_LIBRARY_PATH (the
            # loader itself, which the kernel finds by its path, is where it was)
            (app_bin / lib.name).symlink_to(lib)
    (rootfs / "tmp").mkdir(exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    # llama-server resolves its own user and the local host name; keep both lookups quiet.
    etc = rootfs / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/tmp:/app/bin/llama-server\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    return placed


BUILD_LABEL = "apirctl.llama-cpp.build-id"


def exists(tag: str) -> bool:
    proc = subprocess.run([engine.podman_binary(), "image", "exists", tag], env=engine.podman_env(),
                          capture_output=True)
    return proc.returncode == 0


def built_from(tag: str) -> str | None:
    """The build id an image of ours was made from (None when the image or its label is missing)."""
    proc = subprocess.run([engine.podman_binary(), "image", "inspect", "--format",
                           f'{{{{index .Labels "{BUILD_LABEL}"}}}}', tag],
                          env=engine.podman_env(), capture_output=True, text=True)
    value = proc.stdout.strip()
    return value if proc.returncode == 0 and value and value != "<no value>" else None


def is_current(build: Build, tag: str | None = None) -> bool:
    """Is the image for `build` there and made from this very build (not an older one)?"""
    return built_from(tag or tag_for(build)) == build.identity


def build_image(build: Build, tag: str | None = None) -> str:
    """Build the image from the container build; returns its tag."""
    tag = tag or tag_for(build)
    with tempfile.TemporaryDirectory(prefix="apirctl-image-") as tmp:
        context = Path(tmp)
        stage_rootfs(build, context / "rootfs")
        options = build.options.model_dump_json() if build.options else "external"
        (context / "Containerfile").write_text(render(
            "Containerfile.llama-server", source_version=build.source_version, backend=build.backend,
            options=options.replace('"', "'"), build_id=build.identity))
        proc = subprocess.run([engine.podman_binary(), "build", "--quiet", "-t", tag, "-f",
                                str(context / "Containerfile"), str(context)],
                              env=engine.podman_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise ApirctlError(f"podman build of {tag} failed:\n{tail(proc.stderr or proc.stdout, 8)}")
    return tag


def ensure(build: Build, rebuild: bool = False) -> str:
    """The image for `build`, built if it is missing (or `rebuild`)."""
    tag = tag_for(build)
    if rebuild or not is_current(build, tag):
        build_image(build, tag)
    return tag
