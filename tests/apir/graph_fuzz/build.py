"""Build the graph fuzzers of both hosts: the GGML libraries (base, CPU, RPC) and the APIR backend
library compiled with clang under AddressSanitizer and UndefinedBehaviorSanitizer (and libFuzzer's
coverage), then the two harnesses linked against them:

    apir_graph_fuzz   graphs through libggml-virtgpu-backend's dispatcher (apir-host's library)
    rpc_graph_fuzz    graphs through ggml-rpc's server (ggml-rpc-server's command loop)

    python -m tests.apir.graph_fuzz.build --src LLAMA_CPP_TREE --build-dir DIR

prints the two fuzzers' paths. ccache is used when it is on the PATH, so a rebuild after a change to
the patch series compiles only the files it touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESSES = {"apir_graph_fuzz": ("apir_graph_fuzz.cpp", ("ggml-virtgpu-backend", "ggml-base")),
             "rpc_graph_fuzz": ("rpc_graph_fuzz.cpp", ("ggml-rpc", "ggml-cpu", "ggml-base"))}
SOURCES = ("graph_gen.h", "apir_graph_fuzz.cpp", "rpc_graph_fuzz.cpp")
TARGETS = ("ggml-base", "ggml-cpu", "ggml-rpc", "ggml-virtgpu-backend")
# -fno-sanitize=function: ggml-cpu calls its C kernels through function pointers typed with `void *`
# where the kernels take `ggml_fp16_t *` (type_traits_cpu's vec_dot); the C++ callers would report it
# on every F16 product, and it is no memory error
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize=function", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-g")
# -DNDEBUG: C assert()s off, as in the hosts' release builds (GGML_ASSERT stays): a Debug build stops
# at llamafile's sgemm asserting a row stride of a one-row operand that it never uses
LIBRARY_FLAGS = (*SANITIZE, "-fsanitize=fuzzer-no-link", "-O1", "-DNDEBUG")


class FuzzBuildError(RuntimeError):
    """A step of the build failed; the message ends with its output."""


def clang() -> tuple[str, str]:
    cc, cxx = shutil.which("clang"), shutil.which("clang++")
    if cc is None or cxx is None:
        raise FuzzBuildError("clang and clang++ (with libFuzzer) are needed to build the graph fuzzers")
    return cc, cxx


def _run(cmd: list[str], what: str, timeout: int) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise FuzzBuildError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def build_libraries(src: Path, build_dir: Path, jobs: int = 2) -> Path:
    """The sanitized libraries of `src` in `build_dir`; returns their folder (`build_dir/bin`)."""
    cc, cxx = clang()
    flags = " ".join(LIBRARY_FLAGS)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    launcher = (["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
                if shutil.which("ccache") else [])
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), *generator, *launcher, "-DCMAKE_BUILD_TYPE=Debug",
                 f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}",
                 f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}",
                 "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DGGML_VIRTGPU=ON",
                 "-DGGML_VIRTGPU_BACKEND=ONLY", "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    _run(["nice", *configure], "configuring the sanitized libraries", 600)
    _run(["nice", "cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS],
         "building the sanitized libraries", 7200)
    return build_dir / "bin"


def build_fuzzers(src: Path, lib_dir: Path, out_dir: Path) -> dict[str, Path]:
    """Both harnesses linked against the sanitized libraries in `lib_dir` (found there at run time)."""
    _, cxx = clang()
    include = src / "ggml" / "include"
    out = {}
    for name, (source, libs) in HARNESSES.items():
        exe = out_dir / name
        _run(["nice", cxx, "-std=c++17", "-O1", *SANITIZE, "-fsanitize=fuzzer", "-Wall", "-Wextra", "-Werror",
              f"-I{include}", str(HERE / source), "-o", str(exe), f"-L{lib_dir}", *(f"-l{lib}" for lib in libs),
              f"-Wl,-rpath,{lib_dir}", "-ldl", "-lpthread"], f"compiling {name}", 600)
        out[name] = exe
    return out


def build(src: Path, build_dir: Path, jobs: int = 2) -> dict[str, Path]:
    lib_dir = build_libraries(src, build_dir, jobs)
    return build_fuzzers(src, lib_dir, build_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="a llama.cpp tree with the patch series applied")
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--harness-only", action="store_true", help="relink the harnesses against built libraries")
    args = parser.parse_args()
    build_dir = args.build_dir.resolve()
    if args.harness_only:
        found = build_fuzzers(args.src.resolve(), build_dir / "bin", build_dir)
    else:
        found = build(args.src.resolve(), build_dir, args.jobs)
    for exe in found.values():
        print(exe)


if __name__ == "__main__":
    main()
