"""The suite's native builds: timed, through ccache, and reusing what `apirctl setup` built.

Every build a fixture makes goes through `timed`, which logs "built X in N s" (to the test cache's
`build-times.log`, and to the end of pytest's report): CI shows where its time went. Compiler calls
go through ccache (apirctl.build.ccache) with the suite's compiler cache in the test cache. A build
whose key (options and source digest) matches one in the user's own apirctl cache, the one
`scripts/demo.sh`'s `apirctl setup` filled, is copied from there instead of built again; the user's
cache is only read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from apirctl.build import ccache, llamacpp
from apirctl.digest import sha256_file
from apirctl.paths import exclusive
from tests.conftest import SHARED_CACHE, USER_CACHE

#: (what, seconds, how) of each build this session made or reused, in order.
TIMES: list[tuple[str, float, str]] = []


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """One maker at a time of a thing the test cache shares, across processes: pytest-xdist's workers
    and other suites on this machine. Check whether it exists inside the lock, then make it."""
    lock = SHARED_CACHE / "locks" / f"{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock):
        yield


@contextlib.contextmanager
def timed(what: str, how: str = "built") -> Iterator[None]:
    start = time.monotonic()
    yield
    seconds = time.monotonic() - start
    TIMES.append((what, seconds, how))
    line = f"{how} {what} in {seconds:.0f} s"
    SHARED_CACHE.mkdir(parents=True, exist_ok=True)
    with (SHARED_CACHE / "build-times.log").open("a") as log:
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def from_user_cache(options: llamacpp.BuildOptions) -> llamacpp.Build | None:
    """The user's own finished build for `options`, copied into the test cache (None: there is none).

    Call in the shared environment (tests.conftest.shared_env), so the copy lands in the test cache.
    """
    if USER_CACHE is None or USER_CACHE.resolve() == SHARED_CACHE:
        return None
    found = llamacpp.find(options, cache=USER_CACHE)
    if found is None:
        return None
    with timed(f"llama.cpp {options.backend} ({options.key()})", how="copied from the user's cache"):
        _copy_sdist()
        return llamacpp.copy_in(found)


def _copy_sdist() -> None:
    """The pinned source archive the user's cache holds, so the suite's source tree needs no download."""
    assert USER_CACHE is not None
    theirs = USER_CACHE / "llama.cpp" / "downloads" / llamacpp._sdist_name()
    ours = SHARED_CACHE / "llama.cpp" / "downloads" / theirs.name
    if ours.exists() or not theirs.exists() or sha256_file(theirs) != llamacpp.SOURCE_SHA256:
        return
    ours.parent.mkdir(parents=True, exist_ok=True)
    partial = ours.with_name(ours.name + ".partial")
    shutil.copyfile(theirs, partial)
    os.replace(partial, ours)


def host_build(backend: llamacpp.Backend | None = None, what: str = "") -> llamacpp.Build:
    """The host build (of `backend`, default this host's best): the test cache's, else the user's copied
    in, else built (timed, named `what` in the times)."""
    existing = llamacpp.current_build() if backend is None else llamacpp.find(llamacpp.host_options(backend))
    if existing is not None:
        return existing
    options = llamacpp.host_options(backend)
    copied = from_user_cache(options)
    if copied is not None:
        return copied
    with timed(f"llama.cpp {options.backend} host build{what} ({options.key()})"):
        return llamacpp.build(options)


def build_environment() -> dict[str, str]:
    """The environment of a suite build: ccache's variables for trees under the test cache."""
    return {**os.environ, **ccache.environment(SHARED_CACHE, SHARED_CACHE)}


def cmake_build(src: Path, root: Path, args: list[str], targets: tuple[str, ...], what: str,
                jobs: int | None = None, timeout: int = 1800) -> Path:
    """Configure `src` (through the link `root/llama.cpp`) into `root/cmake` with `args` and build
    `targets` through ccache; returns the binary directory. Raises AssertionError with the output's
    tail when a step fails."""
    source = ccache.link_source(src, root)
    build_dir = root / "cmake"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(source), "-B", str(build_dir), *generator, *args, *ccache.cmake_args()]
    compile_ = ["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2), "--target", *targets]
    with timed(what):
        for cmd in (configure, compile_):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=build_environment())
            assert done.returncode == 0, (done.stdout[-3000:] + done.stderr[-3000:])
    return build_dir


def compile_program(compiler: str, flags: list[str], sources: list[Path], out: Path, link_flags: list[str],
                    what: str, timeout: int = 900) -> Path:
    """`sources` compiled one by one through ccache (a compile and link in one call is not cached),
    then linked into `out` (written atomically)."""
    objects = out.parent / f".{out.name}.objects"
    objects.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ccache.environment(SHARED_CACHE, SHARED_CACHE)}
    with timed(what):
        built = []
        for i, source in enumerate(sources):
            obj = objects / f"{i}-{source.stem}.o"
            done = subprocess.run(ccache.compiler([compiler, *flags, "-c", str(source), "-o", str(obj)]),
                                  capture_output=True, text=True, timeout=timeout, env=env)
            assert done.returncode == 0, done.stderr[-3000:]
            built.append(str(obj))
        partial = out.with_name(out.name + ".partial")
        done = subprocess.run([compiler, *flags, *built, "-o", str(partial), *link_flags],
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        os.replace(partial, out)
    shutil.rmtree(objects, ignore_errors=True)
    return out


@contextlib.contextmanager
def ccache_in_environment() -> Iterator[None]:
    """ccache for a build run by code that takes no compiler flags (tests/apir/fuzz/build.py): CMake reads
    its compiler launchers from the environment too."""
    added = ccache.environment(SHARED_CACHE, SHARED_CACHE)
    if added:
        added.update({"CMAKE_C_COMPILER_LAUNCHER": "ccache", "CMAKE_CXX_COMPILER_LAUNCHER": "ccache"})
    saved = {key: os.environ.get(key) for key in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
