"""Prompts longer than the micro-batch through APIR, on two builds side by side (patch 0022, issue 31).

A micro-batch that asks for no outputs gives llama.cpp's last layer nodes of 0 rows. Before 0022 the
hosts' node checks refused them and the frontend answered supports_op false, so llama-server ran that
layer on the CPU and read its weights and the output matrix back from the host in every such
micro-batch. This runs the same load on two builds (`--before`, `--after`: bin dirs), natively and
through each build's own apir-host on the CPU (host buffers, a GPU host's path), in alternated passes
(native, before, after, ... native), and counts from each apir-host's trace: ops answered unsupported,
`buffer_get_tensor` calls of more than 1 MiB and their bytes, and the wall time of the load.

    python benchmarks/apir_empty_batches.py --before OLD/bin --after NEW/bin --model MODEL.gguf \\
        [--streams 4] [--ubatch 32] [--passes 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apir_serving_queries import apir_host, emit, free_port, run_load, wait  # noqa: E402

from apirctl import serve  # noqa: E402
from apirctl.apir import trace as apir_trace  # noqa: E402
from apirctl.build import llamacpp  # noqa: E402

# about 160 tokens: five micro-batches of 32, four of them without outputs
PROMPT = " ".join(f"Item {n} of the list is a colour, a river or a town." for n in range(10))


def plan(streams: int, requests: int) -> list[list[tuple[str, int]]]:
    return [[(f"Stream {s} request {r}. {PROMPT}", 8) for r in range(requests)] for s in range(streams)]


@contextlib.contextmanager
def server(bin_dir: Path, model: Path, workdir: Path, streams: int, ubatch: int,
           socket_path: Path | None) -> Iterator[str]:
    """The build's llama-server with micro-batches of `ubatch`, on the APIR device when socket_path is given."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
    if socket_path is not None:
        env |= {"GGML_VIRTGPU_SOCKET": str(socket_path), "GGML_VIRTGPU_SHARED_BUFFERS": "0"}
    args = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "-c", str(512 * streams), "-np", str(streams), "-b", str(ubatch), "-ub", str(ubatch),
            "--no-warmup", "-ngl", "99" if socket_path else "0"]
    log = workdir / f"llama-server-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait("llama-server", lambda: proc.poll() is None and serve.health(url, timeout=2) == "ok", 180)
        yield url
    finally:
        proc.kill()
        proc.wait()


def count(trace: Path) -> dict[str, Any]:
    forwarded = [r for r in apir_trace.read(trace.read_bytes())
                 if r.cmd_type == apir_trace.protocol.CommandType.FORWARD]
    refused = sum(1 for r in forwarded if r.name == "device_supports_op" and r.ok
                  and not r.arguments()["reply"]["supported"])
    large = [int(r.arguments()["request"]["size"]) for r in forwarded if r.name == "buffer_get_tensor"
             and int(r.arguments()["request"].get("size", 0)) > 1 << 20]
    return {"ops_refused": refused, "large_reads": len(large), "large_read_bytes": sum(large)}


def one_pass(name: str, bin_dir: Path, model: Path, workdir: Path, args: argparse.Namespace,
             load: list[list[tuple[str, int]]], native: dict[str, list[int]] | None) -> dict[str, Any]:
    if name == "native":
        with server(bin_dir, model, workdir, args.streams, args.ubatch, None) as url:
            start = time.monotonic()
            tokens = run_load(url, load)
            return {"mode": name, "wall_s": round(time.monotonic() - start, 2), "tokens": tokens}
    trace = workdir / f"trace-{name}-{time.monotonic_ns()}.bin"
    with apir_host(bin_dir, workdir, trace) as path, \
            server(bin_dir, model, workdir, args.streams, args.ubatch, path) as url:
        start = time.monotonic()
        tokens = run_load(url, load)
        wall = time.monotonic() - start
    return {"mode": name, "wall_s": round(wall, 2), **count(trace),
            "tokens_equal_native": native is not None and tokens == native}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="bin dir of the build before the change")
    parser.add_argument("--after", type=Path, required=True, help="bin dir of the build with it")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2, help="requests per stream, in turn")
    parser.add_argument("--ubatch", type=int, default=32, help="llama-server's -b and -ub")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--series-before", default="", help="the --before build's patch-series digest")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    load = plan(args.streams, args.requests)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="apir-empty-") as tmp:
        workdir = Path(tmp)
        os.chmod(workdir, 0o700)
        native_pass = one_pass("native", args.after, args.model, workdir, args, load, None)
        native = native_pass.pop("tokens")
        rows.append(native_pass)
        for _ in range(args.passes):
            for name, bin_dir in (("before", args.before), ("after", args.after)):
                rows.append(one_pass(name, bin_dir, args.model, workdir, args, load, native))
            again = one_pass("native", args.after, args.model, workdir, args, load, None)
            again_tokens = again.pop("tokens")
            again["tokens_equal_first_native"] = again_tokens == native
            rows.append(again)
    natives = [r["wall_s"] for r in rows if r["mode"] == "native"]
    summary = {name: {"wall_s": [r["wall_s"] for r in rows if r["mode"] == name],
                      "ratio_to_native_mean": [round(statistics.mean(natives) / r["wall_s"], 3)
                                               for r in rows if r["mode"] == name]}
               for name in ("before", "after")}
    result = {
        "benchmark": "apir_empty_batches",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "series_after": llamacpp.patches_digest(), "series_before": args.series_before,
        "model": args.model.name, "streams": args.streams, "requests": args.streams * args.requests,
        "ubatch": args.ubatch, "passes": args.passes, "rows": rows, "summary": summary,
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
