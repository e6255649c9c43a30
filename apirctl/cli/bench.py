"""`apirctl bench`: native, remoting and plain-container performance side by side; serving load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

HELP = (
    "Benchmark llama.cpp: native, remoting and container without remoting, side by side.\n\n"
    "apirctl bench MODEL runs llama-bench (prompt processing `pp`, generation `tg`) in each mode "
    "on the same model file and shows tokens/s with the ratio to native:\n\n"
    "- native: the host's llama-bench on the host's GPU backend (the reference);\n"
    "- remoting: llama-bench in the container, its GPU work done on the host through the active "
    "transport (rpc on Linux, virtgpu on macOS); start it with `apirctl machine restart --remoting`;\n"
    "- container: llama-bench in the container without remoting (CPU);\n"
    "- apir (Linux, not run unless named): the ggml-virtgpu frontend (APIR) against an apir-host of its own on a "
    "private socket, in a container without network (or, with --client host, the host's llama-bench);\n"
    "- vm-cpu, vm-remoting, vm-apir (Linux, not run unless named): llama-bench in a micro-VM booted from the "
    "image, on the VM's own CPU, and with its graphs computed on the host by a backend (RPC) or an apir-host "
    "(APIR) of its own.\n\n"
    "A mode that cannot run here is shown as skipped with the reason. Results are saved: see "
    "`apirctl bench history` and `apirctl bench compare ID ID`.\n\n"
    "apirctl bench --url URL (or `--serving` for the running apirctl server) drives an "
    "OpenAI-compatible endpoint with streamed requests at each `--concurrency` level and reports time to "
    "first token, inter-token latency, tokens/s and errors. `apirctl bench MODEL --serving` does it to the "
    "host's own llama-server and to `apirctl serve MODEL` (the container's transport) in turn, native before "
    "and after each container row, and gives the container's tokens/s as a ratio to native's.\n\n"
    "Examples:\n\n"
    "`apirctl bench smollm2 --modes native,container --reps 2`\n\n"
    "`apirctl bench smollm2 --modes native,remoting,apir`\n\n"
    "`apirctl bench smollm2 --modes native,vm-cpu,vm-remoting --reps 1`\n\n"
    "`apirctl bench smollm2 --format json --plot bench.png`\n\n"
    "`apirctl bench --url http://127.0.0.1:1234 --concurrency 1,4,8 --requests 16`\n\n"
    "`apirctl bench smollm2 --serving --transport rpc --concurrency 1,8 --rounds 2`"
)


class _BenchGroup(TyperGroup):
    """`bench MODEL` and `bench history` share one word position: a subcommand name wins.

    Options may follow MODEL (`bench smollm2 --reps 2`), so the group parses interspersed options.
    """

    allow_interspersed_args = True

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            super(TyperGroup, self).parse_args(ctx, [])
            ctx._protected_args, ctx.args = args[:1], args[1:]
            if not isinstance(getattr(type(ctx), "protected_args", None), property):  # older click
                ctx.protected_args = args[:1]
            return list(ctx.args)
        return super().parse_args(ctx, args)


app = typer.Typer(cls=_BenchGroup, help=HELP, rich_markup_mode=None)


@app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: str = typer.Argument(None, help="Model: alias (smollm2), GGUF path, hf://, ollama://, https://."),
    modes: str = typer.Option("native,remoting,container", "--modes",
                              help="Comma-separated modes to run, in order: native, remoting, container, apir, "
                                   "vm-cpu, vm-remoting, vm-apir (a micro-VM on its own CPU, through RPC, and "
                                   "through APIR). With MODEL --serving: native and any of remoting, container, "
                                   "vm-cpu, vm-remoting, vm-apir [default there: native,remoting]."),
    pp: int = typer.Option(512, "--pp", help="Prompt tokens for the prompt-processing test (0: skip it)."),
    tg: int = typer.Option(128, "--tg", help="Tokens to generate for the generation test (0: skip it)."),
    reps: int = typer.Option(5, "--reps", "-r", help="Repetitions of each test (mean and std over them)."),
    ngl: int = typer.Option(None, "--ngl", help="Layers offloaded to the GPU backend [default: setting ngl]."),
    threads: int = typer.Option(None, "--threads", "-t", help="CPU threads [default: llama.cpp's choice]."),
    client: str = typer.Option("container", "--client",
                               help="Where remoting's llama-bench runs: container (the real path; the host when "
                                    "podman is missing) or host (the host build over rpc, no container)."),
    fmt: str = typer.Option("table", "--format", help="Output: table, json, csv or md."),
    json_: bool = typer.Option(False, "--json", help="Same as --format json."),
    plot: str = typer.Option(None, "--plot", help="Also write a bar chart to this PNG (needs apirctl[plot])."),
    save: bool = typer.Option(True, "--save/--no-save", help="Save the results to the history."),
    url: str = typer.Option(None, "--url", help="Serving load against this OpenAI-compatible endpoint."),
    serving: bool = typer.Option(False, "--serving",
                                 help="Serving load: with MODEL, native and `apirctl serve` of it side by side "
                                      "(alternated, with the ratio); without, the running apirctl server."),
    rounds: int = typer.Option(1, "--rounds", help="Serving with MODEL: remoting rows per level, each between "
                                                   "two native rows."),
    transport: str = typer.Option(None, "--transport",
                                  help="Serving with MODEL: the served container's transport, as `serve "
                                       "--transport` [default: serve's choice]."),
    server: str = typer.Option(None, "--server", help="Serving load against this apirctl server (name or id)."),
    concurrency: str = typer.Option("1,4", "--concurrency", help="Serving: concurrency levels, e.g. 1,4,8."),
    requests: int = typer.Option(8, "--requests", help="Serving: requests per concurrency level."),
    prompt_tokens: int = typer.Option(
        128, "--prompt-tokens",
        help="Serving: approximate prompt length; each request's prompt is new to the server (no prompt-cache hits)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Serving: tokens generated per request."),
    time_limit: float = typer.Option(300.0, "--time-limit",
                                     help="Serving: seconds per level; unfinished requests count as errors."),
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from apirctl.bench import report

    output = report.check_format("json" if json_ else fmt)
    if plot is not None:
        report.require_matplotlib()
    if url or serving or server or _serving_flags_given(ctx):
        if plot is not None:
            from apirctl.errors import ApirctlError

            raise ApirctlError("--plot draws llama-bench runs; serving results are tables only")
        if serving and model and not (url or server):
            _serving_compared(model, output, save, concurrency, requests, prompt_tokens, max_tokens, time_limit,
                              rounds, transport, modes if _given(ctx, "modes") else None)
            return
        _serving(url, server, model, output, save, concurrency, requests, prompt_tokens, max_tokens, time_limit)
        return
    _llama_bench(model, modes, pp, tg, reps, ngl, threads, output, Path(plot) if plot else None, save, client)


def _given(ctx: typer.Context, name: str) -> bool:
    return getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")


def _serving_flags_given(ctx: typer.Context) -> bool:
    """`apirctl bench --concurrency 1,4` (serving flags, no --url): load the running apirctl server."""
    names = ("concurrency", "requests", "prompt_tokens", "max_tokens", "time_limit")
    given = any(_given(ctx, n) for n in names)
    return given and ctx.params.get("model") is None


def _llama_bench(model: str | None, modes: str, pp: int, tg: int, reps: int, ngl: int | None,
                 threads: int | None, output: str, plot: Path | None, save: bool, client: str = "container") -> None:
    from apirctl import config
    from apirctl.bench import modes as bench_modes
    from apirctl.bench import report, results
    from apirctl.bench.llamabench import Params
    from apirctl.errors import ApirctlError

    chosen = bench_modes.parse_modes(modes)
    if client not in bench_modes.CLIENTS:
        raise ApirctlError(f"unknown --client {client!r} (known: {', '.join(bench_modes.CLIENTS)})")
    settings = config.settings(ngl=ngl, threads=threads)
    params = Params(pp=pp, tg=tg, reps=reps, ngl=settings.ngl, threads=settings.threads)
    params.validate()
    ref = model or settings.default_model
    model_file = bench_modes.model_file(ref)
    with _progress() as progress:
        per_mode = max(len(params.tests()) * params.reps, 1)
        task = progress.add_task("starting", total=per_mode * len(chosen))

        def on_event(mode: str, test: str, rep: int, total: int) -> None:
            index = chosen.index(mode)
            if not test:
                progress.update(task, completed=index * per_mode, description=f"{mode}: starting")
                return
            tests = params.tests()
            done = index * per_mode + (tests.index(test) if test in tests else 0) * params.reps + max(rep - 1, 0)
            what = "warmup" if rep == 0 else f"rep {rep}/{total}"
            progress.update(task, completed=done, description=f"{mode} · {test} · {what}")

        outcome = bench_modes.run(model_file.label, model_file.path, chosen, params, on_event=on_event,
                                  filename=model_file.filename, client=client)
    run = outcome.run
    measured = any(r.tps_mean is not None for r in run.rows)
    if not measured and not outcome.failures:
        raise ApirctlError("no mode could run here: " + "; ".join(report.skipped_notes(run)))
    if measured and save:
        results.save(run)
    if measured and plot is not None:
        report.plot(run, plot)
    if measured:
        _print_run(run, output, saved=save, plot=plot)
    if outcome.failures:
        raise ApirctlError("; ".join(outcome.failures))


def _serving(url: str | None, server: str | None, model: str | None, output: str, save: bool, concurrency: str,
             requests: int, prompt_tokens: int, max_tokens: int, time_limit: float) -> None:
    from apirctl.bench import load, results

    params = load.LoadParams(concurrency=load.parse_concurrency(concurrency), requests=requests,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens, time_limit=time_limit)
    params.validate()
    target = url or load.running_server_url(server)
    with _progress() as progress:
        task = progress.add_task("connecting", total=len(params.concurrency) * params.requests)

        def on_progress(conc: int, done: int, total: int) -> None:
            level = params.concurrency.index(conc)
            progress.update(task, completed=level * params.requests + done,
                            description=f"concurrency {conc} · {done}/{total} requests")

        run = load.bench(target, params, on_progress, label=model)
    if save:
        results.save(run)
    _print_run(run, output, saved=save, plot=None)


def _serving_compared(model: str, output: str, save: bool, concurrency: str, requests: int, prompt_tokens: int,
                      max_tokens: int, time_limit: float, rounds: int, transport: str | None,
                      modes: str | None) -> None:
    from apirctl.bench import load, results, serving
    from apirctl.bench import modes as bench_modes

    params = load.LoadParams(concurrency=load.parse_concurrency(concurrency), requests=requests,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens, time_limit=time_limit)
    params.validate()
    served = serving.parse_modes(modes) if modes else list(serving.DEFAULT_MODES)
    model_file = bench_modes.model_file(model)
    rows_per_level = 1 + 2 * rounds * len(served)
    with _progress() as progress:
        task = progress.add_task("starting native and remoting servers",
                                 total=len(params.concurrency) * rows_per_level * params.requests)
        state = {"row": -1}

        def on_event(mode: str, conc: int, round_: int) -> None:
            if mode != "ready":
                state["row"] += 1
                progress.update(task, completed=state["row"] * params.requests,
                                description=f"concurrency {conc} · {mode}" + (f" · round {round_}" if round_ else ""))

        def on_progress(conc: int, done: int, total: int) -> None:
            progress.update(task, completed=state["row"] * params.requests + done)

        run = serving.compare(model_file, params, modes=served, rounds=rounds, transport=transport,
                              on_event=on_event, on_progress=on_progress)
    if save:
        results.save(run)
    _print_run(run, output, saved=save, plot=None)


def _progress() -> Any:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from apirctl.cli.output import err_console

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=err_console(), transient=True)


def _print_run(run: Any, output: str, saved: bool, plot: Path | None) -> None:
    import sys

    from apirctl.bench import report
    from apirctl.cli.output import console, err_console, print_json

    if output == "json":
        print_json(report.as_json(run))
    elif output == "csv":
        sys.stdout.write(report.as_csv(run))
    elif output == "md":
        sys.stdout.write(report.as_markdown(run))
    else:
        console().print(report.table(run))
        for note in report.skipped_notes(run):
            console().print(f"[yellow]skipped[/] {note}", soft_wrap=True)
        for note in report.mode_notes(run):
            console().print(f"[cyan]note[/] {note}", soft_wrap=True)
        for lv in run.levels:
            if lv.error_sample:
                console().print(f"[red]errors at concurrency {lv.concurrency}[/]: {lv.error_sample}",
                                soft_wrap=True)
    notes = []
    if plot is not None:
        notes.append(f"chart: {plot}")
    if saved:
        notes.append(f"saved as {run.id} (apirctl bench history)")
    if notes:
        err_console().print("[dim]" + "; ".join(notes) + "[/]", soft_wrap=True)


@app.command()
def history(
    model: str = typer.Option(None, "--model", help="Only runs whose model reference or file contains this."),
    limit: int = typer.Option(20, "--limit", help="How many runs to list (newest first); 0 for all."),
    json_: bool = typer.Option(False, "--json", help="Print the runs as JSON."),
) -> None:
    """List saved benchmark runs, newest first."""
    from apirctl.bench import report, results
    from apirctl.cli.output import console, print_json

    runs = results.history(model, limit or None)
    if json_:
        print_json([report.as_json(r) for r in runs])
        return
    if not runs:
        console().print("no saved benchmarks yet: run `apirctl bench MODEL`")
        return
    console().print(report.history_table(runs))


@app.command()
def compare(
    first: str = typer.Argument(..., help="Id (or unique prefix) of the earlier run."),
    second: str = typer.Argument(..., help="Id (or unique prefix) of the later run."),
    json_: bool = typer.Option(False, "--json", help="Print the changes as JSON."),
) -> None:
    """Show how the numbers changed between two saved runs (b / a - 1)."""
    from apirctl.bench import report, results
    from apirctl.cli.output import console, print_json

    a, b = results.find(first), results.find(second)
    changes = results.compare(a, b)
    if json_:
        print_json({"a": a.id, "b": b.id, "changes": [c.model_dump() for c in changes]})
        return
    console().print(report.compare_table(a, b, changes))
