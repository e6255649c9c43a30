"""The offline inference image: rendered templates, staged root filesystem, and a real container run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from apirctl import host
from apirctl.build import image, llamacpp
from apirctl.errors import ApirctlError


def test_macos_remoting_template_renders_with_its_arguments() -> None:
    text = image.render_macos_remoting(base_image="registry.example/fedora:42", jobs=7)
    assert text.splitlines()[[i for i, line in enumerate(text.splitlines()) if line.startswith("FROM")][0]] == \
        "FROM registry.example/fedora:42"
    assert "-DGGML_VIRTGPU=ON" in text and "-DGGML_VIRTGPU_BACKEND=OFF" in text
    assert f"{llamacpp.SOURCE_DIST}=={llamacpp.SOURCE_VERSION}" in text
    assert "-j 7" in text
    assert "${" not in text and "$PATH" in text  # placeholders filled, the literal $PATH kept


def test_missing_template_value_is_an_error() -> None:
    with pytest.raises(ApirctlError, match="needs a value for"):
        image.render("Containerfile.llama-server", source_version="b1")


@pytest.mark.integration
def test_rootfs_holds_binaries_and_exactly_their_libraries(container_build: llamacpp.Build, tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    placed = image.stage_rootfs(container_build, rootfs)
    names = {p.name for p in (rootfs / "app" / "bin").iterdir()}
    assert {"llama-server", "llama-bench", "llama-perplexity", "libggml-cpu.so", "libggml-rpc.so"} <= names
    assert not any(n.startswith(image.EXCLUDED_LIBRARIES) for n in names)
    if container_build.options is not None and container_build.options.virtgpu_frontend:
        assert "libggml-virtgpu.so" in names and "apir-host" not in names  # API remoting's frontend, not its host
    # Every system library ldd resolves for what we placed is in the root filesystem where the host has
    # it, and linked from /app/bin (the image's LD_LIBRARY_PATH) when the loader does not search there
    for lib in image.system_libraries(placed):
        assert (rootfs / lib.relative_to("/")).exists(), lib
        if str(lib.parent) not in host.loader_search_dirs() and not lib.name.startswith("ld-linux"):
            assert (rootfs / "app" / "bin" / lib.name).is_symlink(), lib


@pytest.mark.integration
def test_image_runs_llama_server_version(llama_image: str, container_build: llamacpp.Build) -> None:
    from apirctl.podman import engine

    assert llama_image == image.tag_for(container_build)
    proc = subprocess.run([engine.podman_binary(), "run", "--rm", "--network", "none", llama_image, "--version"],
                          capture_output=True, text=True, env=engine.podman_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"build {llamacpp.LLAMA_BUILD_NUMBER}" in proc.stdout + proc.stderr
    labels = subprocess.run([engine.podman_binary(), "image", "inspect", "--format",
                             "{{index .Labels \"apirctl.llama-cpp.backend\"}}", llama_image],
                            capture_output=True, text=True, env=engine.podman_env())
    assert labels.stdout.strip() == container_build.backend


@pytest.mark.integration
def test_an_image_from_another_build_is_rebuilt(llama_image: str, container_build: llamacpp.Build,
                                                tmp_path: Path) -> None:
    """Same tag, other binaries: ensure() must notice (by the build-id label) and rebuild."""
    other = container_build.model_copy(update={"external": True, "options": None})
    assert other.identity != container_build.identity
    stale = image.build_image(other, "localhost/apirctl/llama-server:stale-test")
    try:
        assert image.built_from(stale) == other.identity
        assert not image.is_current(container_build, stale)
    finally:
        from apirctl.podman import engine

        subprocess.run([engine.podman_binary(), "rmi", "-f", stale], env=engine.podman_env(), capture_output=True)
    assert image.is_current(container_build, llama_image)
