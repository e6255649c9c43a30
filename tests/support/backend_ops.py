"""Upstream's test-backend-ops on an APIR device: the ops a served model's graph uses, the cases run per
op, and how a run's output is read. Shared by tests/remoting/test_apir_backend_ops.py (CPU host, CI)
and benchmarks/gpu_apir_backend_ops.py (CUDA host); standard library only, so that it runs where
pytest is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# the ops a Llama, Qwen or Gemma graph uses, as test-backend-ops names them (`-o`); MUL_MAT_HADAMARD is
# its name for the matrix products llama.cpp hints as Hadamard transforms (a rotated KV cache's), which
# `-o MUL_MAT` does not select
OPS = ("GET_ROWS", "MUL_MAT", "MUL_MAT_ID", "ADD", "MUL", "SCALE", "RMS_NORM", "NORM", "ROPE", "SOFT_MAX", "CPY",
       "CONT", "SET_ROWS", "FLASH_ATTN_EXT", "SWIGLU", "GEGLU", "SILU", "GELU", "MUL_MAT_HADAMARD")

# Per op, the cases run (a regex over the case's parameters, test-backend-ops `-p`) where all of them
# would take too long (MUL_MAT alone has 2275 cases, FLASH_ATTN_EXT 5317; about 0.2 to 1 s each here):
# the types models ship in, and a fixed part of the shapes, broadcasts and permutations. Cases picked
# (of all): GET_ROWS 56/240, MUL_MAT 86/2275, MUL_MAT_ID 71/945, ROPE 84/470, SOFT_MAX 36/214,
# CPY 151/600, SET_ROWS 99/727, FLASH_ATTN_EXT 25/5317; the other ops run all their cases.
TYPES = "(f32|f16|q4_0|q8_0|q4_K|q6_K)"
SUBSETS: dict[str, str] = {
    "GET_ROWS": rf"^type={TYPES},",
    "MUL_MAT": (rf"^type_a={TYPES},type_b=f32,m=16,n=(1|9|16),k=256,bs=\[1,1\]"
                r"|^type_a=(f16|q4_0),type_b=f32,m=16,n=\d+,k=256,bs=\[(3,2|2,3)\],nr=\[(1,1|2,2)\]"
                r"|^type_a=f16,type_b=f16,m=16,n=(1|9),k=256,"),
    "MUL_MAT_ID": rf"^type_a={TYPES},type_b=f32,n_mats=(4|8),n_used=(1|2|4),b=0,m=512,n=(1|32),k=256,",
    "ROPE": r"^type=f32,ne_a=\[128,\d+,2,1\],n_dims=128,mode=[02],|^type=f16,ne_a=\[64,\d+,2,1\],n_dims=64,mode=2,",
    "SOFT_MAX": r",mask=1,sinks=0,m_prec=f(32|16),nr23=\[1,1\],scale=0\.1",
    "CPY": r"^type_src=(f32|f16),type_dst=(f32|f16|q8_0|q4_0|iq2_xxs),",
    "SET_ROWS": r"^type_src=f32,type_dst=(f32|f16|bf16|q8_0|q4_0|iq2_xxs),",
    "FLASH_ATTN_EXT": (r"^hsk=(64|128),hsv=\1,nh=4,nr23=\[(1|4),1\],kv=512,nb=(1|32),mask=1,sinks=[01],"
                       r"max_bias=0\.000000,logit_softcap=0\.000000,prec=f32,type_K=(f16|q8_0),type_V=\4,"
                       r"permute=\[0,1,2,3\]"),
}

# Cases the host's CPU backend refuses (it cannot quantize to iq2_xxs; its supports_op says so). The
# reference CPU backend refuses them too, so they are reported "not supported" either way; the APIR
# backend is named among those that refuse them only if the frontend asked the host (a frontend that
# claims every op is not named).
REFUSED = {"CPY": "type_dst=iq2_xxs,", "SET_ROWS": "type_dst=iq2_xxs,"}
# the host's CPU device as the frontend names it (docs/apir.md), what `-b` takes
DEVICE = "[virtgpu] CPU"
# the APIR device's backend, as test-backend-ops names it in "not supported [...]"
APIR_BACKEND = "API Remoting backend"

# one process per op; this is far above what any one of them takes
OP_TIMEOUT = 300
# a case's line; a failed check may print its own words first ("sentinel mismatch: sent_6   OP(...)")
CASE = re.compile(r"(?:^|\s)(?P<op>[A-Z0-9_]+)\((?P<params>.*)\): (?P<result>.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# test-backend-ops enumerates registered backends only: compiled beside it, this registers the RPC
# server named by RPC_ENDPOINT_ENV (`unix:PATH` or HOST:PORT), which test-backend-ops then calls RPC0
RPC_ENDPOINT_ENV = "APIRCTL_TEST_RPC_ENDPOINT"
RPC_SHIM = r"""
#include "ggml-backend.h"
#include "ggml-rpc.h"
#include <cstdlib>
namespace {
struct register_rpc {
    register_rpc() {
        const char * endpoint = std::getenv("APIRCTL_TEST_RPC_ENDPOINT");
        if (endpoint != nullptr) {
            ggml_backend_register(ggml_backend_rpc_add_server(endpoint));
        }
    }
} registered;
}
"""


@dataclass
class Counts:
    passed: int = 0
    unsupported: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def run_op(exe: Path, socket_path: Path, op: str, log: Path, device: str = DEVICE,
           extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Counts]:
    """test-backend-ops for one op on the APIR device (named after the host's device, docs/apir.md),
    with `extra_env` for the frontend; its output goes to `log` as well."""
    env = {**os.environ, "GGML_VIRTGPU_SOCKET": str(socket_path), **(extra_env or {})}
    args = [str(exe), "test", "-b", device, "-o", op]
    if op in SUBSETS:
        args += ["-p", SUBSETS[op]]
    done = subprocess.run(args, capture_output=True, text=True, timeout=OP_TIMEOUT, env=env)
    with log.open("a") as out:
        out.write(f"$ {' '.join(args)}\n{done.stdout}{done.stderr}\nexit status {done.returncode}\n")
    return done, read_counts(done.stdout)


def read_counts(stdout: str) -> Counts:
    """A test-backend-ops run's cases: passed, reported unsupported (with the reason), failed (the line)."""
    counts = Counts()
    for line in ANSI.sub("", stdout).splitlines():
        m = CASE.search(line)
        if m is None:
            continue
        result = m["result"].strip()
        if result.startswith("not supported"):
            counts.unsupported.append(f"{m['params']}: {result}")
        elif result == "OK":
            counts.passed += 1
        else:
            counts.failed.append(line.strip())
    return counts
