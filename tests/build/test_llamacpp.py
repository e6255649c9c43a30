"""The pinned llama.cpp build: cache keyed by (source digest, options), second run a no-op."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl import host as platform
from apirctl.build import llamacpp
from apirctl.errors import ApirctlError


def test_cache_key_changes_with_options() -> None:
    cpu = llamacpp.BuildOptions(backend="cpu")
    assert cpu.key() == llamacpp.BuildOptions(backend="cpu").key()
    assert cpu.key() != llamacpp.BuildOptions(backend="cuda").key()
    assert cpu.key() != llamacpp.BuildOptions(backend="cpu", virtgpu_backend=False).key()


def test_cmake_args_follow_the_backend() -> None:
    cuda = llamacpp.BuildOptions(backend="cuda", cuda_architectures="90").cmake_args()
    assert "-DGGML_CUDA=ON" in cuda and "-DCMAKE_CUDA_ARCHITECTURES=90" in cuda
    host = llamacpp.host_options("cpu")
    assert "ggml-virtgpu-backend" in host.targets()
    container = llamacpp.container_options()
    assert "-DGGML_RPC=ON" in container.cmake_args()
    if platform.os_is_linux():
        # API remoting on Linux: the frontend over a Unix socket in both, the host library and apir-host on the host
        assert {"-DGGML_VIRTGPU=ON", "-DGGML_VIRTGPU_BACKEND=ON", "-DGGML_VIRTGPU_TRANSPORT=socket"} <= \
            set(host.cmake_args())
        assert "apir-host" in host.targets() and "apir-host" in host.executables()
        assert {"-DGGML_VIRTGPU=ON", "-DGGML_VIRTGPU_BACKEND=OFF", "-DGGML_VIRTGPU_TRANSPORT=socket"} <= \
            set(container.cmake_args())
        assert "ggml-virtgpu" in container.targets() and "apir-host" not in container.targets()
    else:
        assert "-DGGML_VIRTGPU_BACKEND=ONLY" in host.cmake_args()
        assert not any("VIRTGPU" in a for a in container.cmake_args())
    # the macOS-style host library alone (no frontend) still builds with ONLY, and never apir-host
    only = llamacpp.BuildOptions(backend="metal", virtgpu_frontend=False)
    assert "-DGGML_VIRTGPU_BACKEND=ONLY" in only.cmake_args() and "apir-host" not in only.targets()
    vulkan = llamacpp.vulkan_options()
    assert not any("VIRTGPU" in a for a in vulkan.cmake_args())


def test_directory_without_manifest_is_not_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(tmp_path / "cache"))
    root = llamacpp.dirs().builds / "builds" / "feedface"
    (root / "cmake" / "bin").mkdir(parents=True)
    assert llamacpp._load(root) is None


def test_external_build_must_hold_llama_server(tmp_path: Path) -> None:
    with pytest.raises(ApirctlError, match="no llama-server"):
        llamacpp.external_build(tmp_path)


def test_require_build_says_run_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("APIRCTL_LLAMA_BUILD", raising=False)
    with pytest.raises(ApirctlError) as info:
        llamacpp.require_build()
    assert info.value.exit_code == 3 and "apirctl setup" in (info.value.hint or "")


@pytest.mark.integration
def test_build_has_every_target(llama_build: llamacpp.Build) -> None:
    for exe in llamacpp.EXECUTABLES:
        assert os.access(llama_build.binary(exe), os.X_OK)
    assert llama_build.library("ggml-virtgpu-backend").exists()
    if llama_build.options is not None and llama_build.options.virtgpu_frontend:
        assert llama_build.library("ggml-virtgpu").exists()
        assert os.access(llama_build.binary("apir-host"), os.X_OK)
    out = subprocess.run([str(llama_build.binary("llama-server")), "--version"], capture_output=True, text=True)
    assert llamacpp.LLAMA_BUILD_NUMBER in out.stdout + out.stderr


@pytest.mark.integration
def test_second_setup_is_a_no_op_without_build_tools(llama_build: llamacpp.Build, tmp_path: Path) -> None:
    """With cmake and the compilers off PATH, a second build can only succeed by using the cache."""
    if llama_build.external:
        pytest.skip("APIRCTL_LLAMA_BUILD points at an external build")
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("podman", "ldd"):
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (bare / tool).symlink_to(found)
    manifest = llama_build.root / "build.json"
    before = manifest.stat().st_mtime_ns
    env = {**os.environ, "PATH": str(bare), "APIRCTL_CACHE_DIR": str(llama_build.root.parent.parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "apirctl", "setup", "--no-image", "--no-model", "--json"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert str(llama_build.bin_dir) in proc.stdout
    assert manifest.stat().st_mtime_ns == before
