"""Build the graph fuzzers of both hosts against the suite's one sanitized GGML tree
(tests/apir/fuzz/build.py: clang, ASan + UBSan + libFuzzer coverage; ggml-base, ggml-cpu, ggml-rpc and
the APIR backend library), so they add a harness compile each, not a tree:

    apir_graph_fuzz   graphs through libggml-virtgpu-backend's dispatcher (apir-host's library)
    rpc_graph_fuzz    graphs through ggml-rpc's server (ggml-rpc-server's command loop)

    python -m tests.apir.graph_fuzz.build --src LLAMA_CPP_TREE --build-dir DIR [--jobs N]
    python -m tests.apir.graph_fuzz.build --src LLAMA_CPP_TREE --build-dir DIR --harness-only

prints the two fuzzers' paths. `--harness-only` links them against a tree DIR already holds (the
dispatch fuzzer's, say). ccache is used when it is on the PATH.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

from tests.apir.fuzz.build import (
    LIBRARY_FLAGS,
    PACKAGES,
    SANITIZE,
    TARGETS,
    FuzzBuildError,
    build_libraries,
    clang,
    link_harness,
)

__all__ = ["FuzzBuildError", "HARNESSES", "LIBRARY_FLAGS", "PACKAGES", "SANITIZE", "SOURCES", "TARGETS", "build",
           "build_fuzzers", "clang", "harness_digest"]

HERE = Path(__file__).resolve().parent
HARNESSES = {"apir_graph_fuzz": ("apir_graph_fuzz.cpp", ("ggml-virtgpu-backend", "ggml-base")),
             "rpc_graph_fuzz": ("rpc_graph_fuzz.cpp", ("ggml-rpc", "ggml-cpu", "ggml-base"))}
SOURCES = ("graph_gen.h", "apir_graph_fuzz.cpp", "rpc_graph_fuzz.cpp")
#: The tree's targets each harness needs (ggml-cpu: the backend library loads it at run time).
NEEDS = {"apir_graph_fuzz": ("ggml-base", "ggml-cpu", "ggml-virtgpu-backend"),
         "rpc_graph_fuzz": ("ggml-base", "ggml-cpu", "ggml-rpc")}


def harness_digest() -> str:
    return hashlib.sha256(b"".join((HERE / s).read_bytes() for s in SOURCES)).hexdigest()[:12]


def build_fuzzers(src: Path, lib_dir: Path, out_dir: Path, names: tuple[str, ...] = tuple(HARNESSES)
                  ) -> dict[str, Path]:
    """The harnesses `names` linked against the sanitized libraries in `lib_dir`, into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    include = (src / "ggml" / "include",)
    return {name: link_harness(HERE / HARNESSES[name][0], HARNESSES[name][1], lib_dir, out_dir / name, include)
            for name in names}


def build(src: Path, build_dir: Path, jobs: int = 2, names: tuple[str, ...] = tuple(HARNESSES)) -> dict[str, Path]:
    """The tree's targets that `names` need, then the harnesses, all in `build_dir`."""
    targets = tuple(t for t in TARGETS if any(t in NEEDS[n] for n in names))
    lib_dir = build_libraries(src, build_dir, jobs, targets)
    return build_fuzzers(src, lib_dir, build_dir, names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="a llama.cpp tree with the patch series applied")
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--harness-only", action="store_true", help="link the harnesses against a built tree")
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
