"""The `serving` and `multi` parts of gpu_remoting.py (issue 24): llama-server under load, as users serve.

`serving`: the same llama-server (the build's, 32 slots, one context size) natively on the host, and as
a container runs it over each remoting path: its GPU hidden, in the harness's network namespace (no route
but a veth pair, as a bridge-networked container; its HTTP port is reached over that pair), with its
backend over shared memory (`--rpc unix:...`: `serve --transport rpc`) or through apir-host
(`--transport virtgpu`). All servers are loaded and warmed before the first clock starts. Then, for each
concurrency (1, 8, 32), the rows run in turn, native first and again last, each for `--serving-seconds`:
`concurrency` streams that each send a request (a prompt of about 128 tokens that no earlier request
shares, 128 tokens generated, end-of-sequence ignored), and another when one ends. Counted over the
row's window (`--serving-lead-in S`: the streams start one after another over the S seconds before
it, so that a window sees requests at every phase instead of rounds that all start and end together):
generated tokens per second (every streamed token that arrived in it), time to first token
of the requests that started in it (p50, p95), finished requests and errors. Each remoting row is
reported over the mean of the native rows around it. With `--serving-rpc-profile`, each level ends with
one more rpc row through a pair of its own run with `GGML_RPC_PROFILE=1`: both ends' figures per
command and phase (`rpc_profiled`), which the shared rpc server cannot give per row.

`multi`: N servers at once (N = 1, 2, 4; one slot each), each its own process with its own CUDA
context, natively; then N remoting clients each with its own ggml-rpc-server (one backend per
container, as `machine restart --remoting` runs them); in turn, native, remoting, native. Every server is
loaded and warmed before the clock starts, and the aggregate counts every server's tokens over one
common window. With `--mps on` (or `both`), the same under CUDA MPS (its control daemon started for the part
and stopped after it), which lets several processes' kernels run on the GPU at once instead of
time-slicing between contexts.

The load generator is the standard library's (threads and http.client, streaming llama-server's
/completion), so that nothing more has to be carried to the GPU machine.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import apir_serving_windows
import rpc_profile
from gpu_harness import NO_GPU, NS, VETH_NS, stop

if TYPE_CHECKING:
    from gpu_harness import Runner

#: Ports of the servers: natives on loopback from NATIVE_PORT, clients in the namespace from CLIENT_PORT.
NATIVE_PORT = 18500
CLIENT_PORT = 18600
PROMPT_WORDS = ("the", "river", "carries", "light", "past", "quiet", "fields", "while", "birds", "count", "slow",
                "clouds", "over", "green", "hills", "and", "old", "roads", "bend", "toward", "a", "small", "town",
                "where", "people", "share", "bread", "and", "stories")
SLOTS = 32
PROMPT_TOKENS = 128
GEN_TOKENS = 128
MPS_DIRS = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/apirc-mps-pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/apirc-mps-log"}


#: Every request of the harness's process, warm-ups included, takes the next number: a server never sees a
#: prompt twice, so no row is answered from a slot's cache or llama-server's prompt cache (before, each row
#: counted from 1 again, and a server answered most of a later row's prompts by evaluating one token).
_REQUEST_NUMBERS = itertools.count(1)
_REQUEST_NUMBERS_LOCK = threading.Lock()


def next_request_number() -> int:
    with _REQUEST_NUMBERS_LOCK:
        return next(_REQUEST_NUMBERS)


def prompt(number: int) -> str:
    """About PROMPT_TOKENS tokens, opening with a number no other request has (no shared prefix to reuse)."""
    words = [PROMPT_WORDS[(number + i) % len(PROMPT_WORDS)] for i in range(PROMPT_TOKENS - 8)]
    return f"Request {number}. Continue this text: " + " ".join(words)


@dataclass
class Window:
    """What the streams of one row saw between `start` and `end` (monotonic seconds)."""

    start: float
    end: float
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    finished: int = 0
    errors: int = 0
    error_text: str = ""
    started: list[float] = field(default_factory=list)  # when each stream sent its first request
    sent: int = 0  # requests sent over the whole run, lead-in and the cancelled last ones included
    lock: threading.Lock = field(default_factory=threading.Lock)

    def as_dict(self) -> dict:
        ttft = sorted(self.ttft_s)

        def pct(q: float) -> float | None:
            return round(ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1e3, 1) if ttft else None

        seconds = self.end - self.start
        return {"tokens_per_s": round(self.tokens / seconds, 2), "tokens": self.tokens, "seconds": round(seconds, 2),
                "ttft_p50_ms": pct(0.5), "ttft_p95_ms": pct(0.95), "requests_started": len(ttft),
                "requests_finished": self.finished, "errors": self.errors, "first_error": self.error_text[:200],
                "requests_sent": self.sent,
                "stream_starts_s": sorted(round(t - self.start, 3) for t in self.started),
                "window_monotonic_s": [round(self.start, 3), round(self.end, 3)]}


class Streams:
    """`per_server` streams against each (host, port), all over the same window."""

    def __init__(self, servers: list[tuple[str, int]], per_server: int, seconds: float, lead_in: float = 0.0) -> None:
        self.servers = servers
        self.per_server = per_server
        self.seconds = seconds
        # streams that start together stay in step (every request of a round ends together), and where
        # the window cuts those rounds moves a row's figures: with a lead-in, stream k starts k/N of it
        # before the window opens, so that the window sees requests at every phase
        self.lead_in = lead_in

    def run(self) -> Window:
        first = time.monotonic() + 0.5  # every thread started before the clock
        window = Window(first + self.lead_in, first + self.lead_in + self.seconds)
        pairs = [(host, port) for host, port in self.servers for _ in range(self.per_server)]
        threads = [threading.Thread(target=self.stream, daemon=True,
                                    args=(host, port, window, first + k * self.lead_in / len(pairs)))
                   for k, (host, port) in enumerate(pairs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.lead_in + self.seconds + 120)
        return window

    def stream(self, host: str, port: int, window: Window, start: float) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        with window.lock:
            window.started.append(time.monotonic())
        while time.monotonic() < window.end:
            self.request(host, port, window)

    def request(self, host: str, port: int, window: Window) -> None:
        body = json.dumps({"prompt": prompt(next_request_number()), "n_predict": GEN_TOKENS, "stream": True,
                           "ignore_eos": True, "temperature": 0.0}).encode()
        with window.lock:
            window.sent += 1
        conn = http.client.HTTPConnection(host, port, timeout=120)
        sent = time.monotonic()
        first = True
        tokens = 0
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read(200)!r}")
            for raw in resp:
                now = time.monotonic()
                if now >= window.end:
                    return  # closing the connection cancels the request on the server
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("stop"):
                    with window.lock:
                        window.finished += 1
                    return
                if first and sent >= window.start:
                    with window.lock:
                        window.ttft_s.append(now - sent)
                first = False
                tokens += 1
                if now >= window.start:
                    with window.lock:
                        window.tokens += 1
        except Exception as exc:  # noqa: BLE001 - one failed request is counted, not fatal
            with window.lock:
                window.errors += 1
                window.error_text = window.error_text or f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        finally:
            conn.close()


def server_counters(host: str, port: int) -> dict[str, float]:
    """llama-server's Prometheus counters (`--metrics`), by name without the `llamacpp:` prefix, and
    `read_at_s`, when they were read (monotonic): empty when the server does not answer (a row then has
    no step figures, not a failure)."""
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace") if resp.status == 200 else ""
        conn.close()
    except (OSError, http.client.HTTPException):
        return {}
    found = parse_counters(text)
    if found:
        found["read_at_s"] = time.monotonic()
    return found


def parse_counters(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("llamacpp:") and "{" not in name:
            with contextlib.suppress(ValueError):
                found[name.removeprefix("llamacpp:")] = float(value)
    return found


def step_figures(before: dict[str, float], after: dict[str, float],
                 requests: int | None = None) -> dict[str, float | None]:
    """A row's llama_decode calls (steps) from the counters read around it: how many a second, the
    milliseconds one takes, and the tokens generated a step, over the time between the two reads (the
    lead-in and the requests cancelled at the window's end fall between them too). Native rows get
    them too, which is what an APIR row's host trace is compared with. With the row's `requests` (all
    it sent), the prompt tokens the server evaluated per request: about a prompt's length when no
    request was answered from a cache (`prompt_tokens_cached`, the server's count of those it reused)."""
    keys = ("n_decode_total", "read_at_s")
    if any(key not in before or key not in after for key in keys):
        return {}
    seconds = after["read_at_s"] - before["read_at_s"]
    if seconds <= 0:
        return {}
    steps = after["n_decode_total"] - before["n_decode_total"]
    tokens = after.get("tokens_predicted_total", 0.0) - before.get("tokens_predicted_total", 0.0)
    prompt_tokens = after.get("prompt_tokens_total", 0.0) - before.get("prompt_tokens_total", 0.0)
    cached = after.get("prompt_tokens_cached_total", 0.0) - before.get("prompt_tokens_cached_total", 0.0)
    figures: dict[str, float | None] = {
        "seconds": round(seconds, 3), "steps": steps, "steps_per_s": round(steps / seconds, 1),
        "ms_per_step": round(seconds * 1e3 / steps, 3) if steps else None,
        "tokens_per_step": round(tokens / steps, 2) if steps else None, "prompt_tokens": prompt_tokens,
        "prompt_tokens_cached": cached}
    if requests:
        figures["prompt_tokens_per_request"] = round(prompt_tokens / requests, 1)
    return figures


class Serving:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.results = runner.results.setdefault("serving", {})
        self.seconds: float = runner.args.serving_seconds
        self.lead_in: float = runner.args.serving_lead_in

    # -- servers ------------------------------------------------------------------------
    def wait_ready(self, proc: subprocess.Popen[bytes], host: str, port: int, log: str, timeout: float = 240) -> None:
        until = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode} (see {log})")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection(host, port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            if time.monotonic() > until:
                raise RuntimeError(f"llama-server on {host}:{port} not ready in {timeout:.0f} s (see {log})")
            time.sleep(0.25)

    @contextlib.contextmanager
    def llama_server(self, shape: str, name: str, host: str, port: int, slots: int, extra: list[str],
                     env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Iterator[tuple[str, int]]:
        r = self.runner
        ctx = slots * (PROMPT_TOKENS + GEN_TOKENS + 64)
        cmd = [*(prefix or []), str(r.bin / "llama-server"), "-m", str(r.models[shape]), "-ngl", "99",
               "--host", host, "--port", str(port), "-np", str(slots), "-c", str(ctx), "--no-webui", "--metrics",
               *extra]
        cmd += r.cpu_threads()
        log = f"llama-server-{name}.log"
        fh = (r.logs / log).open("a")
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ) | (env or {}))
        try:
            self.wait_ready(proc, host, port, log)
            Streams([(host, port)], 1, 3.0).run()  # warm: the first requests build graphs and caches
            yield host, port
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server {name} exited {proc.returncode} during the run (see {log})")
        finally:
            stop(proc)
            fh.close()

    def namespace(self) -> list[str]:
        """The harness's veth namespace (made here if the `veth` part did not): the container's network."""
        r = self.runner
        if not r.results["steps"].get("veth", "").startswith("ok"):
            r.step("veth", r.setup_veth, need=0)
        return ["nsenter", f"--net=/var/run/netns/{NS}"]

    @contextlib.contextmanager
    def rpc_client(self, shape: str, name: str, index: int, slots: int) -> Iterator[tuple[str, int]]:
        """A client llama-server in the namespace over its own ggml-rpc-server on shared memory."""
        r = self.runner
        unix = f"unix:{r.work / f'serve-{index}.sock'}"
        with (r.server(unix, log_name=f"rpc-server-{name}.log"),
              self.llama_server(shape, name, VETH_NS, CLIENT_PORT + index, slots, ["--rpc", unix], NO_GPU,
                                self.namespace()) as addr):
            yield addr

    @contextlib.contextmanager
    def apir_client(self, shape: str, name: str, index: int, slots: int, extra_env: dict[str, str] | None = None,
                    extra: list[str] | None = None) -> Iterator[tuple[str, int]]:
        r = self.runner
        with r.apir_host(r.logs / f"serving-{name}.trace", log_name=f"apir-host-{name}.log") as sock:
            env = NO_GPU | {"GGML_VIRTGPU_SOCKET": str(sock)} | (extra_env or {})
            device = r.virtgpu_device(env)
            with self.llama_server(shape, name, VETH_NS, CLIENT_PORT + index, slots,
                                   ["-dev", device, *(extra or [])], env, self.namespace()) as addr:
                yield addr

    def rpc_profile_row(self, shape: str, level: int) -> dict:
        """One more rpc row of the level, through a client and a server started for it with
        `GGML_RPC_PROFILE=1` (patch 0004): both ends print where a connection's time went when it
        closes, so the pair lives for this row alone (its model's loading and warm-up are in the
        connection's figures too, and its SET_TENSOR calls are mostly the loading's). Per step:
        the connection's graph computes and recomputes and their milliseconds, the server's wait for
        the next command, and the client's send, reply wait and reply data; with the row's own
        tokens and steps, read against the level's native rows by the reader."""
        r = self.runner
        name = f"{shape}-rpc-profile-c{level}"
        unix = f"unix:{r.work / f'serve-profile-{level}.sock'}"
        profiled = {"GGML_RPC_PROFILE": "1"}
        logs = [r.logs / f"llama-server-{name}.log", r.logs / f"rpc-server-{name}.log"]

        def text() -> str:
            return "\n".join(log.read_text(errors="replace") for log in logs)

        with r.server(unix, env_extra=profiled, log_name=logs[1].name):
            with self.llama_server(shape, name, VETH_NS, CLIENT_PORT + 20, SLOTS, ["--rpc", unix], NO_GPU | profiled,
                                   self.namespace()) as addr:
                counted = server_counters(*addr)
                row = {"row": "rpc_profiled", **Streams([addr], level, self.seconds, self.lead_in).run().as_dict()}
                row["steps"] = step_figures(counted, server_counters(*addr), row["requests_sent"])
            # the server prints a connection's figures once it sees the client gone: before it is stopped
            until = time.monotonic() + 20
            while ("GRAPH_COMPUTE" not in rpc_profile.parse_connections(text()).get("server", {}).get("entries", {})
                   and time.monotonic() < until):
                time.sleep(0.2)
        logged = text()
        row["connections"] = rpc_profile.parse_connections(logged)
        row["per_token"] = rpc_profile.parse(logged)  # the steps that recomputed the last graph
        return row

    # -- serving ------------------------------------------------------------------------
    def serving(self, shape: str) -> None:
        r = self.runner
        entry = self.results.setdefault(shape, {"levels": {}})
        entry["setup"] = {"slots": SLOTS, "prompt_tokens": PROMPT_TOKENS, "gen_tokens": GEN_TOKENS,
                          "seconds": self.seconds, "lead_in_s": self.lead_in,
                          "rows": ["native", *r.args.serving_paths, "native_after"],
                          "rounds": r.args.serving_rounds}
        with contextlib.ExitStack() as stack:
            t0 = time.monotonic()
            servers = {"native": stack.enter_context(
                self.llama_server(shape, f"{shape}-native", "127.0.0.1", NATIVE_PORT, SLOTS, []))}
            for i, path in enumerate(r.args.serving_paths):
                if path == "apir-exact":  # the frontend's answers per exact shape, as before patch 0020
                    servers[path] = stack.enter_context(self.apir_client(
                        shape, f"{shape}-{path}", i, SLOTS, {"GGML_VIRTGPU_OP_CLASSES": "0"}))
                    continue
                make = {"rpc": self.rpc_client, "apir": self.apir_client}[path]
                servers[path] = stack.enter_context(make(shape, f"{shape}-{path}", i, SLOTS))
            entry["load_s"] = round(time.monotonic() - t0, 1)
            r.log(f"{shape} serving: {len(servers)} servers loaded in {entry['load_s']} s")
            rounds = max(1, r.args.serving_rounds)
            for level in r.args.concurrency:
                profiled = r.args.serving_rpc_profile and "rpc" in r.args.serving_paths
                rows_needed = 1 + rounds * len(servers) + profiled
                # the profiled pair loads its own model
                if r.left() < (self.seconds + self.lead_in) * rows_needed + 20 + 60 * profiled:
                    r.log(f"skip {shape} serving c{level}: {r.left():.0f}s left")
                    break
                entry["levels"][str(level)] = self.level(shape, servers, level, rounds)
                r.save()

    def level(self, shape: str, servers: dict[str, tuple[str, int]], level: int, rounds: int) -> dict:
        """One concurrency level: native, then each remoting path and native again, `rounds` times.

        Each remoting row is read against the two native rows around it (these machines drift), and
        the level reports every round's ratio and their range, so a figure can give the range.
        """
        r = self.runner
        order = ["native"] + [*r.args.serving_paths, "native"] * rounds
        sequence = []
        for key in order:
            counted = server_counters(*servers[key])
            row = {"row": key, **Streams([servers[key]], level, self.seconds, self.lead_in).run().as_dict()}
            # read after the streams closed: over the lead-in, the window and the requests cancelled at
            # its end, and divided by that time
            row["steps"] = step_figures(counted, server_counters(*servers[key]), row["requests_sent"])
            sequence.append(row)
        for row in sequence:  # where an APIR row's time went, from its host's trace (apir_serving_windows)
            trace = r.logs / f"serving-{shape}-{row['row']}.trace"
            if row["row"].startswith("apir") and trace.exists():
                start, end = row["window_monotonic_s"]
                try:
                    row["host_trace"] = apir_serving_windows.breakdown(
                        apir_serving_windows.load(trace), int(start * 1e9), int(end * 1e9))
                except (OSError, ValueError) as exc:
                    row["host_trace"] = {"error": str(exc)}
        natives = [i for i, row in enumerate(sequence) if row["row"] == "native"]
        for i, row in enumerate(sequence):
            if row["row"] == "native":
                continue
            before = max(n for n in natives if n < i)
            after = min(n for n in natives if n > i)
            around = [sequence[before], sequence[after]]
            base = statistics.mean(x["tokens_per_s"] for x in around)
            row["ratio"] = round(row["tokens_per_s"] / base, 3) if base else None
            ttfts = [x["ttft_p50_ms"] for x in around if x["ttft_p50_ms"]]
            row["ttft_p50_ratio"] = (round(row["ttft_p50_ms"] / statistics.mean(ttfts), 3)
                                     if row["ttft_p50_ms"] and ttfts else None)
        # The first round keeps the earlier layout (native, each path, native_after) for older readers.
        out: dict = {key: sequence[i] for i, key in enumerate(["native", *r.args.serving_paths])}
        out["native_after"] = sequence[len(r.args.serving_paths) + 1]
        out["sequence"] = sequence
        out["rounds"] = rounds
        for key in r.args.serving_paths:
            ratios = [x["ratio"] for x in sequence if x["row"] == key and x["ratio"] is not None]
            ttft = [x["ttft_p50_ratio"] for x in sequence if x["row"] == key and x["ttft_p50_ratio"] is not None]
            out[f"{key}_ratio_range"] = [min(ratios), max(ratios)] if ratios else None
            out[f"{key}_ttft_ratio_range"] = [min(ttft), max(ttft)] if ttft else None
        if r.args.serving_rpc_profile and "rpc" in r.args.serving_paths:
            out["rpc_profiled"] = self.rpc_profile_row(shape, level)
        cells = ", ".join(f"{k} {out[f'{k}_ratio_range']} ttft {out[f'{k}_ttft_ratio_range']}"
                          for k in r.args.serving_paths)
        natives_tps = [round(sequence[i]["tokens_per_s"], 1) for i in natives]
        r.log(f"{shape} serving c{level}: native t/s {natives_tps}; ratio ranges over {rounds} round(s): {cells}")
        return out

    # -- several containers on one GPU -----------------------------------------------------
    def multi(self, shape: str) -> None:
        r = self.runner
        modes = {"off": [False], "on": [True], "both": [False, True]}[r.args.mps]
        for mps in modes:
            key = "mps" if mps else "time_sliced"
            with self.mps(mps):
                for count in r.args.multi_counts:
                    need = 3 * self.seconds + 30 * count
                    if r.left() < need:
                        r.log(f"skip {shape} multi {key} x{count}: {r.left():.0f}s left")
                        continue
                    r.step(f"{shape}/multi-{key}-x{count}", self.multi_point, shape, key, count, need=need)

    def multi_point(self, shape: str, key: str, count: int) -> None:
        r = self.runner
        with contextlib.ExitStack() as stack:
            natives = [stack.enter_context(self.llama_server(shape, f"{shape}-multi-native-{i}", "127.0.0.1",
                                                             NATIVE_PORT + 1 + i, 1, [])) for i in range(count)]
            remotes = [stack.enter_context(self.rpc_client(shape, f"{shape}-multi-rpc-{i}", 1 + i, 1))
                       for i in range(count)]
            rows = {"native": Streams(natives, 1, self.seconds).run().as_dict(),
                    "rpc": Streams(remotes, 1, self.seconds).run().as_dict(),
                    "native_after": Streams(natives, 1, self.seconds).run().as_dict()}
        base = statistics.mean([rows["native"]["tokens_per_s"], rows["native_after"]["tokens_per_s"]])
        rows["rpc"]["ratio"] = round(rows["rpc"]["tokens_per_s"] / base, 3) if base else None
        self.results.setdefault(shape, {}).setdefault("multi", {}).setdefault(key, {})[str(count)] = rows
        r.save()
        r.log(f"{shape} multi {key} x{count}: native {rows['native']['tokens_per_s']:.1f} / "
              f"{rows['native_after']['tokens_per_s']:.1f} t/s, rpc {rows['rpc']['tokens_per_s']:.1f} t/s "
              f"({rows['rpc']['ratio']})")

    @contextlib.contextmanager
    def mps(self, on: bool) -> Iterator[None]:
        """CUDA MPS's control daemon for the servers started inside (they find it by MPS_DIRS)."""
        if not on:
            yield
            return
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            raise RuntimeError("nvidia-cuda-mps-control is not on PATH")
        for folder in MPS_DIRS.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        env = dict(os.environ) | MPS_DIRS
        subprocess.run([control, "-d"], env=env, check=True)
        saved = {k: os.environ.get(k) for k in MPS_DIRS}
        os.environ.update(MPS_DIRS)  # every server started from here on finds the daemon
        self.runner.results.setdefault("env", {})["mps"] = "started"
        try:
            yield
        finally:
            subprocess.run([control], input="quit\n", text=True, env=env, check=False)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
