"""ccache for the native builds (apirctl.build.ccache), and the suite's reuse of a finished build of
another cache directory (llamacpp.copy_in): with a real CMake, a real compiler and a real ccache."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from apirctl.build import ccache, llamacpp

needs_tools = pytest.mark.skipif(not (shutil.which("ccache") and shutil.which("cmake") and shutil.which("cc")),
                                 reason="ccache, cmake and a C compiler are needed")


def test_the_launcher_is_on_only_with_ccache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no ccache on it
    assert ccache.cmake_args() == [] and ccache.environment(tmp_path, tmp_path) == {}
    assert ccache.compiler(["cc", "-c", "x.c"]) == ["cc", "-c", "x.c"]
    (tmp_path / "ccache").write_text("#!/bin/sh\n")
    (tmp_path / "ccache").chmod(0o755)
    assert ccache.cmake_args(("C", "CUDA")) == ["-DCMAKE_C_COMPILER_LAUNCHER=ccache",
                                               "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
    monkeypatch.setenv("APIRCTL_CCACHE", "0")
    assert ccache.cmake_args() == []


def test_the_cache_is_apirctls_unless_the_user_chose_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if not ccache.enabled():
        pytest.skip("no ccache")
    monkeypatch.delenv("CCACHE_DIR", raising=False)
    env = ccache.environment(tmp_path / "cache", tmp_path)
    assert env["CCACHE_DIR"] == str(tmp_path / "cache" / "ccache") and env["CCACHE_MAXSIZE"] == ccache.MAX_SIZE
    assert env["CCACHE_BASEDIR"] == str(tmp_path.resolve()) and env["CCACHE_NOHASHDIR"] == "1"
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "theirs"))
    env = ccache.environment(tmp_path / "cache", tmp_path)
    assert env["CCACHE_DIR"] == str(tmp_path / "theirs") and "CCACHE_MAXSIZE" not in env


def test_the_launcher_is_not_part_of_the_build_key() -> None:
    options = llamacpp.host_options("cpu")
    assert not any("LAUNCHER" in arg or "ccache" in arg for arg in options.cmake_args())


def _tree(root: Path, value: int) -> Path:
    """A small CMake project: one library of two files, one of which differs with `value`."""
    root.mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(t C)\n"
                                         "add_library(t SHARED same.c changed.c)\n"
                                         "target_include_directories(t PRIVATE include)\n")
    (root / "include").mkdir()
    (root / "include" / "t.h").write_text("int same(void);\nint changed(void);\n")
    (root / "same.c").write_text('#include "t.h"\nint same(void) { return 42; }\n')
    (root / "changed.c").write_text(f'#include "t.h"\nint changed(void) {{ return {value}; }}\n')
    return root


def _build(tree: Path, build_root: Path, cache: Path, base: Path) -> dict[str, int]:
    """Configure and build `tree` as apirctl does (through the link, with the launcher); ccache's counts."""
    build_root.mkdir(parents=True)
    source = ccache.link_source(tree, build_root)
    env = {**os.environ, **ccache.environment(cache, base)}
    env.pop("CMAKE_C_COMPILER_LAUNCHER", None)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (["cmake", "-S", str(source), "-B", str(build_root / "cmake"), *generator, *ccache.cmake_args()],
                ["cmake", "--build", str(build_root / "cmake")]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    stats = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True, env=env, check=True).stdout
    counts = dict(line.split("\t") for line in stats.splitlines() if "\t" in line)
    return {"hits": int(counts["direct_cache_hit"]) + int(counts["preprocessed_cache_hit"]),
            "misses": int(counts["cache_miss"])}


@needs_tools
def test_another_tree_with_one_changed_file_compiles_only_that_file(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trees at different paths (another patch digest), built in different build roots (another
    key): the second compiles only the file that differs; the other one is a ccache hit."""
    monkeypatch.delenv("CCACHE_DIR", raising=False)
    cache = tmp_path / "cache"
    first = _build(_tree(tmp_path / "src" / "digest-a" / "llama.cpp", 1), tmp_path / "builds" / "key-a", cache,
                   tmp_path)
    assert first == {"hits": 0, "misses": 2}
    second = _build(_tree(tmp_path / "src" / "digest-b" / "llama.cpp", 2), tmp_path / "builds" / "key-b", cache,
                    tmp_path)
    assert second == {"hits": 1, "misses": 3}  # same.c came from the cache; changed.c was compiled


def _finished_build(cache: Path, options: llamacpp.BuildOptions) -> llamacpp.Build:
    """A finished build in `cache` as `build` leaves one: the programs, libraries and the manifest last."""
    root = cache / "llama.cpp" / "builds" / options.key()
    bin_dir = root / "cmake" / "bin"
    bin_dir.mkdir(parents=True)
    for exe in options.executables():
        (bin_dir / exe).write_text(f"#!/bin/sh\necho {exe}\n")
    (bin_dir / "libggml.so.0.1").write_text("lib")
    (bin_dir / "libggml.so").symlink_to("libggml.so.0.1")
    build = llamacpp.Build(root=root, bin_dir=bin_dir, backend=options.backend, source_version="b1",
                           options=options)
    (root / "build.json").write_text(build.model_dump_json())
    return build


def test_a_build_of_another_cache_is_copied_in_and_that_cache_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = llamacpp.host_options("cpu")
    theirs = tmp_path / "user-cache"
    _finished_build(theirs, options)
    before = sorted((p.relative_to(theirs), p.lstat().st_mtime_ns) for p in theirs.rglob("*"))
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(tmp_path / "test-cache"))
    assert llamacpp.find(options) is None
    found = llamacpp.find(options, cache=theirs)
    assert found is not None
    copied = llamacpp.copy_in(found)
    assert copied.root == tmp_path / "test-cache" / "llama.cpp" / "builds" / options.key()
    assert llamacpp.find(options) == copied and copied.options == options
    assert (copied.bin_dir / "libggml.so").is_symlink() and (copied.bin_dir / "llama-server").exists()
    assert sorted((p.relative_to(theirs), p.lstat().st_mtime_ns) for p in theirs.rglob("*")) == before
    assert llamacpp.copy_in(found) == copied  # a second time: the copy is found, nothing is copied


@needs_tools
def test_the_suites_builds_go_through_ccache_and_are_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/support/native_builds.cmake_build, as the suite's fixtures call it: a second build root
    of the same tree compiles nothing, and both builds are logged with their time."""
    from tests.support import native_builds

    monkeypatch.setattr(native_builds, "SHARED_CACHE", tmp_path)  # the suite's builds lie under its cache
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "ccache"))  # this test's counts only
    monkeypatch.delenv("CMAKE_C_COMPILER_LAUNCHER", raising=False)
    tree = _tree(tmp_path / "src" / "llama.cpp", 1)
    before = len(native_builds.TIMES)
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        bin_dir = native_builds.cmake_build(tree, tmp_path / name, [], ("t",), f"toy {name}")
        assert any(bin_dir.rglob("libt.so"))
    stats = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True, check=True,
                           env={**os.environ, "CCACHE_DIR": str(tmp_path / "ccache")}).stdout
    counts = dict(line.split("\t") for line in stats.splitlines() if "\t" in line)
    assert int(counts["cache_miss"]) == 2 and int(counts["direct_cache_hit"]) == 2
    assert [what for what, _, how in native_builds.TIMES[before:]] == ["toy one", "toy two"]
