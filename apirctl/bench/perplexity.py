"""Perplexity in each mode: llama-perplexity on one text, natively, in a container and through remoting.

A remoting path must not change a single number of the model's output. Greedy tokens show gross
errors only; perplexity over a text is one number that moves with every logit, so each mode runs
llama-perplexity on the same text with the same settings (`apirctl.bench.modes` decides how each mode
runs it), and a mode whose perplexity differs from native by more than `TOLERANCE` (relative) is
flagged. The comparison uses llama-perplexity's mean negative log-likelihood (`--ppl-output-type 1`
prints it with six decimals, where the perplexity has four), so the check sees relative differences
well below the tolerance.

The default text (`perplexity.txt`, original prose shipped with apirctl) is short: a few chunks of the
default context, seconds per mode on a small CPU. Nothing is downloaded.
"""

from __future__ import annotations

import math
import re
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from apirctl.bench import modes as bench_modes
from apirctl.bench.llamabench import ProgressFn
from apirctl.bench.results import Row, Run, new_id, now_iso
from apirctl.errors import ApirctlError, tail
from apirctl.podman.containers import BindMount

#: A mode whose perplexity differs from native's by more than this (relative) is flagged.
TOLERANCE = 1e-4
#: The modes run when none are named: apir (Linux) only when asked for, as in `apirctl bench`.
DEFAULT_MODES = ("native", "container", "remoting")
#: The reference every other mode is compared with.
REFERENCE = "native"
#: The text shipped with apirctl.
DEFAULT_TEXT = Path(__file__).with_name("perplexity.txt")
#: Where a container finds the text.
CONTAINER_TEXT = "/data/perplexity.txt"
#: The row's test name (one row per mode).
TEST = "perplexity"

# --ppl-output-type 1 prints, per chunk: position, perplexity so far, mean NLL so far, its standard error.
# On its own line on stdout; a container's log may glue it to the end of a partial stderr line (the ETA).
_CHUNK = re.compile(r"(?:^|\s)\d+\s+(\d+\.\d+)\s+(-?\d+\.\d+)\s+\S+\s*$")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
_FINAL = re.compile(r"Final estimate: PPL = (\S+) \+/- (\S+)")
_TOO_SHORT = re.compile(r"you need at least (\d+) tokens to evaluate perplexity with a context of (\d+)")
_HAS_ONLY = re.compile(r"tokenizes to only (\d+) tokens")


@dataclass(frozen=True)
class Params:
    """The settings of every mode's run; `ctx_for` changes one mode's context size (the tests' wrong setting)."""

    ctx_size: int = 128
    chunks: int | None = None
    ngl: int = 999
    threads: int | None = None
    ctx_for: dict[str, int] = field(default_factory=dict)

    def validate(self) -> None:
        for what, value in [("--ctx-size", self.ctx_size), *((f"the context size of {m}", v)
                                                              for m, v in self.ctx_for.items())]:
            if value < 8:
                raise ApirctlError(f"{what} must be at least 8 (got {value})")
        if self.chunks is not None and self.chunks < 1:
            raise ApirctlError("--chunks must be at least 1")
        if self.ngl < 0:
            raise ApirctlError("--ngl must be 0 or more")
        if self.threads is not None and self.threads < 1:
            raise ApirctlError("--threads must be at least 1")
        unknown = sorted(set(self.ctx_for) - set(bench_modes.MODES))
        if unknown:
            raise ApirctlError(f"unknown mode {unknown[0]!r} in a per-mode context size "
                               f"(known: {', '.join(bench_modes.MODES)})")

    def ctx_of(self, mode: str) -> int:
        return self.ctx_for.get(mode, self.ctx_size)


def parse_ctx_for(items: Sequence[str]) -> dict[str, int]:
    """`["container=64"]` -> {"container": 64}; anything else is a one-line error."""
    out: dict[str, int] = {}
    for item in items:
        mode, _, value = item.partition("=")
        try:
            out[mode.strip().lower()] = int(value)
        except ValueError:
            raise ApirctlError(f"--ctx-size-for {item!r}: expected MODE=N, e.g. container=64") from None
    return out


@dataclass
class Estimate:
    """One run of llama-perplexity: the mean negative log-likelihood and what it covered."""

    nll: float
    ppl_printed: float
    uncertainty: float | None
    chunks: int
    ctx_size: int | None
    backends: str = ""

    @property
    def ppl(self) -> float:
        """exp(mean NLL): two more digits than the perplexity llama-perplexity prints."""
        return math.exp(self.nll)


def parse(output: str) -> Estimate:
    """llama-perplexity's output (its stdout and stderr, in any order of lines) -> the final estimate."""
    chunks = [m for line in output.splitlines() if (m := _CHUNK.search(line))]
    short = _TOO_SHORT.search(output)
    if short:
        has = _HAS_ONLY.search(output)
        got = f" it has {has.group(1)}" if has else ""
        raise ApirctlError(f"the text is too short for a context of {short.group(2)}: it needs "
                           f"{short.group(1)} tokens,{got}", hint="use a longer --file or a smaller --ctx-size")
    if not chunks:
        raise ApirctlError(f"llama-perplexity printed no perplexity: {tail(output, telling=('error', 'failed'))}")
    final = _FINAL.search(output)
    sized = _CHUNKS.search(output)
    last = chunks[-1]
    return Estimate(nll=float(last.group(2)), ppl_printed=float(last.group(1)),
                    uncertainty=float(final.group(2)) if final else None,
                    chunks=int(sized.group(1)) if sized else len(chunks),
                    ctx_size=int(sized.group(2)) if sized else None)


class ChunkReader:
    """Turns llama-perplexity's lines into progress (chunk i of n) and keeps a tail for errors."""

    def __init__(self, on_progress: ProgressFn | None, keep: int = 20) -> None:
        self.on_progress = on_progress
        self.total = 0
        self.done = 0
        self.tail: deque[str] = deque(maxlen=keep)

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        sized = _CHUNKS.search(line)
        if sized:
            self.total = int(sized.group(1))
        elif _CHUNK.search(line):
            self.done += 1
            if self.on_progress:
                self.on_progress("chunk", self.done, max(self.total, self.done))
            return
        if line.strip():
            self.tail.append(line)

    def tail_text(self, lines: int = 5) -> str:
        return " | ".join(tail("\n".join(self.tail), lines, telling=("error", "failed")).splitlines())


@dataclass(frozen=True)
class LlamaPerplexity:
    """llama-perplexity as the program of `apirctl.bench.modes`, on one text file."""

    params: Params
    text: Path
    executable: str = "llama-perplexity"

    @property
    def ngl(self) -> int:
        return self.params.ngl

    def arguments(self, model: str, mode: str, in_container: bool, extra: Sequence[str] = ()) -> list[str]:
        text = CONTAINER_TEXT if in_container else str(self.text)
        args = ["-m", model, "-f", text, "-c", str(self.params.ctx_of(mode)), "-ngl", str(self.params.ngl),
                "--ppl-output-type", "1"]
        if self.params.chunks is not None:
            args += ["--chunks", str(self.params.chunks)]
        if self.params.threads is not None:
            args += ["-t", str(self.params.threads)]
        return args + list(extra)

    def mounts(self) -> list[BindMount]:
        return [BindMount(source=self.text.resolve(), target=CONTAINER_TEXT, read_only=True)]

    def reader(self, on_progress: ProgressFn | None) -> ChunkReader:
        return ChunkReader(on_progress)

    def run_host(self, argv: Sequence[str], on_progress: ProgressFn | None,
                 env: dict[str, str] | None = None) -> list[Estimate]:
        """Run it here, its two streams as one (the numbers on stdout, the reasons on stderr)."""
        reader = self.reader(on_progress)
        try:
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env, errors="replace")
        except OSError as exc:
            raise ApirctlError(f"cannot start {argv[0]}: {exc}") from None
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            reader.feed(line)
        code = proc.wait()
        if code != 0:
            raise ApirctlError(f"llama-perplexity failed (exit {code}): {reader.tail_text() or 'no output'}")
        return self.parse_output("".join(lines))

    def parse_output(self, output: str) -> list[Estimate]:
        return [parse(output)]


def check_modes(modes: Sequence[str]) -> None:
    """Every mode is compared with native: a list without it has nothing to compare with."""
    if REFERENCE not in modes:
        raise ApirctlError(f"perplexity compares each mode with {REFERENCE}: include it in --modes",
                           hint=f"e.g. --modes {','.join([REFERENCE, *modes])}")


def read_text(path: Path | None) -> Path:
    """The text to score: the file given, or the one shipped with apirctl."""
    chosen = path or DEFAULT_TEXT
    if not chosen.is_file():
        raise ApirctlError(f"text file {chosen} does not exist", hint="give a UTF-8 text file with --file")
    return chosen


@dataclass
class Outcome:
    """A finished comparison: the run to print and save, what failed, and the modes that differ."""

    run: Run
    failures: list[str]
    differing: list[str]


def rows_from(outcomes: list[bench_modes.ModeOutcome[Estimate]], params: Params) -> list[Row]:
    """One row per mode; each with its relative difference from native and whether it is within TOLERANCE."""
    reference = next((o.results[0] for o in outcomes if o.mode == REFERENCE and o.results), None)
    rows: list[Row] = []
    for outcome in outcomes:
        row = Row(mode=outcome.mode, backend=outcome.backend, client=outcome.client, transport=outcome.transport,
                  test=TEST, ctx_size=params.ctx_of(outcome.mode))
        if not outcome.results:
            row.skipped_reason = outcome.skipped or (f"failed: {outcome.failed}" if outcome.failed else "no results")
        else:
            est = outcome.results[0]
            diff = math.expm1(est.nll - reference.nll) if reference is not None else None
            row.ppl, row.ppl_error, row.nll, row.chunks = est.ppl, est.uncertainty, est.nll, est.chunks
            row.ppl_rel_diff = diff
            row.matches_native = None if diff is None else abs(diff) <= TOLERANCE
        rows.append(row)
    return rows


EventFn = Callable[[str, str, int, int], None]


def run(model_ref: str, model_path: Path, modes: Sequence[str], params: Params, text: Path | None = None,
        on_event: EventFn | None = None, filename: str | None = None, client: str = "container") -> Outcome:
    """llama-perplexity in each mode (`apirctl.bench.modes.run_modes`), then each compared with native."""
    params.validate()
    check_modes(modes)
    bench_modes.check_inputs(model_path, client)
    text_path = read_text(text)
    ctx: bench_modes.Context[Estimate] = bench_modes.Context(
        model_path=model_path, program=LlamaPerplexity(params, text_path), on_event=on_event,
        filename=filename or model_path.name, client=client)
    outcomes = bench_modes.run_modes(ctx, modes)
    rows = rows_from(outcomes, params)
    failures = [f"{o.mode}: {o.failed}" for o in outcomes if o.failed]
    differing = [r.mode for r in rows if r.matches_native is False]
    info = bench_modes.system_info(ctx)
    info.extra["text"] = str(text_path) if text else f"{DEFAULT_TEXT.name} (shipped with apirctl)"
    ppl_run = Run(
        id=new_id(), created=now_iso(), kind="perplexity", model=model_ref, model_file=str(model_path),
        params={"ctx_size": params.ctx_size, "ctx_for": params.ctx_for, "chunks": params.chunks, "ngl": params.ngl,
                "threads": params.threads, "modes": list(modes), "client": client, "tolerance": TOLERANCE,
                "text": str(text_path)},
        system=info, rows=rows,
    )
    return Outcome(ppl_run, failures, differing)
