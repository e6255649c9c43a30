"""The `native_cpu` setting: a build for this host's CPU (the default) or for any x86-64 CPU with AVX2.

A build for this CPU uses AVX-512 where the host has it, and QEMU's emulation has none: an image of it
dies of an illegal instruction in an emulated VM. The setting reaches every build's options, and so
their cache keys, because every later lookup must find the build that `apirctl setup` made.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from apirctl.build import llamacpp

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_default_is_this_cpu_and_changes_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APIRCTL_NATIVE_CPU", raising=False)
    host = llamacpp.host_options("cpu")
    assert host.native and "-DGGML_NATIVE=ON" in host.cmake_args()
    assert not any(arg.startswith("-DGGML_AVX") for arg in host.cmake_args())
    assert host.key() == llamacpp.BuildOptions(backend="cpu", virtgpu_backend=True,
                                               virtgpu_frontend=host.virtgpu_frontend).key()


def test_false_reaches_the_host_image_and_vulkan_builds_and_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    native = [llamacpp.host_options("cpu"), llamacpp.container_options(), llamacpp.vulkan_options()]
    monkeypatch.setenv("APIRCTL_NATIVE_CPU", "false")
    portable = [llamacpp.host_options("cpu"), llamacpp.container_options(), llamacpp.vulkan_options()]
    for before, after in zip(native, portable, strict=True):
        assert not after.native and "-DGGML_NATIVE=OFF" in after.cmake_args()
        assert after.key() != before.key()


@pytest.mark.skipif(not X86, reason="the instruction sets named are x86-64's")
def test_a_portable_x86_build_names_avx2_and_leaves_out_avx512() -> None:
    args = llamacpp.BuildOptions(backend="cpu", native=False).cmake_args()
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"} <= set(args)
    assert "-DGGML_AVX512=ON" not in args


def test_each_build_has_its_own_image_tag_also_when_named_by_path(tmp_path: Path) -> None:
    """A build for any AVX2 CPU tags its image apart; APIRCTL_LLAMA_BUILD naming one of apirctl's cache
    entries keeps what it was built with, so its image is not taken for the native build's."""
    from apirctl.build import image

    tags = {}
    for native in (True, False):
        options = llamacpp.BuildOptions(backend="cpu", native=native)
        root = tmp_path / options.key()
        (root / "cmake" / "bin").mkdir(parents=True)
        (root / "cmake" / "bin" / "llama-server").write_text("")
        build = llamacpp.Build(root=root, bin_dir=root / "cmake" / "bin", backend="cpu", source_version="b1",
                               options=options)
        (root / "build.json").write_text(build.model_dump_json())
        named = llamacpp.external_build(root)
        assert named.external and named.options == options
        tags[native] = image.tag_for(named)
    assert tags[False] != tags[True] and "-portable-" in tags[False] and "-portable" not in tags[True]
