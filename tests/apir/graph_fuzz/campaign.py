"""Run the graph fuzzers (apir_graph_fuzz, rpc_graph_fuzz) and read what they found.

- `run`: one libFuzzer run from a copy of the committed corpus, stopping at the first finding (what
  the CI test and the long campaign use); it counts the graphs the host computed (GFUZZ_STATS).
- `hunt`: libFuzzer's fork mode, going on past findings for a time budget; every crashing input is
  kept. This is how the findings of issue 30 are rediscovered.
- `classify`: replays one finding and names it: the sanitizer's or ggml's report, the kernel that
  failed (the first `ggml_compute_forward_*` frame) and the node's op and types; `issue_finding`
  maps it to the issue's list where it is one of them.

    python -m tests.apir.graph_fuzz.campaign FUZZER --hunt 600 --artifacts DIR     # rediscovery
    python -m tests.apir.graph_fuzz.campaign FUZZER --runs 20000                  # a campaign
    python -m tests.apir.graph_fuzz.campaign FUZZER --classify CRASH...           # read findings
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from tests.apir.fuzz.campaign import Result, parse

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
#: A harness's counts file (graph_gen.h's `counts`): inputs that built a graph, graphs computed, refused,
#: graphs computed after a delta, deltas refused (the APIR harness's EXT_GRAPH_DELTA), kept graphs computed
#: and refused when run by id after a BUFFER_CLEAR (the APIR harness's clears).
COUNTS = struct.Struct("<QQQQQQQ")
ASAN = re.compile(r"ERROR: AddressSanitizer: ([\w-]+)")
ACCESS = re.compile(r"^(READ|WRITE) of size (\d+)", re.M)
UBSAN = re.compile(r"([\w./-]+:\d+):\d+: runtime error: (.*)")
GGML = re.compile(r"([\w./-]+\.(?:c|cpp|h)):(\d+): (GGML_ASSERT\((.*)\) failed|fatal error)")
KERNEL = re.compile(r"#\d+ 0x[0-9a-f]+ in (ggml_rope_cache_init|rotate_pairs|ggml_compute_forward_\w+|ggml_vec_\w+|"
                    r"ggml_graph_plan|quantize_\w+|"
                    r"ggml_cpu_\w+|dequantize_\w+|rpc_server::\w+|apir_\w+)")
ASSERT = re.compile(r"Assertion `(.*)' failed")
NODE = re.compile(r"^\s+t\d+ \*(\S+)\s+(\S+)\s+ne \[([^\]]*)\]", re.M)


def environment(counts: Path | None = None) -> dict[str, str]:
    """Sanitizer options for the fuzzers: an abort is a finding (handle_abort), ggml prints no gdb backtrace;
    with `counts`, each fuzzer process keeps its counts in a file there (read by `read_counts`).

    Leaks are not looked for here: the dispatch fuzzer (tests/apir/fuzz) does that, and the RPC
    server's thread keeps its connection's objects across inputs."""
    env = {**os.environ,
           "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=1:handle_abort=1:symbolize=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "GGML_NO_BACKTRACE": "1", "GFUZZ_STATS": "1"}
    if counts is not None:
        env["GFUZZ_COUNTS"] = str(counts)
    return env


class Counts(NamedTuple):
    built: int  # inputs that built a graph
    computed: int  # graphs the host computed
    refused: int  # graphs the host's checks refused
    deltas_computed: int = 0  # graphs computed after the host updated a kept graph by a delta
    deltas_refused: int = 0  # deltas the host refused
    clears_computed: int = 0  # kept graphs computed by id after a BUFFER_CLEAR of one of their buffers
    clears_refused: int = 0  # runs by id after a clear the host refused (indices out of range)


def read_counts(folder: Path) -> Counts:
    """The counts of every fuzzer process that wrote them in `folder`, summed: a process that ended in a
    finding, or was killed, counts too (the harness maps the file)."""
    total = [0] * len(Counts._fields)
    for f in folder.glob("*.counts"):
        data = f.read_bytes()
        if len(data) >= COUNTS.size:
            total = [a + b for a, b in zip(total, COUNTS.unpack_from(data), strict=True)]
    return Counts(*total)


@dataclass
class Replay:
    """One input run once: the fuzzer's exit, its counts and its log."""

    returncode: int
    counts: Counts
    log: str


def replay(fuzzer: Path, data: Path, timeout: int = 120) -> Replay:
    """`data` through the fuzzer once (libFuzzer's single-input mode), with its counts."""
    with tempfile.TemporaryDirectory(prefix="graph-fuzz-replay-") as tmp:
        # -detect_leaks=0: else libFuzzer runs an input again when its mallocs and frees differ
        done = subprocess.run([str(fuzzer), str(data), "-detect_leaks=0"], capture_output=True, text=True,
                              errors="replace", env=environment(Path(tmp)), timeout=timeout)
        return Replay(done.returncode, read_counts(Path(tmp)), done.stderr[-4000:])


@dataclass
class Campaign:
    """A run's figures: libFuzzer's own (inputs, edges, ...) and the graphs the host computed."""

    fuzzer: str
    result: Result
    graphs_built: int = 0
    graphs_computed: int = 0
    deltas_computed: int = 0  # of graphs_computed's inputs: graphs computed again after a delta
    deltas_refused: int = 0
    clears_computed: int = 0  # kept graphs computed by id after a BUFFER_CLEAR
    clears_refused: int = 0  # runs by id after a clear the host refused


def _seed(work: Path, corpus: Path | None) -> None:
    for seed_file in (corpus or CORPUS).iterdir():
        if seed_file.is_file():
            shutil.copy(seed_file, work / seed_file.name)


def run(fuzzer: Path, runs: int, artifacts: Path, seed: int = 1, max_total_time: int = 0, timeout: int = 20,
        rss_limit_mb: int = 4096, corpus: Path | None = None, max_len: int = 512) -> Campaign:
    """One libFuzzer run of `runs` inputs (or `max_total_time` seconds) from a copy of the corpus."""
    artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="graph-fuzz-corpus-") as tmp:
        work, counts = Path(tmp) / "corpus", Path(tmp) / "counts"
        work.mkdir()
        counts.mkdir()
        _seed(work, corpus)
        cmd = ["nice", "-n", "10", str(fuzzer), str(work), f"-runs={runs}", f"-seed={seed}", f"-timeout={timeout}",
               f"-rss_limit_mb={rss_limit_mb}", f"-malloc_limit_mb={rss_limit_mb}", "-detect_leaks=0",
               f"-artifact_prefix={artifacts}/", "-print_final_stats=1", "-close_fd_mask=1", f"-max_len={max_len}"]
        if max_total_time:
            cmd.append(f"-max_total_time={max_total_time}")
        before = set(artifacts.iterdir())
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=environment(counts))
        result = Result(seconds=round(time.monotonic() - start, 1), returncode=done.returncode)
        parse(done.stderr, result)
        result.findings = sorted(str(p) for p in set(artifacts.iterdir()) - before
                                 if not p.name.startswith("slow-unit-"))
        result.log_tail = done.stderr[-4000:]
        counted = read_counts(counts)
        return Campaign(str(fuzzer), result, counted.built, counted.computed, counted.deltas_computed,
                        counted.deltas_refused, counted.clears_computed, counted.clears_refused)


def hunt(fuzzer: Path, seconds: int, artifacts: Path, seed: int = 1, timeout: int = 10,
         corpus: Path | None = None, max_len: int = 512, jobs: int = 1) -> Campaign:
    """Fork mode for `seconds` with `jobs` children at once: a child that crashes is replaced and its
    input kept in `artifacts`."""
    artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="graph-fuzz-hunt-") as tmp:
        work, counts = Path(tmp) / "corpus", Path(tmp) / "counts"
        work.mkdir()
        counts.mkdir()
        _seed(work, corpus)
        cmd = ["nice", "-n", "10", str(fuzzer), str(work), f"-fork={jobs}", "-ignore_crashes=1", "-ignore_timeouts=1",
               "-ignore_ooms=1", f"-max_total_time={seconds}", f"-seed={seed}", f"-timeout={timeout}",
               "-rss_limit_mb=4096", "-detect_leaks=0", f"-artifact_prefix={artifacts}/", f"-max_len={max_len}",
               "-close_fd_mask=1"]
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=environment(counts),
                              timeout=seconds + 300)
        result = Result(seconds=round(time.monotonic() - start, 1), returncode=done.returncode)
        parse(done.stderr, result)
        # slow-unit-*: inputs libFuzzer reports as slow but within the timeout, not findings
        result.findings = sorted(str(p) for p in artifacts.iterdir() if not p.name.startswith("slow-unit-"))
        result.log_tail = done.stderr[-4000:]
        counted = read_counts(counts)  # every fork-mode child's, those that crashed too
        return Campaign(str(fuzzer), result, counted.built, counted.computed, counted.deltas_computed,
                        counted.deltas_refused, counted.clears_computed, counted.clears_refused)


@dataclass
class Finding:
    """One crashing input, replayed and read."""

    path: str
    kind: str = ""  # heap-buffer-overflow READ, SEGV at pc 0, FPE, GGML_ASSERT, GGML_ABORT, ubsan, timeout
    where: str = ""  # the failing kernel (first ggml_compute_forward_* frame), or the report's file:line
    message: str = ""
    nodes: list[str] = field(default_factory=list)  # "OP type [ne]" of each node of the graph
    mtime: float = 0.0

    @property
    def signature(self) -> str:
        return f"{self.kind} | {self.where} | {self.message[:80]}"


def classify(fuzzer: Path, artifact: Path) -> Finding:
    # libFuzzer's own -timeout names a slow input; the subprocess's is for one that hangs past it
    limit = 5 if artifact.name.startswith("timeout-") else 20  # a known slow input: only its graph is wanted
    try:
        done = subprocess.run([str(fuzzer), str(artifact), f"-timeout={limit}", "-detect_leaks=0"], capture_output=True,
                              text=True, errors="replace", env={**environment(), "GFUZZ_DESCRIBE": "1"}, timeout=90)
        log, returncode = done.stderr, done.returncode
    except subprocess.TimeoutExpired as hung:
        err = hung.stderr or ""
        log, returncode = (err.decode(errors="replace") if isinstance(err, bytes) else err), -1
    found = Finding(str(artifact), mtime=artifact.stat().st_mtime)
    found.nodes = [f"{m.group(1)} {m.group(2)} [{m.group(3)}]" for m in NODE.finditer(log)]
    kernel = KERNEL.search(log)
    found.where = kernel.group(1) if kernel else ""
    if artifact.name.startswith("timeout-") or "ERROR: libFuzzer: timeout" in log or returncode == -1:
        found.kind = "timeout"
    elif m := ASSERT.search(log):
        found.kind, found.message = "assert", m.group(1)  # a C assert(): built in Debug only
    elif m := GGML.search(log):
        found.kind = "GGML_ASSERT" if m.group(3).startswith("GGML_ASSERT") else "GGML_ABORT"
        found.message = (m.group(4) or "fatal error") + f" ({Path(m.group(1)).name}:{m.group(2)})"
    elif m := UBSAN.search(log):
        found.kind, found.message = "ubsan", f"{m.group(2)} ({Path(m.group(1)).name})"
    elif m := ASAN.search(log):
        found.kind = m.group(1)
        if access := ACCESS.search(log):
            found.kind += f" {access.group(1)}"
        if "pc 0x000000000000" in log:
            found.kind += " at pc 0 (a NULL function pointer)"
    elif "deadly signal" in log:
        found.kind = "signal"
    elif returncode == 0:
        found.kind = "no longer reproduces"
    else:
        found.kind = f"exit {returncode}"
    return found


# The findings of issue 30 (against series-0021), and how a classified finding is recognised as one.
ISSUE_FINDINGS = {
    "cpy-heap-overflow": "CPY: the quantizing copy writes past the work buffer",
    "flash-attn-oob-read": "FLASH_ATTN_EXT: V read past its buffer (v->ne[2] unchecked)",
    "flash-attn-sigfpe": "FLASH_ATTN_EXT: nev2 == 0 or nev2 > neq2 divides by zero",
    "rope-odd-ne0": "ROPE with an odd ne0 reads and writes past the end",
    "rope-n-offs": "ROPE: n_offs odd or out of range hits GGML_ASSERT",
    "mul-mat-work-size-wrap": "MUL_MAT: the work size wraps (zero strides), src1's conversion writes past it",
    "norm-softmax-f16-abort": "RMS_NORM, NORM or SOFT_MAX on F16 (or BF16) aborts",
    "cpy-types-abort": "CPY between quantized types, F32 to non-contiguous quantized, I32 to F16 aborts",
    "set-rows-types": "SET_ROWS into F64/I8/I16 (no kernel: a NULL function pointer or an abort)",
    "mul-mat-src0-types": "MUL_MAT with an I32 or F64 src0 (a NULL function pointer)",
}


def issue_finding(f: Finding) -> str | None:
    """The key of ISSUE_FINDINGS that `f` is, or None for a finding the issue does not list."""
    where, kind, msg = f.where, f.kind, f.message
    ops = {n.split()[0] for n in f.nodes}
    memory = kind.startswith(("heap-buffer-overflow", "SEGV", "stack-buffer-overflow", "global-buffer-overflow",
                              "unknown-crash", "heap-use-after-free"))
    if "n_offs" in msg:
        return "rope-n-offs"
    if kind.startswith("FPE") or "division by zero" in msg:
        return "flash-attn-sigfpe" if "flash_attn" in where or ops == {"FLASH_ATTN_EXT"} else None
    if "pc 0" in kind:
        if "set_rows" in where or ops == {"SET_ROWS"}:
            return "set-rows-types"
        if "mul_mat" in where or ops == {"MUL_MAT"}:
            return "mul-mat-src0-types"
        return None
    if memory and "flash_attn" in where and "READ" in kind:
        return "flash-attn-oob-read"
    if memory and "rope" in where and "cache_init" not in where:
        return "rope-odd-ne0"
    if memory and ("dup" in where or "cpy" in where) and "CPY" in ops:
        return "cpy-heap-overflow"
    if memory and "mul_mat" in where:
        return "mul-mat-work-size-wrap"
    if kind in ("GGML_ABORT", "GGML_ASSERT"):
        if any(op in where for op in ("rms_norm", "_norm", "soft_max")) and any(
                " f16 " in n or " bf16 " in n for n in f.nodes):
            return "norm-softmax-f16-abort"
        if ("dup" in where or "cpy" in where) and "CPY" in ops:
            return "cpy-types-abort"
        if "set_rows" in where and kind == "GGML_ABORT":  # not its index assert: an index out of range
            return "set-rows-types"
    return None


def classify_all(fuzzer: Path, artifacts: list[Path]) -> list[Finding]:
    return [classify(fuzzer, a) for a in sorted(artifacts, key=lambda p: p.stat().st_mtime)]


def summary(found: list[Finding], start: float) -> dict[str, object]:
    """Distinct findings (by signature) and the issue's findings rediscovered, with the seconds to the first of each."""
    distinct: dict[str, dict[str, object]] = {}
    rediscovered: dict[str, dict[str, object]] = {}
    for f in found:
        entry = distinct.setdefault(f.signature, {"count": 0, "first": Path(f.path).name, "nodes": f.nodes,
                                                  "seconds": round(f.mtime - start, 1)})
        entry["count"] = int(entry["count"]) + 1  # type: ignore[call-overload]
        key = issue_finding(f)
        if key and key not in rediscovered:
            rediscovered[key] = {"what": ISSUE_FINDINGS[key], "seconds": round(f.mtime - start, 1),
                                 "input": Path(f.path).name, "signature": f.signature}
    return {"distinct": distinct, "rediscovered": rediscovered,
            "not_rediscovered": sorted(set(ISSUE_FINDINGS) - set(rediscovered))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fuzzer", type=Path)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--max-total-time", type=int, default=0)
    parser.add_argument("--hunt", type=int, default=0, help="seconds of fork mode that goes on past findings")
    parser.add_argument("--classify", type=Path, nargs="*", help="read these findings instead of fuzzing")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--artifacts", type=Path, default=Path("graph-fuzz-artifacts"))
    args = parser.parse_args()
    if args.classify:
        for f in classify_all(args.fuzzer, args.classify):
            print(json.dumps({**asdict(f), "issue": issue_finding(f)}))
        return
    start = time.time()
    if args.hunt:
        done = hunt(args.fuzzer, args.hunt, args.artifacts.resolve(), args.seed)
        found = classify_all(args.fuzzer, [Path(p) for p in done.result.findings])
        print(json.dumps({"inputs": done.result.inputs, "graphs_built": done.graphs_built,
                          "graphs_computed": done.graphs_computed, "deltas_computed": done.deltas_computed,
                          "clears_computed": done.clears_computed, "clears_refused": done.clears_refused,
                          "seconds": done.result.seconds,
                          **summary(found, start)}, indent=2))
        return
    done = run(args.fuzzer, args.runs, args.artifacts.resolve(), args.seed, args.max_total_time)
    print(json.dumps({**asdict(done.result), "graphs_built": done.graphs_built,
                      "graphs_computed": done.graphs_computed, "deltas_computed": done.deltas_computed,
                      "deltas_refused": done.deltas_refused, "clears_computed": done.clears_computed,
                      "clears_refused": done.clears_refused, "clean": done.result.clean}, indent=2))


if __name__ == "__main__":
    main()
