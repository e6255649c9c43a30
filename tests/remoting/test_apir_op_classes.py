"""The questions a frontend asks the host before a graph of a new shape (llama_patches 0020).

Under llama-server load every request that joins or leaves the batch gives the graph a new shape.
With answers kept per exact shape the frontend asked apir-host `device_supports_op` and
`buffer_type_get_alloc_size` again for most ops, one synchronous call each, before it could compute
(issue 31). With APIR_FEATURE_OP_CLASSES it keeps them per op class, not per batch size. The real
llama-server, with streams that join and leave at different steps, through the real apir-host on the
CPU, counted in apir-host's own trace; every request's greedy tokens are native's either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from apirctl.apir import extensions, protocol
from apirctl.apir import trace as apir_trace
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import apir_host, workdir  # noqa: F401 (workdir: a fixture)
from tests.support import build_servers
from tests.support.backend_ops import ANSI, DEVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUERIES = ("device_supports_op", "buffer_type_get_alloc_size")
# the ops the frontend keeps by class, as test-backend-ops names them (GLU and UNARY by their kind)
CLASSED = ("ADD", "SUB", "MUL", "DIV", "SCALE", "NORM", "RMS_NORM", "SWIGLU", "GEGLU", "REGLU", "SILU", "GELU",
           "RELU", "CPY", "CONT", "DUP", "GET_ROWS", "SET_ROWS", "MUL_MAT", "ROPE", "SOFT_MAX")


def plan(streams: int) -> list[list[tuple[str, int]]]:
    """Per stream, three requests in turn, of lengths that differ between streams and requests: the
    streams leave and join the batch at different steps."""
    return [[(f"Stream {s} request {r}: the colours of the sky are", 12 + 3 * s + 5 * r) for r in range(3)]
            for s in range(streams)]


def run_load(url: str, requests: list[list[tuple[str, int]]]) -> dict[str, list[int]]:
    """Every stream's requests in turn, the streams at once; each request's greedy tokens."""
    tokens: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def stream(mine: list[tuple[str, int]]) -> None:
        try:
            for prompt, n in mine:
                body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "seed": 7,
                                   "cache_prompt": False, "return_tokens": True, "ignore_eos": True}).encode()
                req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as r:
                    tokens[prompt] = [int(t) for t in json.load(r)["tokens"]]
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(mine,)) for mine in requests]
    for t in threads:
        t.start()
        time.sleep(0.3)  # the streams start at different steps too
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(tokens) == sum(len(mine) for mine in requests)
    return tokens


def native_tokens_through_apir(llama_build: llamacpp.Build, demo_model: Path, workdir: Path, streams: int,  # noqa: F811
                                context_per_stream: int, modes: dict[str, dict[str, str]], feature: int,
                                feature_mode: str) -> dict[str, Path]:
    """The load of `plan(streams)` on native llama-server, then through apir-host once per mode (its
    frontend environment): every mode's tokens are native's, and `feature` was granted in `feature_mode`
    alone. Returns each mode's apir-host trace."""
    flags = ["-np", str(streams), "-c", str(context_per_stream * streams)]
    requests = plan(streams)
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", *flags]) as (_, url, _log):
        native = run_load(url, requests)
    traces = {}
    for mode, env in modes.items():
        trace = traces[mode] = workdir / f"trace-{mode}.bin"
        with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, _host_log):
            remote_env = {"GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0", **env}
            with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "99", *flags],
                                            remote_env) as (_, url, _log):
                assert run_load(url, requests) == native, mode
        granted = [g for r in apir_trace.read(trace.read_bytes()) if (g := r.features_granted()) is not None]
        assert granted and all(bool(g & feature) == (mode == feature_mode) for g in granted), mode
    return traces


def questions_after_the_first_compute(trace: Path) -> tuple[int, dict[str, int]]:
    """Decode steps after the first, and the questions asked between them, by function."""
    forwarded = [r for r in apir_trace.read(trace.read_bytes()) if r.cmd_type == protocol.CommandType.FORWARD]
    computes = [i for i, r in enumerate(forwarded)
                if r.name == "backend_graph_compute" or ((found := r.graph_run()) and found[0].graph_id)]
    assert len(computes) >= 24, "the generation ran on the host"
    later = forwarded[computes[0] + 1:]
    return len(computes) - 1, {name: sum(1 for r in later if r.name == name) for name in QUERIES}


@pytest.mark.parametrize("streams", [1, 4])
def test_a_new_batch_size_is_not_a_new_round_of_questions(llama_build: llamacpp.Build, demo_model: Path,
                                                          workdir: Path, streams: int) -> None:  # noqa: F811
    traces = native_tokens_through_apir(llama_build, demo_model, workdir, streams, 256,
                                        {"exact": {"GGML_VIRTGPU_OP_CLASSES": "0"}, "classes": {}},
                                        extensions.FEATURE_OP_CLASSES, "classes")
    asked = {mode: questions_after_the_first_compute(trace) for mode, trace in traces.items()}

    (steps, exact), (_, classes) = asked["exact"], asked["classes"]
    total_exact, total_classes = sum(exact.values()), sum(classes.values())
    # one stream: the batch is one token after the prompt, and the prompts differ in length
    assert total_classes <= total_exact // 4, asked
    assert classes["buffer_type_get_alloc_size"] <= 2 * streams, asked  # FLASH_ATTN_EXT's, per new shape
    if streams > 1:
        # the load the issue measured: questions before most new shapes, with the exact keys
        assert total_exact >= steps // 2, asked
        assert total_classes <= steps // 2, asked


def test_a_class_answer_is_the_hosts_for_every_case(llama_build: llamacpp.Build, workdir: Path) -> None:  # noqa: F811
    """Every case test-backend-ops has for the ops kept by class (thousands of shapes, layouts, types
    and parameters, in its order, so that a case finds the classes of the cases before it): the APIR
    device's supports_op answers with the answers kept by class are those it gets asking the host for
    every shape."""
    tester = build_servers.backend_ops_tester(llama_build)
    answers = {}
    for mode, env in (("exact", {"GGML_VIRTGPU_OP_CLASSES": "0"}), ("classes", {})):
        with apir_host(llama_build.binary("apir-host"), llama_build, workdir) as (host, path, _log):
            done = subprocess.run([str(tester), "support", "-b", DEVICE, "-o", ",".join(CLASSED)],
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "GGML_VIRTGPU_SOCKET": str(path), **env})
            assert done.returncode == 0 and host.poll() is None, done.stdout[-2000:] + done.stderr[-2000:]
        answers[mode] = [ANSI.sub("", line).strip() for line in done.stdout.splitlines() if "): " in line]
    exact, classes = answers["exact"], answers["classes"]
    assert len(exact) > 1000 and exact == classes, [(a, b) for a, b in zip(exact, classes, strict=False) if a != b][:5]
    refused = sum(1 for line in exact if line.endswith("NOT SUPPORTED"))
    assert 0 < refused < len(exact), "some supported, some not: the answers are the host's, not a default"
