"""Fixtures for the APIR tests: the pinned upstream sources, the real backend library, and the C++
conformance harness compiled against the pinned headers (once per session, cached on disk)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def virtgpu_src() -> Path:
    """`ggml/src/ggml-virtgpu` of the pinned llama.cpp source (fetched on first use)."""
    from apirctl.build import llamacpp

    return llamacpp.source_dir() / "ggml" / "src" / "ggml-virtgpu"


@pytest.fixture
def backend_libs(llama_build) -> tuple[Path, Path, str]:  # type: ignore[no-untyped-def]
    """The real backend library with the host build's CPU GGML library and its registration symbol."""
    return (llama_build.library("ggml-virtgpu-backend"), llama_build.library("ggml-cpu"), "ggml_backend_cpu_reg")


class Harness:
    """The compiled harness as a co-process: one request line in, one answer line out."""

    def __init__(self, binary: Path) -> None:
        self.proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"harness died on {line[:80]!r} (exit {self.proc.wait()})")
        return answer.rstrip("\n")

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture
def harness(virtgpu_src: Path, llama_build, tmp_path_factory: pytest.TempPathFactory  # type: ignore[no-untyped-def]
            ) -> Iterator[Harness]:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to compile the conformance harness")
    source = HERE / "harness.cpp"
    shim = HERE / "shim" / "ggml-remoting.h"
    front = virtgpu_src / "apir_cs_ggml-rpc-front.cpp"
    ggml = virtgpu_src.parent.parent
    lib_dir = llama_build.library("ggml-virtgpu-backend").parent
    blob = source.read_bytes() + shim.read_bytes() + front.read_bytes() + str(ggml).encode() + str(lib_dir).encode()
    key = hashlib.sha256(blob).hexdigest()[:12]
    binary = tmp_path_factory.getbasetemp() / f"apir-harness-{key}"
    if not binary.exists():
        # Upstream's frontend serializer is compiled from a copy placed next to the shim header, so that
        # its `#include "ggml-remoting.h"` finds the shim instead of the device code.
        work = tmp_path_factory.mktemp("apir-harness-build")
        shutil.copy(shim, work / "ggml-remoting.h")
        shutil.copy(front, work / front.name)
        includes = [f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{virtgpu_src}", f"-I{virtgpu_src / 'backend'}"]
        cmd = ["g++", "-std=c++17", "-O0", "-w", *includes, str(source), str(work / front.name),
               "-o", str(binary) + ".tmp", f"-L{lib_dir}", "-lggml-virtgpu-backend", "-lggml-cpu", "-lggml-base",
               f"-Wl,-rpath,{lib_dir}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        Path(str(binary) + ".tmp").rename(binary)
    h = Harness(binary)
    yield h
    h.close()


class SanitizedTree:
    """The suite's one sanitized GGML tree (tests/apir/fuzz/build.py) and where harnesses linked against it go."""

    def __init__(self, src: Path, root: Path) -> None:
        self.src, self.root, self.lib_dir = src, root, root / "bin"

    def harness_dir(self, digest: str) -> Path:
        """A folder of harnesses keyed by their sources' digest, inside the tree they link against."""
        return self.root / "harnesses" / digest


@pytest.fixture(scope="session")
def sanitized_ggml() -> SanitizedTree:
    """The sanitized libraries every fuzzer links (the dispatch fuzzer and both graph fuzzers), built once
    from the pinned, patched source, keyed by the series' digest and the tree's configuration."""
    import sys

    if sys.platform != "linux":
        pytest.skip("the fuzzers use Linux's mmap, dlsym and Unix sockets")
    if shutil.which("clang++") is None or shutil.which("cmake") is None:
        pytest.skip("clang++ (with libFuzzer) and cmake are needed")
    from apirctl.build import ccache, llamacpp
    from tests.apir.fuzz import build as fuzz_build
    from tests.conftest import SHARED_CACHE, shared_env
    from tests.support import native_builds

    with shared_env():
        src = llamacpp.source_dir()
        key = llamacpp.patches_digest()[:16] + "-" + fuzz_build.configuration_digest()
    root = SHARED_CACHE / "sanitized-ggml" / key
    tree = SanitizedTree(src, root)
    # the dispatch fuzzer's and the graph fuzzers' modules may run in two xdist workers at once
    with native_builds.locked(f"sanitized-ggml-{key}"):
        if not all((tree.lib_dir / f"lib{t}.so").exists() for t in fuzz_build.TARGETS):
            root.mkdir(parents=True, exist_ok=True)
            # through a link in the build directory: the same relative paths for every key (ccache hits)
            linked = ccache.link_source(src, root)
            what = "the sanitized GGML tree (clang, ASan + UBSan + libFuzzer)"
            with native_builds.ccache_in_environment(), native_builds.timed(what):
                fuzz_build.build_libraries(linked, root)
    return tree
