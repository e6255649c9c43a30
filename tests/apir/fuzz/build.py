"""The suite's one sanitized GGML tree, and the APIR dispatch fuzzer built against it.

One configuration serves every sanitized harness (issue 34: sanitized variants share one tree): clang,
shared libraries, AddressSanitizer and UndefinedBehaviorSanitizer with libFuzzer's coverage, and the
targets each harness links:

    ggml-base, ggml-cpu        every harness (ggml-cpu is what the backend library loads)
    ggml-virtgpu-backend       the APIR dispatch fuzzer and the APIR graph fuzzer
    ggml-rpc                   the RPC graph fuzzer (tests/apir/graph_fuzz/)

A harness is then one compile and link against that tree (seconds), so the graph fuzzers cost CI no
second tree. ccache is used when it is on the PATH.

    python -m tests.apir.fuzz.build --src LLAMA_CPP_TREE --build-dir DIR

prints the dispatch fuzzer's path (DIR/apir_dispatch_fuzz). The tests build the tree from the pinned,
patched source into the test cache, keyed by the series' digest and `configuration_digest()`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "apir_dispatch_fuzz.cpp"
TARGETS = ("ggml-base", "ggml-cpu", "ggml-rpc", "ggml-virtgpu-backend")
# -fno-sanitize=function: ggml-cpu calls its C kernels through function pointers typed with `void *`
# where the kernels take `ggml_fp16_t *` (type_traits_cpu's vec_dot); the C++ callers would report it
# on every F16 product, and it is no memory error
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize=function", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-g")
# -DNDEBUG: C assert()s off, as in the hosts' release builds (GGML_ASSERT stays): with them on,
# llamafile's sgemm stops at asserting a row stride of a one-row operand that it never uses
LIBRARY_FLAGS = (*SANITIZE, "-fsanitize=fuzzer-no-link", "-O1", "-DNDEBUG")
OPTIONS = ("-DCMAKE_BUILD_TYPE=Debug", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF",
           "-DGGML_VIRTGPU=ON", "-DGGML_VIRTGPU_BACKEND=ONLY", "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
#: What a harness adds to link against the tree.
HARNESS_FLAGS = ("-std=c++17", "-O1", *SANITIZE, "-fsanitize=fuzzer", "-Wall", "-Wextra", "-Werror")
#: The Debian packages a fresh machine needs for the tree and the harnesses (clang's libFuzzer runtime
#: and sanitizers come with `clang`; libclang-rt-*-dev on newer releases).
PACKAGES = "clang cmake ninja-build patch python3"


class FuzzBuildError(RuntimeError):
    """A step of the build failed; the message ends with its output."""


def configuration_digest() -> str:
    """The tree's configuration (flags, options, targets), for the cache key of a built tree."""
    return hashlib.sha256("\0".join((*LIBRARY_FLAGS, *OPTIONS, *TARGETS)).encode()).hexdigest()[:8]


def clang() -> tuple[str, str]:
    """clang and clang++ (14 or later, with libFuzzer's runtime)."""
    cc, cxx = shutil.which("clang"), shutil.which("clang++")
    if cc is None or cxx is None:
        raise FuzzBuildError(f"clang and clang++ (with libFuzzer) are needed; on Debian: apt-get install {PACKAGES}")
    return cc, cxx


def _run(cmd: list[str], what: str, timeout: int) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise FuzzBuildError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def build_libraries(src: Path, build_dir: Path, jobs: int = 2, targets: tuple[str, ...] = TARGETS) -> Path:
    """The sanitized libraries of `src` in `build_dir`; returns their folder (`build_dir/bin`).

    `targets` may be fewer than TARGETS (a campaign of one host); the configuration is the same."""
    cc, cxx = clang()
    flags = " ".join(LIBRARY_FLAGS)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    launcher = (["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
                if shutil.which("ccache") and os.environ.get("APIRCTL_CCACHE", "1") != "0" else [])
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), *generator, *launcher,
                 f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}",
                 f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}", *OPTIONS]
    _run(["nice", *configure], "configuring the sanitized libraries", 600)
    _run(["nice", "cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *targets],
         "building the sanitized libraries", 7200)
    return build_dir / "bin"


def link_harness(source: Path, libs: tuple[str, ...], lib_dir: Path, out: Path,
                 include: tuple[Path, ...] = ()) -> Path:
    """`source` compiled and linked against the sanitized libraries `libs` in `lib_dir` (found there at run
    time), written to `out` atomically."""
    _, cxx = clang()
    partial = out.with_name(out.name + ".partial")
    _run(["nice", cxx, *HARNESS_FLAGS, *(f"-I{d}" for d in include), str(source), "-o", str(partial),
          f"-L{lib_dir}", *(f"-l{lib}" for lib in libs), f"-Wl,-rpath,{lib_dir}", "-ldl", "-lpthread"],
         f"compiling {out.name}", 600)
    os.replace(partial, out)
    return out


def build_fuzzer(lib_dir: Path, out: Path) -> Path:
    """The dispatch harness linked against the sanitized backend library in `lib_dir`."""
    return link_harness(HARNESS, ("ggml-virtgpu-backend", "ggml-base"), lib_dir, out)


def build(src: Path, build_dir: Path, jobs: int = 2) -> Path:
    lib_dir = build_libraries(src, build_dir, jobs)
    return build_fuzzer(lib_dir, build_dir / "apir_dispatch_fuzz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="a llama.cpp tree with the patch series applied")
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--harness-only", action="store_true", help="relink the harness against built libraries")
    args = parser.parse_args()
    build_dir = args.build_dir.resolve()
    if args.harness_only:
        print(build_fuzzer(build_dir / "bin", build_dir / "apir_dispatch_fuzz"))
    else:
        print(build(args.src.resolve(), build_dir, args.jobs))


if __name__ == "__main__":
    main()
