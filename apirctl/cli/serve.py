"""`apirctl serve`, `ps`, `logs`, `stop`: the inference containers (work lives in apirctl.serve)."""

from __future__ import annotations

import contextlib
import sys
import time
from datetime import datetime, timezone
from typing import Any

import typer

SERVE_EPILOG = (
    "Examples:\n\n"
    "  apirctl serve smollm2                      # the demo model, http://127.0.0.1:1234/v1\n\n"
    "  apirctl serve ./model.gguf --port 8080 --transport none\n\n"
    "  apirctl serve smollm2 -- --temp 0.2        # anything after -- goes to llama-server\n\n"
    "  apirctl serve smollm2 --rpc-backend 127.0.0.1:50052 --via-ssh me@gpu-box   # a remote GPU host\n\n"
    "  apirctl serve smollm2 --restart on-failure:3  # Podman restarts it when it fails\n\n"
    "  apirctl serve smollm2 --transport rpc --memory 8g   # 8 GiB at most, its backend pins no more\n\n"
    "  apirctl serve smollm2 --transport virtgpu --apir-trace   # APIR (Linux: an apir-host of its own)\n\n"
    "  apirctl serve smollm2 ./other.gguf --models-max 1   # two models, one port, one loaded at a time\n\n"
    "  apirctl serve --models-dir ~/models --idle-unload 5m   # every GGUF there; unloaded after 5 idle minutes\n\n"
    "  apirctl serve smollm2 --generate kube > smollm2.yaml   # then: podman kube play smollm2.yaml\n\n"
    "  apirctl serve smollm2 --generate quadlet > ~/.config/containers/systemd/smollm2.container"
)

_LLAMA_ARGS = typer.Argument(
    None, metavar="MORE-MODELS... [-- LLAMA-ARGS]", show_default=False,
    help="More models, served together by llama-server's router mode behind one port (a request's `model` "
    "picks one; each loads on first use), then extra llama-server flags after `--`.",
)
_RPC_BACKEND = typer.Option(
    None, "--rpc-backend", metavar="HOST:PORT",
    help="A llama.cpp RPC backend (`apirctl machine restart --remoting --listen tcp` on that host); repeat it to "
    "split the layers across several. Implies --transport rpc.",
)
_GPU_DEVICE = typer.Option(
    None, "--gpu-device", metavar="CDI-NAME|/dev/PATH",
    help="A device to hand to the container: a CDI name (nvidia.com/gpu=all, nvidia.com/gpu=0) or a "
    "/dev path (/dev/dri/renderD128); repeatable. Default: what `apirctl doctor` finds. Implies --transport gpu.",
)
_SSH_OPTION = typer.Option(
    None, "--ssh-option", metavar="KEY=VALUE",
    help="An extra `ssh -o` option for --via-ssh (repeatable), e.g. IdentityFile=~/.ssh/gpu.",
)


# The options `serve` and `run` share, declared once: both start the same server (ServeOptions).
MODEL = typer.Argument(
    None, help="Model: alias (smollm2), .gguf path, hf://, ollama://, https://, pypi://. "
    "Default: the `default_model` setting."
)
PORT = typer.Option(
    None, "--port", "-p",
    help="Host port of the API (above 1024). Default 1234, or the next free one when 1234 is taken.",
)
NAME = typer.Option(None, "--name", "-n", help="Container name (default apirctl-<model>).")
TRANSPORT = typer.Option(
    None, "--transport",
    help="auto (GPU passthrough where the engine can hand the GPU over, else remoting when `apirctl "
    "machine status` is ready, else none; says why), gpu (Linux: the container gets the GPU: CDI or "
    "/dev/dri), virtgpu (API remoting, APIR: macOS through krunkit's virtio-gpu; Linux through an apir-host "
    "of the container's own on a private socket, no network or device needed), rpc (Linux host GPU over "
    "llama.cpp RPC), none (container CPU).",
)
CTX_SIZE = typer.Option(None, "--ctx-size", "-c", help="Context size in tokens (default 4096).")
THREADS = typer.Option(None, "--threads", "-t", help="CPU threads of llama-server (default: its choice).")
TEMPERATURE = typer.Option(None, "--temp", "--temperature", min=0.0, help="Default sampling temperature of the server.")
SEED = typer.Option(None, "--seed", help="Default sampling seed (the same seed repeats an answer).")
MAX_TOKENS = typer.Option(None, "--max-tokens", min=1, help="Default limit of tokens per answer.")
TIMEOUT = typer.Option(None, "--timeout", help="Seconds to wait for the model to load (default 300).")


def serve(
    model: str = MODEL,
    llama_args: list[str] = _LLAMA_ARGS,
    port: int = PORT,
    name: str = NAME,
    transport: str = TRANSPORT,
    image: str = typer.Option(None, "--image", help="Container image (default: apirctl's local llama.cpp image)."),
    ctx_size: int = CTX_SIZE,
    temperature: float = TEMPERATURE,
    seed: int = SEED,
    max_tokens: int = MAX_TOKENS,
    restart: str = typer.Option(
        None, "--restart", metavar="POLICY",
        help="Podman restart policy: no, on-failure[:N], always, unless-stopped.",
    ),
    memory: str = typer.Option(
        None, "--memory", metavar="SIZE",
        help="Memory limit of the container, as Podman's --memory: bytes or a number with k, m, g or t "
        "(binary), e.g. --memory 8g. With --transport rpc it also caps the host memory the container shares "
        "with (and may have pinned by) its own backend. Default: no limit.",
    ),
    generate: str = typer.Option(
        None, "--generate", metavar="FORMAT",
        help="Print the server as a Podman quadlet unit (quadlet) or Kubernetes YAML (kube) instead of "
        "starting it; `podman kube play` or systemd runs it.",
    ),
    ngl: int = typer.Option(None, "--ngl", help="Layers offloaded to the remoted GPU (default 999 = all)."),
    threads: int = THREADS,
    api_key: str = typer.Option(None, "--api-key", help="Require this bearer key on the API."),
    host_ip: str = typer.Option(
        None, "--host-ip", help="Host address the API is published on (default 127.0.0.1: this machine only)."
    ),
    detach: bool = typer.Option(
        True, "--detach/--foreground", "-d/-F",
        help="Return once ready (default), or stay attached to the logs; Ctrl-C then stops the server.",
    ),
    keep: bool = typer.Option(False, "--keep", help="Keep the container when it fails, for inspection."),
    timeout: float = TIMEOUT,
    json_out: bool = typer.Option(False, "--json", help="Print the server as JSON once ready."),
    rpc_backend: list[str] = _RPC_BACKEND,
    gpu_device: list[str] = _GPU_DEVICE,
    via_ssh: str = typer.Option(
        None, "--via-ssh", metavar="USER@HOST[:PORT]",
        help="Reach the --rpc-backend addresses through an SSH tunnel to this host (addresses as it sees "
        "them, e.g. 127.0.0.1:50052). `apirctl stop` closes the tunnel.",
    ),
    insecure_network: bool = typer.Option(
        False, "--insecure-network",
        help="Allow a plain non-loopback --rpc-backend: the RPC protocol has no authentication, so anyone "
        "on that network can use the backend and its host's memory.",
    ),
    ssh_option: list[str] = _SSH_OPTION,
    apir_trace: bool = typer.Option(
        None, "--apir-trace/--no-apir-trace",
        help="Linux virtgpu: the server's apir-host records every APIR command (`apirctl apir trace --server "
        "NAME` decodes it). Default: the apir_trace setting.", show_default=False,
    ),
    metrics: bool = typer.Option(
        True, "--metrics/--no-metrics",
        help="llama-server's Prometheus metrics at /metrics on the server's port (`apirctl ps --stats` "
        "reads them).",
    ),
    models_dir: str = typer.Option(
        None, "--models-dir", metavar="DIR",
        help="Serve every GGUF in DIR (a subdirectory per model of several files) behind one port, instead of "
        "naming models; each is named after its file or subdirectory.",
    ),
    models_max: int = typer.Option(
        None, "--models-max", metavar="N",
        help="Several models: how many stay loaded at once; a request for another unloads the least recently "
        "used (0: no limit; default 4; rpc and virtgpu: 1, each model being a client of their one backend).",
    ),
    idle_unload: str = typer.Option(
        None, "--idle-unload", metavar="DURATION",
        help="Unload a model after this long without requests (30s, 5m, 1h); the next request loads it "
        "again. Default: never.",
    ),
    isolation: str = typer.Option(
        None, "--isolation", metavar="KIND",
        help="container (default) or vm: llama-server of the same image in a QEMU micro-VM that apirctl starts "
        "(KVM; --memory and --cpus size it; --transport rpc or virtgpu computes on a backend or an apir-host of "
        "its own on the host, through memory the VM shares with it). "
        "Default: the isolation setting.", show_default=False,
    ),
    cpus: int = typer.Option(None, "--cpus", min=1, help="vm isolation: the VM's virtual CPUs (default 2)."),
    default_model: str = typer.Option(
        None, "--default-model", metavar="NAME",
        help="Several models: the one a request that names no model goes to (`apirctl ps` shows it). "
        "Default: the first named; with --models-dir, none unless given.",
    ),
) -> None:
    """Start llama-server in a container on a model (or several) and wait until it answers.

    Several models (`serve A B`, or --models-dir) share one container and port: llama-server's router
    mode lists them at /v1/models and loads each on its first request, through the same transport.

    Phases (image, container, loading model) are shown with their time. When ready it prints the
    OpenAI base URL and lines to paste. If the server exits or is not ready in time, its last
    log lines are shown and the container is removed (unless --keep).
    """
    from apirctl import config
    from apirctl import serve as lib
    from apirctl.cli.output import err_console, print_json

    more, llama_args = _split_models(list(llama_args or []))
    first = model or ("" if models_dir else config.settings().default_model)
    opts = lib.options(
        first, models=[first, *more] if more else None, models_dir=models_dir, models_max=models_max,
        idle_unload=idle_unload, router_default=default_model, isolation=isolation, cpus=cpus,
        port=port, name=name, transport=transport, image=image, ctx_size=ctx_size, ngl=ngl,
        threads=threads, api_key=api_key, host_ip=host_ip, keep=keep, timeout=timeout, llama_args=llama_args,
        rpc_backends=list(rpc_backend or []), gpu_devices=list(gpu_device or []), via_ssh=via_ssh,
        insecure_network=insecure_network or None, ssh_options=list(ssh_option or []), temperature=temperature,
        seed=seed, max_tokens=max_tokens, restart=restart, apir_trace=apir_trace, memory=memory, metrics=metrics,
    )
    if generate:
        sys.stdout.write(lib.generate(opts, generate))
        return
    # rich is imported only for a terminal: its import is a visible part of serve's time on a pipe
    with _Phases(live=sys.stderr.isatty() and not json_out, quiet=json_out) as phases:
        try:
            started = lib.start(opts, progress=phases.update)
            ready_at = time.time()
        except lib.ServeFailed as exc:
            phases.fail()
            if exc.log_tail:
                err_console().print("[dim]── last log lines ──[/]")
                err_console().out(exc.log_tail, highlight=False)
            raise
    server = started.server
    if started.notice:
        err_console().print(f"[yellow]notice:[/] {started.notice}", soft_wrap=True)
    if json_out:
        print_json({**server.model_dump(mode="json"), "phases": [p.model_dump() for p in started.phases],
                    "notice": started.notice})
    else:
        _print_ready(server, sum(p.seconds for p in started.phases), opts.api_key)
    if not detach:
        _foreground(server.name, since=int(ready_at))


def _split_models(args: list[str]) -> tuple[list[str], list[str]]:
    """`serve A B C -- --temp 0.2`: the words before the first flag are more models, the rest goes to
    llama-server (whose flags all start with '-'), as `run` splits its prompt."""
    first_flag = next((i for i, arg in enumerate(args) if arg.startswith("-")), len(args))
    return args[:first_flag], args[first_flag:]


def _print_ready(server: Any, total: float, api_key: str | None) -> None:
    """The ready line and lines to paste: rich on a terminal, plain text on a pipe."""
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    names = server.model_names or ["NAME"]
    pick = f" --model {names[0]}" if server.router else ""
    field = f'"model":"{names[0]}",' if server.router else ""
    lines = [
        f"  chat:  apirctl chat --url {server.url}{pick}",
        f"  curl:  curl -s {server.url}/chat/completions -H 'Content-Type: application/json'{auth} "
        f"""-d '{{{field}"messages":[{{"role":"user","content":"Hello!"}}]}}'""",
        f"  logs:  apirctl logs {server.name} -f",
        f"  stop:  apirctl stop {server.name}",
    ]
    head = f"{server.name} serves {server.model} ({server.transport_name}) at "
    if not sys.stdout.isatty():
        print(f"ready in {total:.1f} s: {head}{server.url}", *lines, sep="\n", flush=True)
        return
    from rich.markup import escape

    from apirctl.cli.output import console

    out = console()
    out.print(f"[green]ready[/] in {total:.1f} s: [bold]{escape(server.name)}[/] serves {escape(server.model)} "
              f"({server.transport_name}) at [bold]{server.url}[/]", soft_wrap=True)
    for line in lines:
        out.print(line, soft_wrap=True, highlight=False, markup=False)


class _Phases:
    """Serve's phases as they happen: a rich spinner per phase with its time on a terminal, one
    plain line per phase on a pipe (rich's live display is not even imported there), nothing
    with --json."""

    PHASES = ("model", "ssh tunnels", "rpc backend", "image", "container", "loading model", "ready")

    def __init__(self, live: bool, quiet: bool) -> None:
        self.live, self.quiet = live, quiet
        self.bar: Any = None
        self.tasks: list[Any] = []

    def __enter__(self) -> _Phases:
        if self.live:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            from apirctl.cli.output import err_console

            columns = (SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"),
                       TimeElapsedColumn())
            self.bar = Progress(*columns, console=err_console())
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, text: str) -> None:
        if self.bar is None:
            if self.quiet or text == "ready":
                return
            # a phase opens a line; a status within it (image pull or build progress) is indented
            print(f"{text}..." if text in self.PHASES else f"  {text}", file=sys.stderr, flush=True)
            return
        if text not in self.PHASES:  # a status line within the phase (image pull or build)
            if self.tasks:
                self.bar.update(self.tasks[-1], description=f"image: {text[:70]}")
            return
        if self.tasks:
            self.bar.update(self.tasks[-1], total=1, completed=1)
        if text != "ready":
            self.tasks.append(self.bar.add_task(text, total=None))

    def fail(self) -> None:
        if self.bar is not None and self.tasks:
            task = self.bar.tasks[-1]
            self.bar.update(self.tasks[-1], description=f"[red]{task.description}: failed[/]")
            self.bar.stop()


def _foreground(name: str, since: int) -> None:
    """Follow the logs from the moment the server was ready; Ctrl-C stops and removes it."""
    from apirctl import serve as lib
    from apirctl.cli.output import err_console
    from apirctl.errors import ApirctlError

    err_console().print("[dim]following the server's log; Ctrl-C stops and removes it[/]")
    interrupted = False
    try:
        for line in lib.logs(name, follow=True, since=since):
            print(line, flush=True)
    except KeyboardInterrupt:
        interrupted = True
    with contextlib.suppress(ApirctlError):  # someone may have stopped it already
        lib.stop(name)
    if not interrupted:
        raise ApirctlError(f"server {name} stopped on its own (removed)", hint="its last log lines are above")
    err_console().print(f"stopped {name}")


def _uptime(created: datetime | None, state: str) -> str:
    """How long a running server has existed, the way `podman ps` says it (2h13m, 5m3s, 12s)."""
    from apirctl import durations

    if created is None or state != "running":
        return "-"
    return durations.short((datetime.now(timezone.utc) - created).total_seconds())


def ps(
    all_: bool = typer.Option(False, "--all", "-a", help="Include stopped servers."),
    json_out: bool = typer.Option(False, "--json", help="Print the servers as a JSON list."),
    stats: bool = typer.Option(
        False, "--stats",
        help="What each running server is doing, from its /metrics and /slots: generation and prompt "
        "tokens/s (averages since it started), busy slots, deferred requests, KV-cache use, tokens so far; "
        "a server of several models, each running model on a line of its own.",
    ),
) -> None:
    """List inference servers: apirctl's and the upstream Podman Desktop extension's (by label).

    HEALTH is llama-server's /health, asked now: ok, loading, error or unreachable, or what keeps
    it from serving (an rpc backend or apir-host down, or restarted under it); for a stopped server,
    its exit code and why (`--json`: `why`). TRANSPORT is none, gpu, virtgpu (macOS),
    virtgpu-socket (Linux: an apir-host of its own), or rpc with its link: rpc-shm (a backend of its
    own, shared memory), rpc-unix (its own backend, on the socket) or rpc-tcp (the shared or a
    remote TCP backend). A server of several models shows each, with its state when it is not
    unloaded: loaded, loading or sleeping (`--json`: `models`).
    """
    from rich.table import Table

    from apirctl import serve as lib
    from apirctl.cli.output import console, print_json

    servers = lib.list_servers(all=all_)
    if stats:
        _print_stats(servers, json_out)
        return
    if json_out:
        print_json([s.model_dump(mode="json") for s in servers])
        return
    if not servers:
        console().print("no inference servers" + ("" if all_ else " running (`apirctl ps -a` shows stopped ones)"))
        return
    header = ("NAME", "MODEL", "TRANSPORT", "URL", "STATE", "HEALTH", "UPTIME")
    rows = [(s.name, _models_cell(s), s.transport_name, s.url, s.state, s.health if s.running else s.why or s.health,
             _uptime(s.created, s.state)) for s in servers]
    if not console().is_terminal:  # pipes get plain aligned columns, never wrapped or cut
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        return
    table = Table(box=None, header_style="bold")
    for column in header:
        table.add_column(column, overflow="fold")
    for row in rows:
        colour = {"ok": "green", "loading": "yellow"}.get(row[5], "red" if row[5] != "-" else "dim")
        table.add_row(*row[:5], f"[{colour}]{row[5]}[/]", row[6])
    console().print(table)


def _models_cell(server: Any) -> str:
    """A router's models with the state of each that is not simply unloaded (loaded, loading, sleeping),
    and which is the default (where a request that names no model goes)."""
    if not server.router or not server.models:
        return str(server.model)
    cells = []
    for name, state in server.models.items():
        notes = [note for note in (state if state != "unloaded" else "",
                                   "default" if name == server.default_model else "") if note]
        cells.append(f"{name} ({', '.join(notes)})" if notes else name)
    return ", ".join(cells)


def _print_stats(servers: list[Any], json_out: bool) -> None:
    """`ps --stats`: one row per server (JSON: each server with its `stats`)."""
    from apirctl.cli.output import console, print_json
    from apirctl.serve import stats as server_stats

    figures = [server_stats.collect(s) for s in servers]
    if json_out:
        print_json([{**s.model_dump(mode="json"), "stats": _stats_json(f)}
                    for s, f in zip(servers, figures, strict=True)])
        return
    if not servers:
        console().print("no inference servers running")
        return
    header = ("NAME", "GEN T/S", "PROMPT T/S", "BUSY", "DEFERRED", "KV CACHE", "GENERATED", "PROMPT")
    rows = []
    for f in figures:
        rows.append(_stats_row(f"{f.name} ({f.state})" if f.state else f.name, f))
        rows += [_stats_row(f"  {m.name} ({m.state})", m) for m in f.models]  # a router: each running model
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        console().print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(),
                        markup=False, highlight=False, soft_wrap=True)


def _stats_json(f: Any) -> dict[str, Any]:
    """A server's figures with the KV-cache ratio; a router's models each the same way."""
    return {**f.model_dump(mode="json", exclude={"models"}), "kv_ratio": f.kv_ratio,
            "models": [_stats_json(m) for m in f.models]}


def _stats_row(label: str, f: Any) -> tuple[str, ...]:
    if f.problem:
        return (label, f.problem, "", "", "", "", "", "")
    busy = f"{f.busy_slots}/{f.slots}" if f.slots is not None else _num(f.busy_slots)
    kv = f"{f.kv_tokens}/{f.kv_size} ({f.kv_ratio:.0%})" if f.kv_ratio is not None else "-"
    return (label, _num(f.generation_tps, 1), _num(f.prompt_tps, 1), busy, _num(f.deferred), kv,
            _num(f.tokens_generated), _num(f.prompt_tokens))


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def logs(
    name: str = typer.Argument(None, help="Server name (optional when one server runs)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    tail: int = typer.Option(None, "--tail", help="Only the last N lines."),
) -> None:
    """Print a server's llama-server log (stdout and stderr)."""
    from apirctl import serve as lib

    try:
        for line in lib.logs(name, tail=tail, follow=follow):
            sys.stdout.write(line + "\n")
            if follow:
                sys.stdout.flush()
    except KeyboardInterrupt:
        return


def stop(
    name: str = typer.Argument(None, help="Server name (optional when only one exists)."),
    all_: bool = typer.Option(False, "--all", "-a", help="Stop and remove every apirctl server."),
    json_out: bool = typer.Option(False, "--json", help="Print the removed servers' names as JSON."),
) -> None:
    """Stop and remove an inference server (its container; the model stays in the store)."""
    from apirctl import serve as lib
    from apirctl.cli.output import console, print_json
    from apirctl.errors import ApirctlError

    if name and all_:
        raise ApirctlError("give a server name or --all, not both")
    stopped = lib.stop(name, all=all_)
    if json_out:
        print_json({"stopped": stopped})
    elif stopped:
        console().print("stopped and removed: " + ", ".join(stopped))
    else:
        console().print("no apirctl servers to stop")


_RUN_IMAGE = typer.Option(None, "--image", metavar="FILE", help="An image for the first message (vision models).")
_RUN_ARGS = typer.Argument(
    None, metavar="PROMPT", show_default=False,
    help="Ask once, print the answer and stop (as `ramalama run MODEL PROMPT`); several words are one prompt. "
    "Flags after `--` go to llama-server (`run MODEL -- --top-k 20`).",
)
RUN_EPILOG = (
    "Examples:\n\n"
    "  apirctl run smollm2                        # serve, chat, and stop the server when the chat ends\n\n"
    "  apirctl run llama3.2:1b 'Hello'            # one answer, printed, then the server stops\n\n"
    "  apirctl run smollm2 --keep                 # the server stays after the chat\n\n"
    "  apirctl run smollm2 --temp 0.2 --seed 42 -c 8192 -- --top-k 20"
)


def _split_run_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`run MODEL why is the sky blue -- --top-k 20`: the words before the first flag are the prompt,
    the rest goes to llama-server (whose flags all start with '-')."""
    first_flag = next((i for i, arg in enumerate(args) if arg.startswith("-")), len(args))
    return args[:first_flag], args[first_flag:]


def run(
    model: str = MODEL,
    args: list[str] = _RUN_ARGS,
    prompt: str = typer.Option(None, "--prompt", help="The prompt as an option (for one that starts with '-')."),
    system: str = typer.Option(None, "--system", "-s", help="System prompt."),
    image: list[str] = _RUN_IMAGE,
    port: int = PORT,
    name: str = NAME,
    transport: str = TRANSPORT,
    ctx_size: int = CTX_SIZE,
    threads: int = THREADS,
    temperature: float = TEMPERATURE,
    seed: int = SEED,
    max_tokens: int = MAX_TOKENS,
    keep: bool = typer.Option(False, "--keep", help="Leave the server running when the chat ends."),
    timeout: float = TIMEOUT,
) -> None:
    """Serve a model and chat with it in one command, as `ollama run` and `ramalama run` do.

    The server stops when the chat ends (`/exit`, Ctrl-D, or the one answer to a prompt), unless
    `--keep`. Embedding and reranking models are refused before anything starts: they do not chat.
    """
    from apirctl import serve as lib
    from apirctl.cli.chat import refuse_non_chat, talk
    from apirctl.cli.output import err_console
    from apirctl.errors import ApirctlError

    words, llama_args = _split_run_args(list(args or []))
    if words and prompt is not None:
        raise ApirctlError("the prompt is given twice (as an argument and as --prompt)", hint="give one of them")
    if words:
        prompt = " ".join(words)
    opts = lib.options(
        model or _default_model(), port=port, name=name, transport=transport, ctx_size=ctx_size, threads=threads,
        timeout=timeout, llama_args=llama_args, temperature=temperature, seed=seed, max_tokens=max_tokens,
    )
    with _Phases(live=sys.stderr.isatty(), quiet=False) as phases:
        started = lib.start(opts, progress=phases.update)
    server = started.server
    if started.notice:
        err_console().print(f"[yellow]notice:[/] {started.notice}", soft_wrap=True)
    try:
        refuse_non_chat(server)
        talk(server.url, server.model, system=system, prompt=prompt, images=list(image or []))
    finally:
        if keep:
            err_console().print(f"{server.name} keeps serving at {server.url}; `apirctl stop {server.name}` stops it",
                                markup=False, highlight=False, soft_wrap=True)
        else:
            lib.stop(server.name)


def _default_model() -> str:
    from apirctl import config

    return config.settings().default_model


def restart(
    name: str = typer.Argument(None, help="Server name (optional when only one exists)."),
    timeout: float = TIMEOUT,
    json_out: bool = typer.Option(False, "--json", help="Print the server as JSON once ready."),
) -> None:
    """Restart a server's container (stopped or running) and wait until it answers again.

    It keeps its model, port and flags. A server whose remoting backend went away comes back with it:
    an APIR server (virtgpu on Linux) whose apir-host died gets a new host on the same socket first;
    an rpc server reconnects to the backend that runs now.
    """
    from apirctl import serve as lib
    from apirctl.cli.output import err_console, print_json

    if name is None:
        name = _only_one_exists(lib) or lib.find_server(None).name
    with err_console().status("restarting") as shown:
        server = lib.restart(name, timeout=timeout, progress=shown.update)
    if json_out:
        print_json(server.model_dump(mode="json"))
    else:
        err_console().print(f"{server.name} is ready at {server.url}")


def _only_one_exists(lib: Any) -> str | None:
    """The name of the only server there is (running or not), or None."""
    servers = [s for s in lib.list_servers(all=True, probe_health=False) if s.managed]
    return servers[0].name if len(servers) == 1 else None


def register(app: typer.Typer) -> None:
    app.command(epilog=SERVE_EPILOG, context_settings={"allow_interspersed_args": True})(serve)
    app.command(epilog=RUN_EPILOG, context_settings={"allow_interspersed_args": True})(run)
    app.command()(ps)
    app.command()(logs)
    app.command()(stop)
    app.command()(restart)
