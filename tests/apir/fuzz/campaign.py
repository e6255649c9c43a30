"""Run the APIR dispatch fuzzer from the committed seed corpus and summarise what it did.

    python -m tests.apir.fuzz.campaign FUZZER --runs 1000000          # the long run (about an hour on 2 cores)
    python -m tests.apir.fuzz.campaign FUZZER --runs 20000 --json     # what the test runs

The seeds (corpus/, made from a real trace by seeds_from_trace.py) are copied into a working corpus
first, so the committed one never changes. libFuzzer stops at the first finding: a sanitizer report,
a signal, an abort, a leak (unless --no-leaks), an input slower than --timeout seconds, or more memory
than --rss-limit-mb; the input is written to the artifacts folder (crash-*, leak-*, timeout-*, oom-*)
and replays with `FUZZER FILE`. Prints the inputs run, executions per second, coverage (edges, as
libFuzzer's `cov:`), corpus size, and the findings with their first report lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
REGRESSIONS = HERE / "regressions"
STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)")
STAT = re.compile(r"^stat::(\w+):\s+(\d+)")
REPORT = re.compile(r"(ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|ERROR: libFuzzer|"
                    r"==\d+== ?ERROR|GGML_ASSERT|terminate called|apir-fuzz: .*outside)")


@dataclass
class Result:
    inputs: int = 0
    seconds: float = 0.0
    exec_per_sec: int = 0
    edges: int = 0
    features: int = 0
    corpus: int = 0
    returncode: int = 0
    findings: list[str] = field(default_factory=list)  # artifact files
    reports: list[str] = field(default_factory=list)  # the report lines of the finding
    log_tail: str = ""

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and not self.findings and not self.reports


def environment(leaks: bool) -> dict[str, str]:
    return {**os.environ,
            "ASAN_OPTIONS": f"detect_leaks={int(leaks)}:allocator_may_return_null=1:handle_abort=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def parse(log: str, result: Result) -> None:
    for line in log.splitlines():
        if m := STATUS.match(line):
            result.inputs = max(result.inputs, int(m.group(1)))
            result.edges, result.features, result.corpus = int(m.group(2)), int(m.group(3)), int(m.group(4))
        elif m := STAT.match(line):
            if m.group(1) == "number_of_executed_units":
                result.inputs = int(m.group(2))
            elif m.group(1) == "average_exec_per_sec":
                result.exec_per_sec = int(m.group(2))
        elif REPORT.search(line) and len(result.reports) < 12:
            result.reports.append(line.strip()[:300])


def run(fuzzer: Path, runs: int, artifacts: Path, seed: int = 1, max_total_time: int = 0, timeout: int = 30,
        rss_limit_mb: int = 4096, leaks: bool = True, corpus: Path | None = None, nice: bool = True) -> Result:
    """One libFuzzer run of `runs` inputs (or `max_total_time` seconds) from a copy of the seeds."""
    artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="apir-fuzz-corpus-") as tmp:
        work = corpus if corpus is not None else Path(tmp)
        for seed_file in CORPUS.iterdir() if CORPUS.is_dir() else []:
            shutil.copy(seed_file, work / seed_file.name)
        cmd = [*(["nice", "-n", "10"] if nice else []), str(fuzzer), str(work), f"-runs={runs}", f"-seed={seed}",
               f"-timeout={timeout}", f"-rss_limit_mb={rss_limit_mb}", f"-malloc_limit_mb={rss_limit_mb}",
               f"-detect_leaks={int(leaks)}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
               "-close_fd_mask=1", "-max_len=65536"]
        if max_total_time:
            cmd.append(f"-max_total_time={max_total_time}")
        before = set(artifacts.iterdir())
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=environment(leaks))
        result = Result(seconds=round(time.monotonic() - start, 1), returncode=done.returncode)
        parse(done.stderr, result)
        result.findings = sorted(str(p) for p in set(artifacts.iterdir()) - before)
        result.log_tail = done.stderr[-4000:]
        return result


def replay(fuzzer: Path, inputs: list[Path], leaks: bool = True) -> subprocess.CompletedProcess[str]:
    """Run each input once (regression inputs, or a finding to look at)."""
    return subprocess.run([str(fuzzer), *map(str, inputs)], capture_output=True, text=True, errors="replace",
                          env=environment(leaks), timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fuzzer", type=Path)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--max-total-time", type=int, default=0, help="seconds; 0: no limit")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=30, help="seconds an input may take")
    parser.add_argument("--no-leaks", action="store_true", help="do not count leaks as findings")
    parser.add_argument("--artifacts", type=Path, default=Path("apir-fuzz-artifacts"))
    parser.add_argument("--corpus", type=Path, help="a corpus folder to grow (default: a temporary copy)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.fuzzer, args.runs, args.artifacts.resolve(), args.seed, args.max_total_time, args.timeout,
                 leaks=not args.no_leaks, corpus=args.corpus)
    if args.json:
        print(json.dumps({**asdict(result), "clean": result.clean}, indent=2))
        return
    print(f"inputs {result.inputs}  time {result.seconds} s  exec/s {result.exec_per_sec}  edges {result.edges}  "
          f"features {result.features}  corpus {result.corpus}  exit {result.returncode}")
    for line in result.reports:
        print("  report:", line)
    for path in result.findings:
        print("  finding:", path)
    print("clean" if result.clean else "FINDINGS")


if __name__ == "__main__":
    main()
