"""The names benchmarks/gpu_conformance.py runs test-backend-ops with (`-o`), read from the pinned source.

`-o` matches a case by the name its test gives it, exactly: ggml's op, unary and GLU names, and for
upstream's composite cases (fused ops, whole graphs) the names their `op_desc` overrides return, which
no op's name selects. The conformance runs before 2026-11-29 had only the first kind, so those cases
(MUL_MAT_HADAMARD among them, which the APIR host refused in F16) never ran.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl.build import llamacpp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_conformance  # noqa: E402


def test_the_names_are_the_ops_and_every_composite_case_of_the_pinned_source() -> None:
    src = llamacpp.source_dir()
    names = gpu_conformance.op_names(src)
    assert len(names) == len(set(names)) and not {"NONE", "UNARY", "GLU"} & set(names)
    assert {"MUL_MAT", "ROPE", "FLASH_ATTN_EXT", "SWIGLU", "SILU"} <= set(names)  # the three tables of ggml.c
    assert names[0] == gpu_conformance.SLOW_FIRST[0]  # the slow ops first
    # every op_desc override of test-backend-ops that returns a literal name is among them
    tests = (src / "tests" / "test-backend-ops.cpp").read_text()
    overrides = re.findall(r"op_desc\(ggml_tensor \*(?: t)?\) override \{[^}]*?return \"([A-Z0-9_]+)\"", tests)
    assert len(overrides) >= 30 and set(overrides) <= set(names)
    assert {"MUL_MAT_HADAMARD", "ADD_RMS_NORM", "MUL_MAT_ID_SHARED", "LLAMA"} <= set(overrides)
    # the one built from a unary op's name: each unary op with "_MUL" (test_unary_mul)
    assert {"SILU_MUL", "GELU_MUL", "SIGMOID_MUL"} <= set(names)


@pytest.mark.parametrize("spec", ["0", "native", "gpu=0", "apir=", "rpc=0,x"])
def test_a_wrong_gpus_spec_is_refused_before_anything_is_built(spec: str, tmp_path: Path) -> None:
    """`--gpus 0 1` once took the two numbers for modes, built for 200 s, then failed in every worker."""
    script = Path(gpu_conformance.__file__)
    done = subprocess.run([sys.executable, str(script), "--sdist", str(tmp_path / "absent.tar.gz"), "--work",
                           str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--gpus", "native=0", spec],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is not MODE=GPU" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_the_gpus_specs_the_docs_give_are_taken() -> None:
    for spec in ("native=0,0", "apir=1,1", "rpc=2,2", "apir=1"):
        assert gpu_conformance.gpu_spec(spec) == spec
