"""The shared node rules (`ggml_node_check`, ggml/src/ggml-node-check.cpp of patch 0015) where no client of a
CPU host reaches them: llama_patches/tests/node_check_test.cpp calls them directly, built with AddressSanitizer
and UndefinedBehaviorSanitizer against the libraries of the sanitized ggml-rpc-server's build
(tests/remoting/test_shm_native.py), so ggml's name tables are read under the sanitizers too.

- The room rule: a buffer type that asks for more than ggml_nbytes (as CUDA's does) places a MUL_MAT
  result at the boundary; exactly the room passes, one byte less fails. On a CPU host the type answers
  ggml_nbytes, and the hosts' decoders refuse such a result before the rule (the hosts' boundary tests:
  test_rpc_graph_check.py, test_apir_kernel_checks.py).
- ggml_node_op_desc: ops, unary ops and GLU ops out of range are refused and named "unknown op", with
  no read past a name table and no load of an invalid ggml_op (UBSan reported one in the rule itself).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.remoting.test_shm_native import build_rpc_server
from tests.support import native_builds

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="sanitized static build")]


def test_the_node_rules_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    server = build_rpc_server("sanitized-rpc-server", ["-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON"])
    base = server.parent.parent / "ggml" / "src" / "libggml-base.a"  # the same build's static ggml
    assert base.exists(), base
    src = llamacpp.source_dir()
    test_cpp = Path(llamacpp.patch_series()[0]).parent / "tests" / "node_check_test.cpp"
    exe = native_builds.compile_program(
        compiler, ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", f"-I{src / 'ggml/include'}",
                   f"-I{src / 'ggml/src'}"],
        [test_cpp], tmp_path / "node_check_test", [str(base), "-lpthread", "-lm"],
        "the node check test (sanitized)", timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
                              "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "all node check tests passed" in run.stdout
    assert "runtime error:" not in run.stderr and "Sanitizer" not in run.stderr, run.stderr[-3000:]
