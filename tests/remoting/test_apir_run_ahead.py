"""A graph run without outputs is answered while its compute runs (llama_patches 0030), on a CPU.

On an asynchronous backend, apir-host answers a run whose results nobody reads yet once its writes are
done and leaves the compute running: the next run queues behind it on the backend's stream, and every
other command, an unmapped resource and the end of the client wait for it first. ggml-cpu is
synchronous, so CI never took that path. tests/remoting/shim/async_cpu_backend.cpp is ggml-cpu behind a
worker thread that computes a GPU's way (graph_compute returns at once, copies and events on one
stream, each compute started a little late), and counts the computes queued behind one still running,
the runs answered with their compute still to run, and every call on its buffers made while it still
had work.

The real llama-server, with a prompt of several micro-batches and a greedy generation, through the real
apir-host over it keeps native's tokens: with runs answered ahead and nothing touched under a compute;
with GGML_VIRTGPU_RUN_AHEAD=0, no compute queued behind another. A client written by hand sends, right
after a run answered ahead, each kind of command that must wait for it (a read, a clear, a free) or
leaves: the host touches no buffer under the compute, also with apir-host and its backend library under
AddressSanitizer and UndefinedBehaviorSanitizer. With the frontend's shared buffers (a host
backend with buffer_from_host_ptr, as ggml-metal's), the client writes inputs and reads results in
place, where no run's writes or outputs show them: a graph with a tensor in such a buffer is waited
for, and keeps native's tokens.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from apirctl.apir import extensions, messages, table
from apirctl.apir.tensor import Tensor
from apirctl.build import llamacpp
from tests.conftest import shared_env
from tests.remoting.test_apir_host_native import (  # noqa: F401 (workdir, asan_host: fixtures)
    FORWARD,
    FORWARD_BASE,
    OUT_RES,
    GraphRunClient,
    apir_host,
    asan_host,
    workdir,
)
from tests.support import build_servers, native_builds
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHIM = Path(__file__).parent / "shim" / "async_cpu_backend.cpp"
REG = "ggml_backend_async_cpu_reg"
UBATCH = 64
#: one slot, the prompt in micro-batches of UBATCH tokens within one batch
FLAGS = ["-np", "1", "-c", "1024", "-b", "1024", "-ub", str(UBATCH)]
#: about 560 tokens: nine micro-batches, all but the last without outputs
PROMPT = "Numbers, one after another: " + ", ".join(f"{i} and {i + 1}" for i in range(72))
N_PREDICT = 16
COUNTS = re.compile(r"async-cpu: computes=(\d+) overlapped=(\d+) ahead=(\d+) unsafe=(\d+) failed=(\d+)")
KEYS = ("computes", "overlapped", "ahead", "unsafe", "failed")


def build_source(build: llamacpp.Build) -> Path:
    """The patched llama.cpp tree `build` was made from (its link in the build's root), else the tree of
    the current patch series."""
    linked = build.root / "llama.cpp"
    if (linked / "ggml/src/ggml-backend-impl.h").is_file():
        return linked
    with shared_env():
        return llamacpp.source_dir()


@pytest.fixture(scope="module")
def async_cpu_library(llama_build: llamacpp.Build, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shim, against the build's ggml (its internal headers for the interfaces, its libraries)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = build_source(llama_build)
    return native_builds.compile_program(
        compiler, ["-std=c++17", "-O2", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror",
                   f"-I{src / 'ggml/include'}", f"-I{src / 'ggml/src'}"],
        [SHIM], tmp_path_factory.mktemp("async-cpu") / "libasync-cpu.so",
        ["-shared", f"-L{llama_build.bin_dir}", f"-Wl,-rpath,{llama_build.bin_dir}", "-lggml-cpu", "-lggml-base"],
        "the async-cpu ggml library")


@pytest.fixture(scope="module")
def asan_backend_library(llama_build: llamacpp.Build, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host's backend library (where 0030's waits live) compiled with AddressSanitizer and
    UndefinedBehaviorSanitizer, for the sanitized apir-host (`asan_host`, the same compiler's runtime)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = build_source(llama_build)
    backend = src / "ggml/src/ggml-virtgpu/backend"
    return native_builds.compile_program(
        compiler, ["-std=c++20", "-O1", "-g", "-fPIC", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-DGGML_BACKEND_SHARED",
                   "-DGGML_SHARED", "-D_GNU_SOURCE",
                   f"-I{backend.parent}", f"-I{src / 'ggml/src'}", f"-I{src / 'ggml/include'}"],
        sorted(backend.glob("*.cpp")), tmp_path_factory.mktemp("asan-backend") / "libggml-virtgpu-backend.so",
        ["-shared", f"-L{llama_build.bin_dir}", f"-Wl,-rpath,{llama_build.bin_dir}", "-lggml-base", "-ldl"],
        "the APIR backend library (sanitized)")


def greedy_completion(url: str) -> tuple[list[int], int]:
    """The token ids of a greedy completion of PROMPT, and the prompt tokens computed for it."""
    body = json.dumps({"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1, "seed": 7,
                       "cache_prompt": False, "ignore_eos": True, "return_tokens": True}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    assert len(answer["tokens"]) == N_PREDICT, answer
    return [int(t) for t in answer["tokens"]], int(answer["timings"]["prompt_n"])


@pytest.fixture(scope="module")
def native(llama_build: llamacpp.Build, demo_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[list[int], int]:
    """Native CPU llama-server's tokens, and the prompt's, computed in several micro-batches."""
    with build_servers.llama_server(llama_build, demo_model, tmp_path_factory.mktemp("native"),
                                    ["-ngl", "0", *FLAGS]) as (_, url, _log):
        tokens, prompt_n = greedy_completion(url)
    assert prompt_n > 6 * UBATCH, prompt_n
    return tokens, prompt_n


def shim_counts(log: Path) -> list[dict[str, int]]:
    """The counts the shim wrote, one line per client served (each by a child of its own)."""
    return [dict(zip(KEYS, map(int, m.groups()), strict=True))
            for m in COUNTS.finditer(log.read_text(errors="replace"))]


def nth_counts(log: Path, n: int) -> list[dict[str, int]]:
    """The counts of the `n`th client served (from 0), once it has gone: none before."""
    return shim_counts(log)[n:n + 1]


def remote_run(build: llamacpp.Build, model: Path, workdir: Path, library: Path,  # noqa: F811
               host_env: dict[str, str], client_env: dict[str, str] | None = None,
               backend_library: Path | None = None) -> tuple[list[int], dict[str, int]]:
    """The greedy completion through apir-host (over `backend_library`, default the build's) over the
    shim, `host_env` added to the host's environment and `client_env` to llama-server's; and the shim's
    counts, which it writes when its client has gone."""
    with apir_host(build.binary("apir-host"), build, workdir, env=host_env, ggml_library=library,
                   backend_library=backend_library, extra_args=["--ggml-reg", REG, "--threads", "1"]
                   ) as (_, path, host_log):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VIRTGPU_")}
        env.update({"GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0", **(client_env or {})})
        with build_servers.llama_server(build, model, workdir, ["-ngl", "99", *FLAGS], env) as (_, url, _log):
            tokens, _ = greedy_completion(url)
        found = wait_for("the shim's counts in apir-host's log, once its client has gone",
                         functools.partial(nth_counts, host_log, 0), 60)
    return tokens, found[0]


def test_runs_answered_ahead_keep_natives_tokens_and_touch_nothing_under_a_compute(
        llama_build: llamacpp.Build, demo_model: Path, workdir: Path,  # noqa: F811
        async_cpu_library: Path, native: tuple[list[int], int]) -> None:
    native_tokens, prompt_n = native
    least = prompt_n // UBATCH + N_PREDICT  # every micro-batch of the prompt and every token, on the shim

    tokens, ahead = remote_run(llama_build, demo_model, workdir, async_cpu_library, {"GGML_VIRTGPU_RUN_AHEAD": "1"})
    assert tokens == native_tokens
    assert ahead["computes"] >= least and ahead["failed"] == 0, ahead
    # the prompt's micro-batches without outputs: answered with their compute still to run, the next one
    # queued behind it
    assert ahead["ahead"] > 0 and ahead["overlapped"] > 0, ahead
    assert ahead["unsafe"] == 0, ahead

    tokens, waiting = remote_run(llama_build, demo_model, workdir, async_cpu_library, {"GGML_VIRTGPU_RUN_AHEAD": "0"})
    assert tokens == native_tokens
    assert waiting["computes"] >= least and waiting["failed"] == 0, waiting
    assert waiting["ahead"] == 0 and waiting["overlapped"] == 0 and waiting["unsafe"] == 0, waiting


def test_shared_buffers_keep_natives_tokens(llama_build: llamacpp.Build, demo_model: Path, workdir: Path,  # noqa: F811
                                            async_cpu_library: Path, native: tuple[list[int], int]) -> None:
    """The frontend's shared buffers (GGML_VIRTGPU_SHARED_BUFFERS, on where the host's device makes buffers
    of memory it is given, as ggml-metal's does): the client writes a micro-batch's inputs and reads its
    results in the buffers' memory, and a run has neither writes nor outputs. Answered before its compute,
    the next micro-batch's inputs overwrote what it computes with (the host found an index out of range
    and ended the client): a graph with a tensor in such a buffer is waited for, and keeps native's
    tokens."""
    tokens, counts = remote_run(llama_build, demo_model, workdir, async_cpu_library,
                                {"GGML_VIRTGPU_RUN_AHEAD": "1", "ASYNC_CPU_FROM_PTR": "1"},
                                {"GGML_VIRTGPU_SHARED_BUFFERS": "1"})
    assert tokens == native[0]
    assert counts["failed"] == 0 and counts["unsafe"] == 0 and counts["ahead"] == 0, counts


# --- what follows a run answered ahead: a client written by hand -----------------------------------

ONES, TENS = [1.0 + i for i in range(16)], [10.0 * i for i in range(16)]
SUMS = [a + b for a, b in zip(ONES, TENS, strict=True)]
#: each compute starts this long after it was queued: the client's next command comes first
DELAY_MS = 200


def run_ahead(c: GraphRunClient) -> None:
    """Graph 1 (out = x + y) with new inputs and no outputs: answered before its compute runs."""
    assert c.call(FORWARD, extensions.GET_FEATURES)[0] == FORWARD_BASE
    x, y, graph = c.graph()
    assert c.run(1, graph, c.inputs(x, y), (), ONES, TENS) == (FORWARD_BASE, extensions.RESULT_DONE, 0)


def forward(c: GraphRunClient, name: str, request: bytes) -> None:
    assert c.call(FORWARD, table.by_name(name).index, request)[0] == FORWARD_BASE, name


def read_out(c: GraphRunClient) -> list[float]:
    out = Tensor((16,), name="out", buffer=c.buffer, offset=128)
    forward(c, "buffer_get_tensor", messages.encode_request("buffer_get_tensor", buffer=c.buffer, tensor=out.to_rpc(),
                                                            res_id=OUT_RES, offset=0, size=64))
    return c.output()


def clear(c: GraphRunClient) -> None:
    forward(c, "buffer_clear", messages.encode_request("buffer_clear", buffer=c.buffer, value=0))


def free(c: GraphRunClient) -> None:
    forward(c, "buffer_free_buffer", struct.pack("<Q", c.buffer))


#: what a client does next, then it leaves: a read (what it read), a clear, a free (each a command of its
#: own), or nothing
NEXT: dict[str, Callable[[GraphRunClient], list[float] | None]] = {
    "a read": read_out, "a clear": clear, "a free": free, "the client's end": lambda c: None}


def commands_after_a_run_ahead(build: llamacpp.Build, workdir: Path, library: Path,  # noqa: F811
                               backend_library: Path | None = None, exe: Path | None = None
                               ) -> dict[str, tuple[dict[str, int], list[float] | None]]:
    """Each of NEXT right after a run answered ahead, by a client each: the shim's counts of each, and
    what it read."""
    seen = {}
    with apir_host(exe or build.binary("apir-host"), build, workdir, env={"ASYNC_CPU_DELAY_MS": str(DELAY_MS)},
                   ggml_library=library, backend_library=backend_library,
                   extra_args=["--ggml-reg", REG, "--threads", "1"]) as (host, path, log):
        for i, (what, then) in enumerate(NEXT.items()):
            c = GraphRunClient(path)
            run_ahead(c)
            read = then(c)
            c.close()
            counts = wait_for(f"the shim's counts after {what}", functools.partial(nth_counts, log, i), 30)[0]
            seen[what] = (counts, read)
            assert host.poll() is None, log.read_text(errors="replace")[-3000:]
    return seen


@pytest.mark.parametrize("host", ["release", "sanitized"])
def test_every_other_command_and_the_clients_end_wait_for_a_compute_answered_ahead(
        llama_build: llamacpp.Build, workdir: Path, async_cpu_library: Path,  # noqa: F811
        host: str, request: pytest.FixtureRequest) -> None:
    """Sanitized: apir-host and its backend library under AddressSanitizer and UndefinedBehaviorSanitizer
    (a report ends the host, and the client's next call fails)."""
    exe, backend_library = None, None
    if host == "sanitized":
        exe, backend_library = request.getfixturevalue("asan_host"), request.getfixturevalue("asan_backend_library")
    seen = commands_after_a_run_ahead(llama_build, workdir, async_cpu_library, backend_library, exe)
    for what, (counts, _) in seen.items():
        assert counts["computes"] == 1 and counts["ahead"] == 1 and counts["failed"] == 0, (what, seen)
        assert counts["unsafe"] == 0, (what, seen)
    assert seen["a read"][1] == SUMS, "read before the compute that writes it"
