"""Serving load on one model natively and as `apirctl serve` runs it, side by side.

`apirctl bench MODEL --serving` starts the host build's llama-server (native) and an `apirctl serve` of
the same model per mode: `remoting` (a container on the transport `serve` picks, or `--transport`),
`container` (its own CPU), and the same two in a micro-VM (`vm-remoting`, `vm-cpu`: the seeds' Lima-style
comparison). Each has as many slots as the highest concurrency. At each level the rows run in turn:
native, then each mode followed by native again, `rounds` times. Each served row is read against the
native rows on either side of it, because these machines drift; its ratio is its output tokens/s over
their mean. Every server is stopped whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from apirctl import serve
from apirctl.bench import load, system
from apirctl.bench.modes import ModelFile
from apirctl.bench.results import LevelResult, Run, new_id, now_iso
from apirctl.build import llamacpp
from apirctl.errors import ApirctlError, tail

#: Called with (mode, concurrency, round) as each row starts, and ("ready", 0, 0) once both serve.
ServingEventFn = Callable[[str, int, int], None]
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Endpoint:
    mode: str
    url: str
    transport: str


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, log: Path | None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ApirctlError(f"the native llama-server exited ({proc.returncode}): {tail(log, default='no log')}",
                               hint="`apirctl doctor` checks the host build")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise ApirctlError(f"the native llama-server did not answer /health within {READY_TIMEOUT_S:.0f} s",
                       hint="a large model may need longer; `apirctl bench --url` loads a server you started")


@contextlib.contextmanager
def _native(model: ModelFile, slots: int, ctx_size: int, workdir: Path) -> Iterator[Endpoint]:
    """The host build's llama-server on a free loopback port."""
    build = llamacpp.current_build()
    if build is None:
        raise ApirctlError("native serving needs llama.cpp built on this host", hint="run `apirctl setup`")
    port = _free_port()
    log = workdir / "native-llama-server.log"
    argv = [str(build.binary("llama-server")), "-m", str(model.path), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(ctx_size), "--no-webui"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log)
        yield Endpoint("native", url, f"host ({build.backend})")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


#: The served rows `--serving` can put beside native: `serve` options for each (None: `--transport`'s).
SERVED_MODES: dict[str, dict[str, str | None]] = {
    "remoting": {"transport": None, "isolation": "container"},
    "container": {"transport": "none", "isolation": "container"},
    "vm-cpu": {"transport": "none", "isolation": "vm"},
    "vm-remoting": {"transport": None, "isolation": "vm"},
    "vm-apir": {"transport": "virtgpu", "isolation": "vm"},
}
DEFAULT_MODES = ("remoting",)


def parse_modes(text: str) -> list[str]:
    """`--modes` for serving: native is always there (each row is read against it); the others in order."""
    chosen = [m.strip() for m in text.split(",") if m.strip() and m.strip() != "native"]
    unknown = [m for m in chosen if m not in SERVED_MODES]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        raise ApirctlError(f"--modes {text!r} for serving: name each of {', '.join(SERVED_MODES)} at most once",
                           hint="e.g. --modes native,remoting or --modes native,vm-cpu,vm-remoting")
    return chosen


@contextlib.contextmanager
def _served(model: ModelFile, mode: str, slots: int, ctx_size: int, transport: str | None) -> Iterator[Endpoint]:
    """`apirctl serve` of the model for one mode, under a name of its own, stopped at the end."""
    name = f"apirctl-bench-serving-{uuid.uuid4().hex[:8]}"
    wanted = SERVED_MODES[mode]
    chosen = wanted["transport"] if wanted["transport"] is not None else transport
    if mode.endswith("remoting") and chosen == "none":
        raise ApirctlError(f"--modes {mode} with --transport none is no remoting row",
                           hint="leave --transport out, or name rpc or virtgpu")
    opts = serve.options(str(model.path), name=name, port=_free_port(), transport=chosen, ctx_size=ctx_size,
                         isolation=wanted["isolation"], llama_args=["-np", str(slots)])
    started = serve.start(opts)
    try:
        link = started.server.rpc_link
        if mode.endswith("remoting") and started.server.transport == "none":
            # `auto` served on the instance's own CPU (no backend faster than it): no remoting to measure
            raise ApirctlError(f"{mode}: `serve` chose the {'VM' if mode.startswith('vm') else 'container'}'s own "
                               "CPU, not remoting", hint="start a backend (`apirctl machine restart --remoting`) "
                                                         "and name it: --transport rpc")
        yield Endpoint(mode, started.server.url, started.server.transport + (f" ({link})" if link else ""))
    finally:
        with contextlib.suppress(ApirctlError):
            serve.stop(name)


def compare(model: ModelFile, params: load.LoadParams, modes: list[str] | None = None, rounds: int = 1,
            transport: str | None = None, on_event: ServingEventFn | None = None,
            on_progress: load.LoadProgressFn | None = None) -> Run:
    """Each concurrency level as native, then each served mode followed by native, `rounds` times; every
    served row carries its ratio to the native rows on either side of it."""
    params.validate()
    if rounds < 1:
        raise ApirctlError("--rounds must be at least 1")
    served_modes = list(modes or DEFAULT_MODES)
    slots = max(params.concurrency)
    # room for every slot's prompt and answer, with llama.cpp's own margin
    ctx_size = slots * (params.prompt_tokens * 2 + params.max_tokens + 64)
    levels: list[LevelResult] = []
    with contextlib.ExitStack() as stack:
        # the native server's log, quoted when it fails to start, and removed with the run
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="apirctl-bench-serving-")))
        native = stack.enter_context(_native(model, slots, ctx_size, workdir))
        served = [stack.enter_context(_served(model, mode, slots, ctx_size, transport)) for mode in served_modes]
        if on_event:
            on_event("ready", 0, 0)
        for conc in params.concurrency:
            level = load.LoadParams(concurrency=(conc,), requests=params.requests, prompt_tokens=params.prompt_tokens,
                                    max_tokens=params.max_tokens, time_limit=params.time_limit,
                                    request_timeout=params.request_timeout)
            order = [(native, 0)]
            for round_ in range(1, rounds + 1):
                for endpoint in served:
                    order += [(endpoint, round_), (native, round_)]
            rows: list[LevelResult] = []
            for endpoint, round_ in order:
                if on_event:
                    on_event(endpoint.mode, conc, round_)
                _, [row] = load.run(endpoint.url, level, on_progress)
                rows.append(row.model_copy(update={"mode": endpoint.mode, "transport": endpoint.transport}))
            for n in range(1, len(rows), 2):
                tps = rows[n].output_tps_total
                around = [v for v in (rows[n - 1].output_tps_total, rows[n + 1].output_tps_total) if v]
                if tps is not None and len(around) == 2:
                    rows[n] = rows[n].model_copy(update={"ratio_to_native": tps / statistics.mean(around)})
            levels.extend(rows)
    return Run(
        id=new_id(), created=now_iso(), kind="serving", model=model.label, model_file=model.filename,
        params={"modes": ["native", *served_modes], "rounds": rounds, "concurrency": list(params.concurrency),
                "requests": params.requests, "prompt_tokens": params.prompt_tokens, "max_tokens": params.max_tokens,
                "time_limit": params.time_limit, "slots": slots},
        system=system.collect(), levels=levels,
    )
