"""llama-bench's command line, its JSON output and its progress lines.

We read llama-bench's machine output (`-o json`, or JSON lines), never its table, so a
change of column layout upstream cannot break the numbers. `--progress` makes it print
one stderr line per warmup and repetition, which becomes our progress display.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from apirctl.errors import ApirctlError, tail
from apirctl.podman.containers import BindMount

#: Called with (test, repetition, total repetitions) as llama-bench reports them.
ProgressFn = Callable[[str, int, int], None]

_PROGRESS = re.compile(r"llama-bench: benchmark \d+/\d+: (prompt|generation) run (\d+)/(\d+)")
_WARMUP = re.compile(r"llama-bench: benchmark \d+/\d+: warmup (prompt|generation) run")


@dataclass(frozen=True)
class Params:
    """What a benchmark measures; the same for every mode so that the rows compare."""

    pp: int = 512
    tg: int = 128
    reps: int = 5
    ngl: int = 999
    threads: int | None = None

    def validate(self) -> None:
        if self.pp < 0 or self.tg < 0:
            raise ApirctlError("--pp and --tg must be 0 or more")
        if self.pp == 0 and self.tg == 0:
            raise ApirctlError("nothing to measure: --pp and --tg are both 0")
        if self.reps < 1:
            raise ApirctlError("--reps must be at least 1")
        if self.ngl < 0:
            raise ApirctlError("--ngl must be 0 or more")
        if self.threads is not None and self.threads < 1:
            raise ApirctlError("--threads must be at least 1")

    def tests(self) -> list[str]:
        """The test names llama-bench will report, in its order (prompt tests first)."""
        return ([f"pp{self.pp}"] if self.pp else []) + ([f"tg{self.tg}"] if self.tg else [])


def arguments(model: str, params: Params, extra: Sequence[str] = (), output: str = "json") -> list[str]:
    """llama-bench's arguments (without the program) for one model and one mode.

    `output="jsonl"` (one result object per line) is for a container, whose log mixes
    stdout with stderr: each result line still parses on its own there.
    """
    args = ["-m", model, "-p", str(params.pp), "-n", str(params.tg), "-r", str(params.reps),
            "-ngl", str(params.ngl), "-o", output, "--progress"]
    if params.threads is not None:
        args += ["-t", str(params.threads)]
    return args + list(extra)


@dataclass
class Result:
    """One llama-bench test result (one row of its JSON output)."""

    test: str
    tps_mean: float
    tps_std: float
    samples_ts: list[float]
    backends: str
    n_prompt: int
    n_gen: int
    n_gpu_layers: int | None
    n_threads: int | None
    raw: dict[str, Any] = field(repr=False)


def label_for(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's own test labels: pp512, tg128, pp512+tg128, with `@ dN` for a depth."""
    if n_prompt and n_gen:
        name = f"pp{n_prompt}+tg{n_gen}"
    elif n_prompt:
        name = f"pp{n_prompt}"
    else:
        name = f"tg{n_gen}"
    return f"{name} @ d{n_depth}" if n_depth else name


def parse(stdout: str) -> list[Result]:
    """Parse `-o json` (one array) or `-o jsonl` (one object per line) output."""
    text = stdout.strip()
    if not text:
        raise ApirctlError("llama-bench printed no results")
    items: list[Any]
    try:
        loaded = json.loads(text)
        items = loaded if isinstance(loaded, list) else [loaded]
    except ValueError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as exc:
            raise ApirctlError(f"cannot read llama-bench's JSON output: {exc}") from None
    results = []
    for item in items:
        if not isinstance(item, dict) or "avg_ts" not in item:
            raise ApirctlError("llama-bench's JSON output has an entry without avg_ts")
        n_prompt, n_gen = int(item.get("n_prompt", 0)), int(item.get("n_gen", 0))
        results.append(Result(
            test=label_for(n_prompt, n_gen, int(item.get("n_depth", 0) or 0)),
            tps_mean=float(item["avg_ts"]),
            tps_std=float(item.get("stddev_ts", 0.0)),
            samples_ts=[float(x) for x in item.get("samples_ts", [])],
            backends=str(item.get("backends", "")),
            n_prompt=n_prompt,
            n_gen=n_gen,
            n_gpu_layers=item.get("n_gpu_layers"),
            n_threads=item.get("n_threads"),
            raw=item,
        ))
    return results


def parse_mixed(text: str) -> list[Result]:
    """Results from output where llama-bench's `-o jsonl` lines sit among log lines."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"avg_ts"' in line):
            continue
        try:
            json.loads(line)
        except ValueError:
            continue
        lines.append(line)
    if not lines:
        raise ApirctlError("llama-bench printed no results")
    return parse("\n".join(lines))


class ProgressReader:
    """Turns llama-bench's `--progress` stderr lines into (test, rep, reps) calls; keeps a tail."""

    def __init__(self, params: Params, on_progress: ProgressFn | None, keep: int = 20) -> None:
        self.params = params
        self.on_progress = on_progress
        self.tail: deque[str] = deque(maxlen=keep)

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        m = _PROGRESS.search(line)
        if m:
            if self.on_progress:
                test = f"pp{self.params.pp}" if m.group(1) == "prompt" else f"tg{self.params.tg}"
                self.on_progress(test, int(m.group(2)), int(m.group(3)))
            return
        m = _WARMUP.search(line)
        if m:
            if self.on_progress:
                test = f"pp{self.params.pp}" if m.group(1) == "prompt" else f"tg{self.params.tg}"
                self.on_progress(test, 0, self.params.reps)
            return
        if line.strip() and not line.startswith("llama-bench: benchmark"):
            self.tail.append(line)

    def tail_text(self, lines: int = 5) -> str:
        return " | ".join(tail("\n".join(self.tail), lines).splitlines())


def run_process(argv: Sequence[str], params: Params, on_progress: ProgressFn | None = None,
                env: dict[str, str] | None = None, timeout: float | None = None) -> list[Result]:
    """Run a llama-bench command line (on the host, or `podman run ...`) and parse its JSON.

    stderr is read line by line as it comes, for progress; on failure the error carries
    its last lines, which is where llama-bench says what went wrong.
    """
    reader = ProgressReader(params, on_progress)
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, errors="replace")
    except OSError as exc:
        raise ApirctlError(f"cannot start {argv[0]}: {exc}") from None
    chunks: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        chunks.append(proc.stdout.read())

    out_thread = threading.Thread(target=read_stdout, daemon=True)
    out_thread.start()
    assert proc.stderr is not None
    for line in proc.stderr:
        reader.feed(line)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise ApirctlError(f"llama-bench did not finish within {timeout:.0f} s") from None
    out_thread.join()
    if code != 0:
        raise ApirctlError(f"llama-bench failed (exit {code}): {reader.tail_text() or 'no output'}")
    return parse("".join(chunks))


@dataclass(frozen=True)
class LlamaBench:
    """llama-bench as the program of `apirctl.bench.modes`: JSON on the host, JSON lines in a container."""

    params: Params
    executable: str = "llama-bench"

    @property
    def ngl(self) -> int:
        return self.params.ngl

    def arguments(self, model: str, mode: str, in_container: bool, extra: Sequence[str] = ()) -> list[str]:
        return arguments(model, self.params, extra=extra, output="jsonl" if in_container else "json")

    def mounts(self) -> list[BindMount]:
        return []

    def reader(self, on_progress: ProgressFn | None) -> ProgressReader:
        return ProgressReader(self.params, on_progress)

    def run_host(self, argv: Sequence[str], on_progress: ProgressFn | None,
                 env: dict[str, str] | None = None) -> list[Result]:
        return run_process(argv, self.params, on_progress, env=env)

    def parse_output(self, output: str) -> list[Result]:
        return parse_mixed(output)
