"""Synchronous round trips per decode step through APIR while streams join and leave the batch.

Under serving, every request that joins or leaves llama-server's batch gives its graph a new shape.
Before the graph can be computed the frontend asks the host about the ops it has not seen
(`device_supports_op`, `buffer_type_get_alloc_size`), one synchronous call each. This counts them,
per decode step (a graph compute), in apir-host's own trace, for a build's llama-server through the
build's apir-host on the CPU: the counts do not depend on the hardware, only on the calls.

For each number of streams, the same requests run natively and then through apir-host three times:
with the frontend's answers kept per exact shape (`GGML_VIRTGPU_OP_CLASSES=0`), per op class (the
default where the host grants APIR_FEATURE_OP_CLASSES), and per op class with kept graphs updated by
deltas (APIR_FEATURE_GRAPH_DELTA, off in the first two: `GGML_VIRTGPU_GRAPH_DELTA=0`). Each stream
sends `--requests` requests in turn, of different lengths, so that the streams join and leave at
different steps; the greedy tokens of every request are compared with native's.

    python benchmarks/apir_serving_queries.py --bin-dir BUILD/bin --model MODEL.gguf \\
        [--streams 1 4] [--requests 3] [--tokens 12] [--json FILE]

The results name the build's patch-series digest (`--series`, default: this checkout's).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apirctl import serve  # noqa: E402
from apirctl.apir import trace as apir_trace  # noqa: E402
from apirctl.build import llamacpp  # noqa: E402

QUERIES = ("device_supports_op", "buffer_type_get_alloc_size")
#: the frontend's settings compared: answers per exact shape (and whole graphs), per op class (and
#: whole graphs), per op class with kept graphs updated by deltas (the default where the host grants both)
MODES = (("exact", {"GGML_VIRTGPU_OP_CLASSES": "0", "GGML_VIRTGPU_GRAPH_DELTA": "0"}),
         ("op_classes", {"GGML_VIRTGPU_GRAPH_DELTA": "0"}),
         ("op_classes_and_deltas", {}))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait(what: str, ready: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def emit(result: dict[str, Any], path: Path | None, indent: int = 2) -> None:
    """A benchmark's results: printed, and written to `path` (a results file) when one is given."""
    text = json.dumps(result, indent=indent)
    if path is not None:
        path.write_text(text + "\n")
    print(text)


@contextlib.contextmanager
def apir_host(bin_dir: Path, workdir: Path, trace: Path) -> Iterator[Path]:
    """apir-host on the CPU backend, tracing every call; yields its socket."""
    path, log = workdir / "apir.sock", workdir / "apir-host.log"
    args = [str(bin_dir / "apir-host"), "--socket", str(path),
            "--backend-library", str(bin_dir / "libggml-virtgpu-backend.so"),
            "--ggml-library", str(bin_dir / "libggml-cpu.so"), "--trace", str(trace)]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait("apir-host", lambda: b"apir-host: listening on" in log.read_bytes() or proc.poll() is not None, 60)
        if proc.poll() is not None:
            raise SystemExit(log.read_text(errors="replace"))
        yield path
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@contextlib.contextmanager
def llama_server(bin_dir: Path, model: Path, workdir: Path, slots: int, socket_path: Path | None,
                 env: dict[str, str]) -> Iterator[str]:
    """The build's llama-server with `slots` slots, on the APIR device when socket_path is given."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
    if socket_path is not None:
        full["GGML_VIRTGPU_SOCKET"] = str(socket_path)
    full.update(env)
    args = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "-c", str(256 * slots), "-np", str(slots), "--no-warmup",
            "-ngl", "99" if socket_path else "0"]
    log = workdir / f"llama-server-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise SystemExit(log.read_text(errors="replace")[-3000:])
        return serve.health(url, timeout=2) == "ok"

    try:
        wait("llama-server", healthy, 180)
        yield url
    finally:
        proc.kill()
        proc.wait()


def request_plan(streams: int, requests: int, tokens: int) -> list[list[tuple[str, int]]]:
    """Per stream, its requests in turn: distinct prompts, lengths that differ between streams and
    requests, so that streams end (leave the batch) and start again (join it) at different steps."""
    return [[(f"Stream {s} request {r}: the colours of the sky are", tokens + 3 * s + 5 * r)
             for r in range(requests)] for s in range(streams)]


def run_load(url: str, plan: list[list[tuple[str, int]]]) -> dict[str, list[int]]:
    """Every stream's requests, the streams in parallel; the greedy tokens of each request."""
    tokens: dict[str, list[int]] = {}
    errors: list[str] = []

    def stream(requests: list[tuple[str, int]]) -> None:
        for prompt, n in requests:
            body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "seed": 7,
                               "cache_prompt": False, "return_tokens": True, "ignore_eos": True}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    tokens[prompt] = [int(t) for t in json.load(r)["tokens"]]
            except OSError as e:
                errors.append(f"{prompt}: {e}")

    threads = [threading.Thread(target=stream, args=(requests,)) for requests in plan]
    for i, t in enumerate(threads):
        t.start()
        if i + 1 < len(threads):
            time.sleep(0.3)  # streams start at different steps too
    for t in threads:
        t.join()
    if errors:
        raise SystemExit("requests failed: " + "; ".join(errors))
    return tokens


def count(records: list[apir_trace.Record]) -> dict[str, Any]:
    """The synchronous calls of a traced session. Decode steps are graph computes; the queries
    before the first compute (loading, the first graph) are the same in every run and counted apart."""
    forwarded = [r for r in records if r.cmd_type == apir_trace.protocol.CommandType.FORWARD]
    computes = [i for i, r in enumerate(forwarded)
                if r.name == "backend_graph_compute" or ((found := r.graph_run()) and found[0].graph_id)]
    first = computes[0] if computes else len(forwarded)
    later = forwarded[first + 1:]
    summary = apir_trace.summarize(records)
    steps = len(computes) - 1
    queries = sum(1 for r in later if r.name in QUERIES)
    others = sum(1 for r in later if r.name not in QUERIES) - steps  # every call after the first but the computes
    return {
        "decode_steps": steps,
        "queries_before_first_compute": sum(1 for r in forwarded[:first] if r.name in QUERIES),
        "queries_after": queries,
        "queries_after_by_function": {name: sum(1 for r in later if r.name == name) for name in QUERIES},
        "queries_per_step": round(queries / steps, 3) if steps else None,
        "other_calls_after": others,
        "other_calls_after_by_function": dict(sorted(Counter(
            r.name for r in later if r.name not in QUERIES and r.name not in ("ext_graph_run",
                                                                               "backend_graph_compute")).items())),
        "round_trips_per_step": round((queries + others + steps) / steps, 3) if steps else None,
        "graphs_sent": summary.graph_cache.sent,
        "graph_deltas": summary.graph_cache.delta,
        "graph_deltas_refused": summary.graph_cache.delta_refused,
        "graphs_unknown": summary.graph_cache.unknown,
        "graph_bytes_per_step": round(summary.graph_bytes_per_compute or 0, 1),
    }


def measure(bin_dir: Path, model: Path, streams: int, requests: int, tokens: int) -> dict[str, Any]:
    plan = request_plan(streams, requests, tokens)
    with tempfile.TemporaryDirectory(prefix="apir-queries-") as tmp:
        workdir = Path(tmp)
        os.chmod(workdir, 0o700)
        with llama_server(bin_dir, model, workdir, streams, None, {}) as url:
            native = run_load(url, plan)
        row: dict[str, Any] = {"streams": streams, "requests": streams * requests}
        for name, env in MODES:
            trace = workdir / f"trace-{name}.bin"
            with apir_host(bin_dir, workdir, trace) as path, \
                    llama_server(bin_dir, model, workdir, streams, path,
                                 {**env, "GGML_VIRTGPU_SHARED_BUFFERS": "0"}) as url:
                remote = run_load(url, plan)
            row[name] = {**count(apir_trace.read(trace.read_bytes())),
                         "tokens_equal_native": remote == native,
                         "requests_differing": sorted(p for p in native if remote.get(p) != native[p])}
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", type=Path, required=True, help="a build's bin dir (llama-server, apir-host)")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=3, help="requests per stream, in turn")
    parser.add_argument("--tokens", type=int, default=12, help="tokens of the shortest request")
    parser.add_argument("--series", default=None, help="the build's patch-series digest (default: this checkout's)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    for exe in ("llama-server", "apir-host"):
        if not (args.bin_dir / exe).exists():
            raise SystemExit(f"error: no {exe} in {args.bin_dir}\nhint: --bin-dir is a build's bin directory")
    if not args.model.is_file():
        raise SystemExit(f"error: no model at {args.model}\nhint: --model is a GGUF file")
    rows = [measure(args.bin_dir, args.model, n, args.requests, args.tokens) for n in args.streams]
    result = {
        "what": "benchmarks/apir_serving_queries.py: synchronous calls and graph bytes per decode step through "
                "apir-host (CPU): answers kept per exact shape, per op class, and per op class with graph deltas",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "series": args.series or llamacpp.patches_digest(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "model": args.model.name,
        "setup": {"requests_per_stream": args.requests, "shortest_request_tokens": args.tokens, "threads": 1,
                  "repetitions": 1, "native_first": True, "modes": {name: env for name, env in MODES}},
        "rows": rows,
    }
    emit(result, args.json, indent=1)


if __name__ == "__main__":
    main()
