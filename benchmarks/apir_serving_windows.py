"""Where a served APIR row's time goes, read from its apir-host trace (issue 31).

A serving row is N streams against one llama-server for a window of seconds. apir-host's trace holds,
for each call, when the host started it and how long it took (CLOCK_MONOTONIC, the clock Python's
`time.monotonic` reads), so within the row's window it tells apart:

- the host's time per compute (`ext_graph_run`, `ext_graph_delta`: the step's graph and its outputs);
- the client's time between two computes: llama-server's own work (sampling, HTTP), plus what the
  frontend does on its side (copying a step's outputs out of shared memory, encoding);
- the reads outside computes: llama-server reads a finished request's KV cells into its prompt
  cache, one read per layer and K or V, and the whole server waits for them: a synchronous
  `buffer_get_tensor` each, or since patch 0028 one `ext_tensors_get` a save (its reads counted
  one by one). Their cost is the host's time and the client's time from one read call to the next
  (copying the bytes out of shared memory; the copy after a save's last call is the client's time
  before the next compute); a gap over `LONG_GAP_MS` is llama-server's own work between two
  requests' saves and is counted apart;
- graphs sent whole against kept graphs named or updated by a delta.

`gpu_serving.py` writes this for every APIR row it runs (`host_trace` in the row). On a trace of an
earlier run, whose rows did not record their windows, `--split-idle` cuts the trace where the host
was idle for that many seconds (between rows the server is idle):

    python benchmarks/apir_serving_windows.py --trace serving-1b-apir.trace \\
        --source benchmarks/results/gpu_serving-....json --json OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apirctl.apir import trace as apir_trace  # noqa: E402

COMPUTES = ("ext_graph_run", "ext_graph_delta")
READS = ("buffer_get_tensor", "ext_tensors_get")
#: a gap between two reads longer than this is llama-server's work between two saves, not a read's
LONG_GAP_MS = 1.0


def load(path: Path) -> list[apir_trace.Record]:
    """The trace's records in host order; a last record cut short (a host still writing) is left out."""
    with path.open("rb") as fh:
        found = list(apir_trace.records(fh, live=True))
    return sorted(found, key=lambda r: r.start_ns)


def breakdown(found: list[apir_trace.Record], start_ns: int, end_ns: int) -> dict[str, Any]:
    """The figures of the calls the host started within [start_ns, end_ns)."""
    calls = [r for r in found if start_ns <= r.start_ns < end_ns]
    wall_s = (end_ns - start_ns) / 1e9
    counts = Counter(r.name for r in calls)
    host_ms: dict[str, float] = {}
    for r in calls:
        host_ms[r.name] = host_ms.get(r.name, 0.0) + r.duration_ns / 1e6
    between_computes: list[float] = []  # client ms from one compute's end to the next one's start
    reads_client_ms = 0.0  # the client's time from one read to the next, within a save (up to LONG_GAP_MS)
    reads_other_ms = 0.0  # longer gaps between reads: llama-server's own work between two saves
    for before, after in itertools.pairwise(calls):
        gap_ms = (after.start_ns - (before.start_ns + before.duration_ns)) / 1e6
        if before.name in COMPUTES and after.name in COMPUTES:
            between_computes.append(gap_ms)
        if before.name in READS and after.name in READS:
            if gap_ms <= LONG_GAP_MS:
                reads_client_ms += gap_ms
            else:
                reads_other_ms += gap_ms
    reads = sum(found.n_reads if (found := r.tensors_get()) else 1 for r in calls if r.name in READS)
    reads_host_ms = sum(host_ms.get(name, 0.0) for name in READS)
    summary = apir_trace.summarize(calls)
    computes = summary.computes  # graph runs that computed (a run may carry writes alone)
    compute_host_ms = sum(host_ms.get(c, 0.0) for c in COMPUTES)
    cache = summary.graph_cache
    return {
        "wall_s": round(wall_s, 3),
        "calls": len(calls),
        "computes": computes,
        "computes_per_s": round(computes / wall_s, 1) if wall_s else None,
        "host_ms_per_compute": round(compute_host_ms / computes, 3) if computes else None,
        "client_ms_between_computes": (round(sum(between_computes) / len(between_computes), 3)
                                       if between_computes else None),
        "host_share": round(sum(host_ms.values()) / 1e3 / wall_s, 3) if wall_s else None,
        "kv_reads": reads,
        "kv_read_calls": sum(counts[name] for name in READS),
        "kv_reads_host_ms": round(reads_host_ms, 1),
        "kv_reads_client_ms": round(reads_client_ms, 1),
        "kv_reads_share": round((reads_host_ms + reads_client_ms) / 1e3 / wall_s, 3) if wall_s else None,
        "gaps_between_saves_ms": round(reads_other_ms, 1),
        "graphs_sent_whole": cache.sent,
        "graphs_named": cache.by_id,
        "graphs_by_delta": cache.delta,
        "calls_by_function": dict(counts.most_common()),
        "host_ms_by_function": {k: round(v, 1) for k, v in sorted(host_ms.items(), key=lambda kv: -kv[1])},
    }


def idle_windows(found: list[apir_trace.Record], idle_s: float, shortest_s: float = 5.0) -> list[tuple[int, int]]:
    """Stretches of calls with no idle gap longer than `idle_s`, at least `shortest_s` long."""
    windows: list[tuple[int, int]] = []
    if not found:
        return windows
    first = last = found[0].start_ns
    for record in found[1:]:
        if record.start_ns - last > idle_s * 1e9:
            windows.append((first, last))
            first = record.start_ns
        last = max(last, record.start_ns + record.duration_ns)
    windows.append((first, last + 1))
    return [(a, b) for a, b in windows if b - a >= shortest_s * 1e9]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, help="an apir-host trace of a serving row")
    parser.add_argument("--split-idle", type=float, default=2.0, help="seconds of host idleness between windows")
    parser.add_argument("--shortest", type=float, default=5.0, help="seconds: shorter windows are left out")
    parser.add_argument("--source", type=Path, help="the results file of the run the trace came from")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    try:
        found = load(args.trace)
    except (OSError, apir_trace.ApirTraceError) as exc:
        print(f"apir_serving_windows: cannot read {args.trace}: {exc}\n"
              "hint: pass the .trace file an apir-host wrote with --trace", file=sys.stderr)
        return 2
    windows = [breakdown(found, a, b) for a, b in idle_windows(found, args.split_idle, args.shortest)]
    source_env: dict[str, Any] = {}
    if args.source is not None:
        source_env = json.loads(args.source.read_text()).get("env", {})
    out = {"env": {"trace_sha256": hashlib.sha256(args.trace.read_bytes()).hexdigest(),
                   "trace_name": args.trace.name, "split_idle_s": args.split_idle,
                   "source": args.source.name if args.source else None,
                   "patch_digest": source_env.get("patch_digest"), "gpu": source_env.get("gpu"),
                   "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
           "windows": windows}
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    for i, w in enumerate(windows):
        print(f"window {i}: {w['wall_s']} s, {w['computes']} computes ({w['computes_per_s']}/s), host "
              f"{w['host_ms_per_compute']} ms a compute, client {w['client_ms_between_computes']} ms between, "
              f"{w['kv_reads']} KV reads: host {w['kv_reads_host_ms']} ms, client {w['kv_reads_client_ms']} ms "
              f"({w['kv_reads_share']} of the window)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
