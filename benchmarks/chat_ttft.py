"""Time to first token: `apirctl chat PROMPT` against a bare HTTP request to the same llama-server.

What the user waits for, split so the cost of each layer shows:

- `bare`: a fresh stdlib `http.client` connection in this (warm) process, POST a streamed
  request, stop at the first SSE chunk carrying content. The floor: the server's own time.
- `library`: the same with `apirctl.chat.ChatClient` (a new client each time), in this process.
  `library - bare` is what apirctl's client code adds.
- `cli`: `apirctl chat --url URL PROMPT` as a new process, from spawn to its first byte on stdout.
- `start`: `apirctl --version` as a new process, spawn to exit: the start-up any apirctl command pays.
  `cli - start - bare` is what `chat` adds beyond process start (target: <= 5 ms).
- `parse`: a new process that imports the CLI and parses and converts the same `chat` options, then
  stops: what any apirctl command with these options pays before its own code runs (typer builds a
  pydantic adapter per option). `cli - parse - bare` is what the chat command itself adds.
- `import_cli`, `import_chat`: `python -c "import apirctl.cli[, apirctl.chat]"`; their difference is
  what importing the chat client (httpx) costs.

All probes run interleaved (the order rotates from run to run), `--runs` times each, with the same
greedy one-token request, so llama-server's prompt cache makes every request equal. Results go to
stdout as a table, or JSON with `--json`.

    python benchmarks/chat_ttft.py --model MODEL.gguf [--runs 30]     (starts llama-server itself)
    python benchmarks/chat_ttft.py --url http://127.0.0.1:1234/v1     (an already running server)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

PROMPT = "Say hello."


def body() -> dict:
    return {
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": 1,
        "temperature": 0,
    }


def bare(url: str) -> float:
    """Seconds from connect to the first content chunk, with nothing but http.client."""
    parts = urlsplit(url)
    payload = json.dumps(body()).encode()
    start = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=120)
    try:
        conn.request("POST", f"{parts.path}/chat/completions", payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        while True:
            line = response.readline()
            if not line:
                raise RuntimeError("stream ended without content")
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                return time.perf_counter() - start
    finally:
        conn.close()


def library(url: str) -> float:
    from apirctl.chat import ChatClient

    first: list[float] = []
    start = time.perf_counter()

    def on_token(_: str) -> None:
        if not first:
            first.append(time.perf_counter() - start)

    with ChatClient(url) as client:
        client.stream(body()["messages"], on_token, max_tokens=1, temperature=0)
    if not first:
        raise RuntimeError("no content")
    return first[0]


def apirctl() -> list[str]:
    script = Path(sys.executable).parent / "apirctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "apirctl"]


def cli(url: str) -> float:
    """Spawn `apirctl chat PROMPT` and time its first byte on stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*apirctl(), "chat", "--url", url, PROMPT, "--max-tokens", "1", "--temperature", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    byte = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    _, err = proc.communicate()
    if not byte or proc.returncode != 0:
        raise RuntimeError(f"apirctl chat failed: {err.decode(errors='replace')}")
    return elapsed


def start_cost() -> float:
    start = time.perf_counter()
    subprocess.run([*apirctl(), "--version"], check=True, capture_output=True)
    return time.perf_counter() - start


# Everything `apirctl chat PROMPT` does before its own code runs: import the CLI, build the command,
# parse and convert the same options (typer builds a pydantic adapter per option), then stop.
PARSE_ONLY = """
import typer.main
from apirctl.cli import app
group = typer.main.get_command(app)
ctx = group.make_context("apirctl", ["chat", "--url", "http://127.0.0.1:1/v1", "x",
                                     "--max-tokens", "1", "--temperature", "0"])
rest = list(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])) + ctx.args
name, cmd, args = group.resolve_command(ctx, rest)
cmd.make_context(name, args, parent=ctx)
"""


def python_cost(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


@contextmanager
def llama_server(model: Path, threads: int | None) -> Iterator[str]:
    """Start llama-server from apirctl's llama.cpp build on a free loopback port."""
    import httpx

    from apirctl.build import llamacpp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from apirctl.errors import ApirctlError

    try:
        binary = llamacpp.require_build().binary("llama-server")
    except ApirctlError as exc:
        raise SystemExit(f"{exc.message} ({exc.hint})") from None
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-c", "2048", "-np", "1", "--no-webui"]
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit("llama-server exited")
            time.sleep(0.1)
        else:
            raise SystemExit("llama-server not ready")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure(url: str, runs: int, only: list[str] | None = None) -> dict[str, list[float]]:
    probes: dict[str, Callable[[], float]] = {
        "bare": lambda: bare(url),
        "library": lambda: library(url),
        "cli": lambda: cli(url),
        "start": start_cost,
        "parse": lambda: python_cost(PARSE_ONLY),
        "import_cli": lambda: python_cost("import apirctl.cli"),
        "import_chat": lambda: python_cost("import apirctl.cli, apirctl.chat"),
    }
    if only:
        probes = {name: probe for name, probe in probes.items() if name in only}
    for probe in probes.values():  # warm-up: page cache, server prompt cache, imports
        probe()
    results: dict[str, list[float]] = {name: [] for name in probes}
    order = list(probes)
    for run in range(runs):
        # Rotate who goes first: a probe right after the heavy import probes finds the CPU caches
        # cold, one right after a light probe warm; rotating gives each probe the same mix.
        for name in order[run % len(order):] + order[:run % len(order)]:
            results[name].append(probes[name]())
    return results


def summary(results: dict[str, list[float]]) -> dict[str, float]:
    med = {name: statistics.median(values) * 1000 for name, values in results.items()}
    out = {f"{name}_ms": round(value, 2) for name, value in med.items()}

    def put(key: str, *names: str, value: Callable[[], float]) -> None:
        if all(name in med for name in names):
            out[key] = round(value(), 2)

    put("library_minus_bare_ms", "library", "bare", value=lambda: med["library"] - med["bare"])
    put("cli_minus_bare_ms", "cli", "bare", value=lambda: med["cli"] - med["bare"])
    put("cli_minus_start_minus_bare_ms", "cli", "start", "bare", value=lambda: med["cli"] - med["start"] - med["bare"])
    # The same, run by run (the probes of one run are taken back to back, so they share the
    # machine's load): steadier than a difference of three medians on a busy machine.
    put("cli_minus_start_minus_bare_paired_ms", "cli", "start", "bare", value=lambda: statistics.median(
        c - s - b for c, s, b in zip(results["cli"], results["start"], results["bare"], strict=True)) * 1000)
    put("chat_imports_ms", "import_chat", "import_cli", value=lambda: med["import_chat"] - med["import_cli"])
    put("option_parsing_ms", "parse", "import_cli", value=lambda: med["parse"] - med["import_cli"])
    put("cli_minus_parse_minus_bare_ms", "cli", "parse", "bare", value=lambda: med["cli"] - med["parse"] - med["bare"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="base URL of a running OpenAI-compatible server")
    parser.add_argument("--model", type=Path, help="GGUF to serve with a llama-server started here")
    parser.add_argument("--threads", type=int, help="llama-server threads")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--probes", help="comma-separated subset, e.g. bare,cli,start (default: all)")
    args = parser.parse_args()
    if not args.url and not args.model:
        parser.error("give --url or --model")
    os.environ.setdefault("NO_COLOR", "1")

    def run(url: str) -> None:
        results = measure(url, args.runs, args.probes.split(",") if args.probes else None)
        samples = {name: [round(v * 1000, 3) for v in values] for name, values in results.items()}
        data = {"runs": args.runs, "medians": summary(results), "samples_ms": samples}
        if args.json:
            print(json.dumps(data, indent=2))
            return
        print(f"{'probe':<10} {'median ms':>10} {'min ms':>8} {'max ms':>8}   ({args.runs} runs)")
        for name, values in results.items():
            ms = [v * 1000 for v in values]
            print(f"{name:<10} {statistics.median(ms):>10.2f} {min(ms):>8.2f} {max(ms):>8.2f}")
        for key, value in data["medians"].items():
            if "minus" in key:
                print(f"{key}: {value:.2f}")

    if args.url:
        run(args.url)
    else:
        with llama_server(args.model, args.threads) as url:
            run(url)


if __name__ == "__main__":
    main()
