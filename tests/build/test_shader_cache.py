"""The Vulkan build's shader cache (apirctl.build.shader_cache), with the real glslc, called the way
llama.cpp's vulkan-shaders-gen calls it: a second build tree of the same shaders compiles nothing, and
a changed include compiles again."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from apirctl.build import shader_cache

pytestmark = pytest.mark.skipif(shutil.which("glslc") is None, reason="glslc is needed (system-deps.sh --vulkan)")

SHADER = """#version 450
#include "types.glsl"
layout(local_size_x = 64) in;
layout(binding = 0) buffer A { VALUE a[]; };
void main() { a[gl_GlobalInvocationID.x] *= SCALE; }
"""


def _tree(root: Path, scale: str = "2.0") -> Path:
    shaders = root / "vulkan-shaders"
    shaders.mkdir(parents=True)
    (shaders / "scale.comp").write_text(SHADER)
    (shaders / "types.glsl").write_text(f"#define VALUE float\n#define SCALE {scale}\n")
    return shaders


def _compile(wrapper: Path, shaders: Path, out_dir: Path, log: Path) -> tuple[bytes, str]:
    """One variant, as vulkan-shaders-gen asks for it: SPIR-V into a file, a dependency file beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spv, dep = out_dir / "scale_f32.spv", out_dir / "scale.comp.cpp.d"
    done = subprocess.run([str(wrapper), "-fshader-stage=compute", "--target-env=vulkan1.2",
                           str(shaders / "scale.comp"), "-o", str(spv), "-O", "-MD", "-MF", str(dep), "-DA_TYPE=float"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "APIRCTL_GLSLC_CACHE_LOG": str(log)})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return spv.read_bytes(), dep.read_text()


def test_a_second_tree_of_the_same_shaders_compiles_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APIRCTL_CCACHE", raising=False)
    cache, log = tmp_path / "cache", tmp_path / "glslc.log"
    runs = []
    for name in ("one", "two"):
        shaders = _tree(tmp_path / name / "src")
        args = shader_cache.cmake_args(shaders, tmp_path / name, cache)
        wrapper = tmp_path / name / shader_cache.WRAPPER
        assert args == [f"-DVulkan_GLSLC_EXECUTABLE={wrapper}"]
        runs.append((shaders, *_compile(wrapper, shaders, tmp_path / name / "spv", log)))
    assert log.read_text().split() == ["miss", "scale_f32.spv", "hit", "scale_f32.spv"]
    (first, spv1, dep1), (second, spv2, dep2) = runs
    assert spv1 == spv2 and spv1[:4] == b"\x03\x02\x23\x07"  # SPIR-V's magic number, little-endian
    # the dependency file names the second tree's files, not the first's: its build tracks its own sources
    assert str(second / "types.glsl") in dep2 and str(tmp_path / "two" / "spv" / "scale_f32.spv") in dep2
    assert str(tmp_path / "one") not in dep2 and str(first / "types.glsl") in dep1


def test_a_changed_include_compiles_again_and_a_feature_test_runs_glslc(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "glslc.log"
    outputs = []
    for name, scale in (("one", "2.0"), ("two", "3.0")):
        shaders = _tree(tmp_path / name / "src", scale)
        shader_cache.cmake_args(shaders, tmp_path / name, cache)
        outputs.append(_compile(tmp_path / name / shader_cache.WRAPPER, shaders, tmp_path / name / "spv", log)[0])
    assert log.read_text().split()[::2] == ["miss", "miss"] and outputs[0] != outputs[1]
    # CMake's configure asks glslc whether it knows an extension, on stdout: passed through, not cached
    probe = subprocess.run([str(tmp_path / "two" / shader_cache.WRAPPER), "-o", "-", "-fshader-stage=compute",
                            str(tmp_path / "two" / "src" / "vulkan-shaders" / "scale.comp")],
                           capture_output=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout[:4] == b"\x03\x02\x23\x07"
    assert len(log.read_text().split()) == 4


def test_off_with_the_compiler_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_CCACHE", "0")
    assert shader_cache.cmake_args(_tree(tmp_path), tmp_path, tmp_path / "cache") == []
