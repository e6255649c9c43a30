"""ccache for the native builds: a rebuild after a patch change compiles only the files it touches.

When `ccache` is on PATH, every CMake build apirctl makes gets it as the compiler launcher, with the
cache in apirctl's cache directory (`ccache/`, capped at `MAX_SIZE`) unless the user has chosen one
(`CCACHE_DIR`). Hits survive a change of tree: each build compiles the patched source through a link
`<build root>/llama.cpp` next to its binary directory `<build root>/cmake`, and ccache rewrites the
paths under `base_dir` relative to the binary directory, so two builds (another patch digest, another
option set) see the same relative paths, and `hash_dir` off keeps the directory's name out of the
hash. None of this is part of a build's key: the launcher does not change what is compiled.
Set `APIRCTL_CCACHE=0` to build without it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: The size cap of apirctl's own compiler cache (ccache evicts the oldest files past it).
MAX_SIZE = "5G"
#: The name of the link to the source tree in each build root.
SOURCE_LINK = "llama.cpp"


def enabled() -> bool:
    return os.environ.get("APIRCTL_CCACHE", "1") != "0" and shutil.which("ccache") is not None


def cache_dir(cache_root: Path) -> Path:
    """Where compiled objects are kept: the user's `CCACHE_DIR`, else `ccache/` under `cache_root`."""
    chosen = os.environ.get("CCACHE_DIR")
    return Path(chosen) if chosen else cache_root / "ccache"


def environment(cache_root: Path, base_dir: Path) -> dict[str, str]:
    """The variables ccache reads, for builds whose trees all lie under `base_dir` (empty: no ccache)."""
    if not enabled():
        return {}
    env = {"CCACHE_DIR": str(cache_dir(cache_root)), "CCACHE_BASEDIR": str(base_dir.resolve()),
           "CCACHE_NOHASHDIR": "1"}
    if "CCACHE_DIR" not in os.environ:  # a cache of the user's own keeps the user's size setting
        env["CCACHE_MAXSIZE"] = MAX_SIZE
    return env


def cmake_args(languages: tuple[str, ...] = ("C", "CXX")) -> list[str]:
    """CMake's compiler launchers for `languages` (empty: no ccache)."""
    if not enabled():
        return []
    return [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in languages]


def compiler(command: list[str]) -> list[str]:
    """A compile command (`-c`) run through ccache where it is on."""
    return ["ccache", *command] if enabled() else command


def link_source(tree: Path, build_root: Path) -> Path:
    """`build_root/llama.cpp`, a link to `tree`: what a build configures from, so that its paths relative
    to `build_root/cmake` are those of every other build (ccache hits across trees)."""
    link = build_root / SOURCE_LINK
    if link.is_symlink() and link.resolve() == tree.resolve():
        return link
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(tree.resolve(), target_is_directory=True)
    return link
