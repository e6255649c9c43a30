"""`apirctl perplexity`: llama-perplexity on one text in each mode, each compared with native."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

HELP = (
    "Check that a path changes none of the model's numbers: llama-perplexity on the same text in each mode.\n\n"
    "apirctl perplexity MODEL runs llama-perplexity natively, in a container and through remoting (the modes of "
    "`apirctl bench`; apir only when named) with the same settings, and shows each mode's perplexity beside "
    "native's. A mode whose perplexity differs from native's by more than 1e-4 (relative) is flagged: the table "
    "says `differs`, the JSON row has \"matches_native\": false, and the command exits 1 after printing the "
    "results (a mode that could not run is skipped with the reason and does not fail the command).\n\n"
    "The text is --file, or a short text that ships with apirctl; nothing is downloaded. Results are saved with "
    "the benchmarks: `apirctl bench history`, `apirctl bench compare ID ID`.\n\n"
    "Examples:\n\n"
    "`apirctl perplexity smollm2`\n\n"
    "`apirctl perplexity smollm2 --modes native,remoting,apir --json`\n\n"
    "`apirctl perplexity model.gguf --file notes.txt --ctx-size 512 --chunks 4`"
)


def perplexity(
    model: str = typer.Argument(None, help="Model: alias (smollm2), GGUF path, hf://, ollama://, https://."),
    file: str = typer.Option(None, "--file", help="Text to score [default: the text shipped with apirctl]."),
    modes: str = typer.Option("native,container,remoting", "--modes",
                              help="Comma-separated modes, in order: native (the reference), container, remoting, "
                                   "apir."),
    ctx_size: int = typer.Option(128, "--ctx-size", "-c", help="Context of each chunk (the text needs two)."),
    chunks: int = typer.Option(None, "--chunks", help="Score at most this many chunks [default: all]."),
    ngl: int = typer.Option(None, "--ngl", help="Layers offloaded to the GPU backend [default: setting ngl]."),
    threads: int = typer.Option(None, "--threads", "-t", help="CPU threads [default: setting threads]."),
    client: str = typer.Option("container", "--client",
                               help="Where remoting's llama-perplexity runs: container or host (as for bench)."),
    fmt: str = typer.Option("table", "--format", help="Output: table, json, csv or md."),
    json_: bool = typer.Option(False, "--json", help="Same as --format json."),
    save: bool = typer.Option(True, "--save/--no-save", help="Save the results to the benchmark history."),
    ctx_size_for: Annotated[list[str] | None, typer.Option(
        "--ctx-size-for", hidden=True, help="MODE=N: another context size for one mode (tests the flag).")] = None,
) -> None:
    from apirctl import config
    from apirctl.bench import modes as bench_modes
    from apirctl.bench import perplexity as ppl
    from apirctl.bench import report, results
    from apirctl.cli.bench import _print_run, _progress
    from apirctl.errors import ApirctlError

    output = report.check_format("json" if json_ else fmt)
    chosen = bench_modes.parse_modes(modes)
    ppl.check_modes(chosen)
    if client not in bench_modes.CLIENTS:
        raise ApirctlError(f"unknown --client {client!r} (known: {', '.join(bench_modes.CLIENTS)})")
    settings = config.settings(ngl=ngl, threads=threads)
    params = ppl.Params(ctx_size=ctx_size, chunks=chunks, ngl=settings.ngl, threads=settings.threads,
                        ctx_for=ppl.parse_ctx_for(ctx_size_for or []))
    params.validate()
    text = ppl.read_text(Path(file) if file else None)
    model_file = bench_modes.model_file(model or settings.default_model)
    with _progress() as progress:
        task = progress.add_task("starting", total=len(chosen))

        def on_event(mode: str, what: str, done: int, total: int) -> None:
            index = chosen.index(mode)
            step = done / total if what and total else 0.0
            label = f"{mode} · chunk {done}/{total}" if what else f"{mode}: starting"
            progress.update(task, completed=index + step, description=label)

        outcome = ppl.run(model_file.label, model_file.path, chosen, params, text=text if file else None,
                          on_event=on_event, filename=model_file.filename, client=client)
    run = outcome.run
    measured = [r for r in run.rows if r.ppl is not None]
    if not measured and not outcome.failures:
        raise ApirctlError("no mode could run here: " + "; ".join(report.skipped_notes(run)))
    if measured and save:
        results.save(run)
    if measured:
        _print_run(run, output, saved=save, plot=None)
    _verdict(run, outcome)


def _verdict(run: Any, outcome: Any) -> None:
    """Exit non-zero where a script must not go on: a failed mode, no native value, a mode that differs."""
    from apirctl.bench.perplexity import REFERENCE, TOLERANCE
    from apirctl.errors import ApirctlError

    problems = list(outcome.failures)
    reference = next((r for r in run.rows if r.mode == REFERENCE), None)
    if reference is None or reference.ppl is None:
        problems.append(f"no {REFERENCE} perplexity to compare with"
                        + (f" ({reference.skipped_reason})" if reference and reference.skipped_reason
                           and not reference.skipped_reason.startswith("failed") else ""))
    for row in run.rows:
        if row.mode in outcome.differing and row.ppl_rel_diff is not None:
            problems.append(f"{row.mode}'s perplexity differs from {REFERENCE}'s by {row.ppl_rel_diff:+.1e} "
                            f"(more than {TOLERANCE:g} relative)")
    if problems:
        raise ApirctlError("; ".join(problems), hint="the table (or --json) shows each mode's value and settings"
                           if outcome.differing else None)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(perplexity)
