"""Build the APIR dispatch fuzzer: the backend library and the GGML libraries it needs, compiled with
clang under AddressSanitizer and UndefinedBehaviorSanitizer (and libFuzzer's coverage), then the
harness `apir_dispatch_fuzz.cpp` linked against them.

Only three targets are built (ggml-base, ggml-cpu, ggml-virtgpu-backend; a few minutes on 2 cores,
ccache helps a rebuild), shared, in a build directory of their own:

    python -m tests.apir.fuzz.build --src LLAMA_CPP_TREE --build-dir DIR

prints the fuzzer's path (DIR/apir_dispatch_fuzz). The test (test_apir_fuzz.py) builds from the
pinned, patched source into the test cache, keyed by the series' digest and the harness.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "apir_dispatch_fuzz.cpp"
TARGETS = ("ggml-base", "ggml-cpu", "ggml-virtgpu-backend")
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")
LIBRARY_FLAGS = (*SANITIZE, "-fsanitize=fuzzer-no-link", "-O1")


class FuzzBuildError(RuntimeError):
    """A step of the build failed; the message ends with its output."""


def clang() -> tuple[str, str]:
    """clang and clang++ (14 or later, with libFuzzer's runtime)."""
    cc, cxx = shutil.which("clang"), shutil.which("clang++")
    if cc is None or cxx is None:
        raise FuzzBuildError("clang and clang++ are needed to build the fuzzer")
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
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Debug",
                 f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}",
                 f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}",
                 "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DGGML_VIRTGPU=ON",
                 "-DGGML_VIRTGPU_BACKEND=ONLY", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    _run(configure, "configuring the sanitized libraries", 600)
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS],
         "building the sanitized libraries", 3600)
    return build_dir / "bin"


def build_fuzzer(lib_dir: Path, out: Path) -> Path:
    """The harness linked against the sanitized backend library in `lib_dir` (found there at run time)."""
    _, cxx = clang()
    _run([cxx, "-std=c++17", "-O1", *SANITIZE, "-fsanitize=fuzzer", "-Wall", "-Wextra", "-Werror", str(HARNESS),
          "-o", str(out), f"-L{lib_dir}", "-lggml-virtgpu-backend", "-lggml-base", f"-Wl,-rpath,{lib_dir}", "-ldl"],
         "compiling the fuzzer", 600)
    return out


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
