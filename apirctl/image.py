"""The local inference image: llama.cpp binaries in an image `FROM scratch`, built offline.

No registry is needed: the image holds the container build's executables and shared
libraries under `/app/bin`, plus exactly the system libraries they load (found with
`ldd`) at the paths the dynamic loader expects. Templates live in `templates/` and
are rendered with `string.Template` (`$$` escapes a literal `$`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from string import Template

from apirctl.errors import ApirctlError
from apirctl.llamacpp import SOURCE_DIST, SOURCE_VERSION, Build
from apirctl.paths import package_data

IMAGE_REPO = "localhost/apirctl/llama-server"
IMAGE_EXECUTABLES = ("llama-server", "llama-bench")
#: Backend modules the container must not carry: remoting brings the GPU.
EXCLUDED_LIBRARIES = ("libggml-cuda", "libggml-metal", "libggml-vulkan", "libggml-virtgpu-backend")

_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)")


def tag_for(build: Build) -> str:
    return f"{IMAGE_REPO}:{build.source_version}-{build.backend}"


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


def system_libraries(elf_files: list[Path]) -> set[Path]:
    """Every library the loader resolves for these files, outside their own directory."""
    found: set[Path] = set()
    for elf in elf_files:
        proc = subprocess.run(["ldd", str(elf)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ApirctlError(f"ldd {elf} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        for line in proc.stdout.splitlines():
            if "not found" in line:
                raise ApirctlError(f"{elf.name} needs a library that is not installed: {line.strip()}")
            m = _LDD_LINE.match(line)
            if m:
                lib = Path(m.group(1))
                if lib.parent != elf.parent:
                    found.add(lib)
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
    for lib in build.shared_libraries():
        if lib.name.startswith(EXCLUDED_LIBRARIES):
            continue
        target = app_bin / lib.name
        if lib.is_symlink():
            target.symlink_to(lib.readlink())
        else:
            shutil.copy2(lib, target)
            placed.append(target)
    for lib in sorted(system_libraries(placed)):
        _copy_into(rootfs, lib)
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
    from apirctl import engine

    proc = subprocess.run([engine.podman_binary(), "image", "exists", tag], env=engine.podman_env(),
                          capture_output=True)
    return proc.returncode == 0


def built_from(tag: str) -> str | None:
    """The build id an image of ours was made from (None when the image or its label is missing)."""
    from apirctl import engine

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
    from apirctl import engine

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
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise ApirctlError(f"podman build of {tag} failed:\n{tail}")
    return tag


def ensure(build: Build, rebuild: bool = False) -> str:
    """The image for `build`, built if it is missing (or `rebuild`)."""
    tag = tag_for(build)
    if rebuild or not is_current(build, tag):
        build_image(build, tag)
    return tag
