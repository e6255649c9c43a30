"""A prompt batch's time on the client, between two computes on the host, on two builds side by side
(patch 0013's held writes, issue 31).

On the GPU, pp512 through APIR ran at 0.84-0.89 of native while upstream's calls ran at 0.92: its
traces showed the host's share of a batch no longer than upstream's, and 6.3-6.9 ms of the client's
own time between two computes against 4.0-4.4 ms. That time is the client's CPU work, which this
machine measures as well as the GPU machine's: the model's computes run on the host's CPU here, and
the client waits for them, idle, so nothing of the host's work is counted in it. The CPU backend's
threads spin for a while after a compute, though, and on a machine of few cores they take the client's
CPU: apir-host runs on the last CPU and llama-bench on the first (one thread each side), so that the
client's time is its own.

llama-bench's pp512 runs through each build's own apir-host on the CPU (host buffers, a GPU host's
path) in alternated passes: the build before, the build after, and the build after with upstream's
calls (`GGML_VIRTGPU_GRAPH_RUN=0`). From apir-host's trace, per prompt batch: the client's time
between two computes (the span less the host's time in the calls between them), the host's time in
the compute's call, and the number of calls between.

    python benchmarks/apir_prompt_client.py --before OLD/bin --after NEW/bin --model MODEL.gguf \\
        [--passes 2] [--reps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apir_serving_queries import apir_host, emit  # noqa: E402

from apirctl.apir import protocol  # noqa: E402
from apirctl.apir import trace as apir_trace  # noqa: E402
from apirctl.build import llamacpp  # noqa: E402

MODES = {"before": {}, "after": {}, "after_upstream_calls": {"GGML_VIRTGPU_GRAPH_RUN": "0"}}


def batches(trace: Path, tokens: int) -> list[dict[str, float]]:
    """Per prompt batch after the first (whose span holds the model's load): client and host time in µs."""
    calls = [r for r in apir_trace.read(trace.read_bytes()) if r.cmd_type == protocol.CommandType.FORWARD]

    def is_compute(record: apir_trace.Record) -> bool:
        if record.name == "backend_graph_compute":
            return True
        found = record.graph_run() if record.name.startswith("ext_graph") else None
        return found is not None and found[0].graph_id != 0

    computes = [i for i, r in enumerate(calls) if is_compute(r)]
    rows = []
    for a, b in zip(computes[1:], computes[2:], strict=False):
        span = calls[b].start_ns - (calls[a].start_ns + calls[a].duration_ns)
        between = sum(calls[j].duration_ns for j in range(a + 1, b))
        rows.append({"client_us": round((span - between) / 1e3, 1), "host_between_us": round(between / 1e3, 1),
                     "compute_call_us": round(calls[b].duration_ns / 1e3, 1), "calls_between": b - a - 1})
    return rows


@contextlib.contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """This process (and what it starts meanwhile) on `cpus` only."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def one_pass(mode: str, bin_dir: Path, model: Path, workdir: Path, reps: int, tokens: int) -> dict[str, Any]:
    trace = workdir / f"trace-{mode}.bin"
    trace.unlink(missing_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, host_cpu = cpus[0], cpus[-1]
    with contextlib.ExitStack() as stack:
        with pinned({host_cpu}):  # apir-host inherits it
            path = stack.enter_context(apir_host(bin_dir, workdir, trace))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
        env |= {"GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0", **MODES[mode]}
        with pinned({client_cpu}):
            done = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(tokens), "-n", "0",
                                   "-r", str(reps), "-ngl", "99", "-t", "1", "-o", "json"],
                                  env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench ({mode}) failed: {done.stderr[-1000:]}")
    rows = batches(trace, tokens)
    if len(rows) < reps - 1:
        raise SystemExit(f"{mode}: {len(rows)} batches in the trace, expected {reps}: not through apir-host?")
    client = [r["client_us"] for r in rows]
    return {"mode": mode, "batches": rows, "client_us_median": statistics.median(client),
            "compute_call_us_median": statistics.median(r["compute_call_us"] for r in rows),
            "host_between_us_median": statistics.median(r["host_between_us"] for r in rows),
            "pp_ts": round(json.loads(done.stdout)[0]["avg_ts"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="bin dir of the build before the change")
    parser.add_argument("--after", type=Path, required=True, help="bin dir of the build with it")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=512, help="the prompt batch (llama-bench -p)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--series-before", default="", help="the --before build's patch-series digest")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="apir-prompt-") as tmp:
        workdir = Path(tmp)
        os.chmod(workdir, 0o700)
        for n in range(args.passes):
            order = list(MODES) if n % 2 == 0 else list(reversed(MODES))
            for mode in order:
                bin_dir = args.before if mode == "before" else args.after
                row = one_pass(mode, bin_dir, args.model, workdir, args.reps, args.tokens)
                row["pass"] = n
                rows.append(row)
                print(f"pass {n} {mode}: client {row['client_us_median']:.0f} us a batch, compute call "
                      f"{row['compute_call_us_median']:.0f} us, {row['pp_ts']} t/s", file=sys.stderr, flush=True)
    summary = {mode: {"client_us_median": [r["client_us_median"] for r in rows if r["mode"] == mode],
                      "host_between_us_median": [r["host_between_us_median"] for r in rows if r["mode"] == mode]}
               for mode in MODES}
    result = {
        "benchmark": "apir_prompt_client",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "series_after": llamacpp.patches_digest(), "series_before": args.series_before,
        "model": args.model.name, "tokens": args.tokens, "reps": args.reps, "passes": args.passes,
        "rows": rows, "summary": summary,
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
