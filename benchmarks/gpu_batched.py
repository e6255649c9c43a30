"""The `batched` part of gpu_remoting.py (issue 31, item 3): many sequences' prompts at once.

llama-server at 32 streams spends its time to first token on the prompts of every request that joined:
32 prompts of 128 tokens, computed together in batches of 2048 (micro-batches of 512), each sequence
in its own part of the KV cache. llama-bench's pp512 (one sequence) does not show that. This part runs
the build's llama-batched-bench the way the server batches: `npl` sequences, each given a 128-token
prompt at once (`-npp 128`), then 32 tokens generated for each (`-ntg 32`), for each `npl` of
`--batched-npl`, the list repeated `--batched-reps` times in one process (the first pass builds the
graphs). Rows native, then each of `--batched-paths` (rpc, apir; apir-wait: apir-host answering a
graph run only after its compute, `GGML_VIRTGPU_RUN_AHEAD=0`) and native again, `--batched-rounds`
times; the clients as the serving rows run them: no GPU visible, in a network namespace of their own,
over shared memory to ggml-rpc-server or through apir-host.

Reported for each row and `npl`: prompt tokens/s (S_PP) and generated tokens/s (S_TG), every pass,
and each remoting row's ratio to the mean of the native rows around it; what llama.cpp resolved (flash
attention, graph splits, compute buffers: its log at `-lv 4`); for an APIR row, the host's calls in each
pass's prompt and generation windows (apir_serving_windows over its trace: calls, host time by function,
the client's time between computes); and whether llama-server through apir-host generates native's
greedy tokens after a prompt of several micro-batches. With `--batched-rpc-profile`, one more rpc row through a pair of
its own run with `GGML_RPC_PROFILE=1`: both ends' time by command over the whole run.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import apir_serving_windows
import rpc_profile
from gpu_harness import ISOLATED, NO_GPU, stop

if TYPE_CHECKING:
    from gpu_harness import Runner

PROMPT_TOKENS = 128
GEN_TOKENS = 32
#: The agreement check's prompt: three micro-batches of 512 before the one with the output, so that
#: runs without outputs (answered while they compute, patch 0030) come before the tokens compared
AGREEMENT_WORDS = 1800
AGREEMENT_TOKENS = 48
#: llama.cpp's log lines that say how it placed the graph (kept per row)
RESOLVED = ("Flash Attention", "splits =", "compute buffer size", "KV buffer size", "output buffer size")


def resolved_lines(text: str) -> list[str]:
    """The lines of a `-lv 4` log that say how llama.cpp placed the graph, without their timestamps."""
    found = []
    for line in text.splitlines():
        if any(key in line for key in RESOLVED):
            _, _, rest = line.partition(" I ")
            found.append((rest or line).strip())
    return found


def windows(passes: list[dict]) -> list[dict]:
    """Each pass's prompt and generation windows (monotonic ns) from the time its line arrived: the
    generation ended then, and the prompt before it (the KV cache clear between them takes micro-seconds)."""
    out = []
    for p in passes:
        end = int(p["arrived_monotonic_s"] * 1e9)
        tg = int(p["t_tg"] * 1e9)
        pp = int(p["t_pp"] * 1e9)
        out.append({"pl": p["pl"], "pp": (end - tg - pp, end - tg), "tg": (end - tg, end)})
    return out


class Batched:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.results = runner.results.setdefault("batched", {})

    def command(self, shape: str) -> list[str]:
        r = self.runner
        npl = list(r.args.batched_npl) * max(1, r.args.batched_reps)
        ctx = max(npl) * (PROMPT_TOKENS + GEN_TOKENS)
        return [str(r.bin / "llama-batched-bench"), "-m", str(r.models[shape]), "-ngl", "99", "-c", str(ctx),
                "-npp", str(PROMPT_TOKENS), "-ntg", str(GEN_TOKENS), "-npl", ",".join(map(str, npl)),
                "--output-format", "jsonl", "-lv", "4", *r.cpu_threads()]

    def run_row(self, shape: str, name: str, extra: list[str], env: dict[str, str] | None = None,
                prefix: list[str] | None = None) -> dict:
        """One llama-batched-bench run; each pass's line is stamped as it arrives (its windows)."""
        r = self.runner
        cmd = [*(prefix or []), *self.command(shape), *extra]
        log = r.logs / f"batched-{name}.log"
        with log.open("a") as err:
            err.write(f"$ {' '.join(cmd)}\n")
            err.flush()
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=dict(os.environ) | (env or {}))
            passes = []
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    line = line.strip()
                    if line.startswith("{"):
                        found = json.loads(line)
                        found["arrived_monotonic_s"] = round(time.monotonic(), 4)
                        passes.append(found)
                proc.wait(timeout=max(5.0, r.left()))
            finally:
                stop(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-batched-bench ({name}) exited {proc.returncode} (see {log.name})")
        keep = ("pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "flash_attn", "n_batch", "n_ubatch",
                "arrived_monotonic_s")
        return {"wall_s": round(time.monotonic() - t0, 2),
                "cmd": " ".join(cmd[len(prefix or []):]).replace(str(r.work), "$WORK"),
                "passes": [{k: p[k] for k in keep if k in p} for p in passes],
                "resolved": [line.replace(str(r.work), "$WORK")
                             for line in resolved_lines(log.read_text(errors="replace"))]}

    @contextlib.contextmanager
    def rpc(self, env_extra: dict[str, str] | None = None, name: str = "rpc") -> Iterator[list[str]]:
        r = self.runner
        unix = f"unix:{r.work / f'batched-{name}.sock'}"
        with r.server(unix, env_extra=env_extra, log_name=f"rpc-server-batched-{name}.log"):
            yield ["--rpc", unix]

    def apir_row(self, shape: str, name: str, host_env: dict[str, str] | None = None) -> dict:
        r = self.runner
        trace = r.logs / f"batched-{name}.trace"
        with r.apir_host(trace, log_name=f"apir-host-batched-{name}.log", env_extra=host_env) as sock:
            env = NO_GPU | {"GGML_VIRTGPU_SOCKET": str(sock)}
            row = self.run_row(shape, name, ["-dev", r.virtgpu_device(env)], env, ISOLATED)
        try:
            found = apir_serving_windows.load(trace)
            for p, w in zip(row["passes"], windows(row["passes"]), strict=True):
                p["host_pp"] = apir_serving_windows.breakdown(found, *w["pp"])
                p["host_tg"] = apir_serving_windows.breakdown(found, *w["tg"])
        except (OSError, ValueError) as exc:
            row["host_trace_error"] = str(exc)
        return row

    def rpc_profile_row(self, shape: str) -> dict:
        """An rpc row through a pair of its own with `GGML_RPC_PROFILE=1`: both ends print their time by
        command when the connection closes (the model's loading is in it, the graph computes are not)."""
        r = self.runner
        profiled = {"GGML_RPC_PROFILE": "1"}
        with self.rpc(profiled, name=f"{shape}-rpc-profile") as extra:
            row = self.run_row(shape, f"{shape}-rpc-profile", extra, NO_GPU | profiled, ISOLATED)
            server_log = r.logs / f"rpc-server-batched-{shape}-rpc-profile.log"
            until = time.monotonic() + 20  # the server prints once it sees the client gone
            while ("GRAPH_COMPUTE" not in rpc_profile.parse_connections(server_log.read_text(errors="replace"))
                   .get("server", {}).get("entries", {}) and time.monotonic() < until):
                time.sleep(0.2)
        text = "\n".join((r.logs / name).read_text(errors="replace")
                         for name in (f"batched-{shape}-rpc-profile.log", server_log.name))
        row["connections"] = rpc_profile.parse_connections(text)
        return row

    def batched(self, shape: str) -> None:
        r = self.runner
        rounds = max(1, r.args.batched_rounds)
        order = ["native"] + [*r.args.batched_paths, "native"] * rounds
        entry = self.results.setdefault(shape, {})
        entry["setup"] = {"prompt_tokens": PROMPT_TOKENS, "gen_tokens": GEN_TOKENS, "npl": r.args.batched_npl,
                          "reps": r.args.batched_reps, "rounds": rounds, "rows": order}
        sequence = []
        for i, key in enumerate(order):
            name = f"{shape}-{key}-{i}"
            if key == "native":
                row = self.run_row(shape, name, [])
            elif key == "rpc":
                with self.rpc(name=name) as extra:
                    row = self.run_row(shape, name, extra, NO_GPU, ISOLATED)
            elif key == "apir-wait":  # the host answers a run after its compute, as before patch 0030
                row = self.apir_row(shape, name, {"GGML_VIRTGPU_RUN_AHEAD": "0"})
            else:
                row = self.apir_row(shape, name)
            row["row"] = key
            sequence.append(row)
            entry["sequence"] = sequence
            r.save()
        entry["ratios"] = ratios(sequence)
        entry["agreement"] = agreement(r, shape)
        if r.args.batched_rpc_profile:
            entry["rpc_profiled"] = self.rpc_profile_row(shape)
        r.log(f"{shape} batched: {summary_line(entry['ratios'])}; apir tokens equal: {entry['agreement']['equal']}")


def completion_tokens(host: str, port: int, text: str) -> list[int]:
    """The token ids llama-server generates greedily for `text`."""
    body = json.dumps({"prompt": text, "n_predict": AGREEMENT_TOKENS, "temperature": 0.0, "ignore_eos": True,
                       "return_tokens": True, "cache_prompt": False}).encode()
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read(200)!r}")
    return [int(t) for t in json.loads(resp.read())["tokens"]]


def agreement(runner: Runner, shape: str) -> dict:
    """Greedy tokens after a prompt of several micro-batches, natively and through apir-host (one slot
    each): the same ids, or the first place they part."""
    from gpu_serving import NATIVE_PORT, PROMPT_WORDS, Serving

    serving = Serving(runner)
    text = " ".join(PROMPT_WORDS[(i * 7) % len(PROMPT_WORDS)] for i in range(AGREEMENT_WORDS))
    context = ["-c", str(2 * AGREEMENT_WORDS + 512)]  # after the server's own -c: the last one counts
    with serving.llama_server(shape, f"{shape}-agree-native", "127.0.0.1", NATIVE_PORT + 40, 1, context) as native:
        want = completion_tokens(*native, text)
    with serving.apir_client(shape, f"{shape}-agree-apir", 30, 1, extra=context) as remote:
        got = completion_tokens(*remote, text)
    parted = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    return {"prompt_words": AGREEMENT_WORDS, "tokens": len(want), "equal": want == got, "first_difference": parted,
            "native": want[:8], "apir": got[:8]}


def best(row: dict, pl: int, field: str) -> float | None:
    """A row's best pass of `pl` sequences (the first pass also builds the graphs)."""
    values = [p[field] for p in row["passes"] if p["pl"] == pl]
    return max(values) if values else None


def ratios(sequence: list[dict]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """For each remoting row and `npl`: its best S_PP and S_TG over the mean of the native rows around it;
    every round's ratio is kept (the range is what a figure reports)."""
    natives = [i for i, row in enumerate(sequence) if row["row"] == "native"]
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for i, row in enumerate(sequence):
        if row["row"] == "native":
            continue
        around = [sequence[max(n for n in natives if n < i)], sequence[min(n for n in natives if n > i)]]
        for pl in sorted({p["pl"] for p in row["passes"]}):
            for field in ("speed_pp", "speed_tg"):
                mine = best(row, pl, field)
                base = [v for x in around if (v := best(x, pl, field)) is not None]
                if mine is None or not base:
                    continue
                cell = out.setdefault(row["row"], {}).setdefault(str(pl), {})
                cell.setdefault(field, []).append(round(mine / statistics.mean(base), 3))
    return out


def summary_line(found: dict[str, dict[str, dict[str, list[float]]]]) -> str:
    return "; ".join(f"{key} npl {pl}: pp {cell.get('speed_pp')} tg {cell.get('speed_tg')}"
                     for key, levels in found.items() for pl, cell in levels.items())
