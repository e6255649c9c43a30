"""A prompt batch is one call to the host (llama_patches 0013's held writes).

A prompt batch writes its inputs, among them the attention mask (cells by tokens, in halves or floats:
128 or 256 KiB for 256 by 256), then computes. Writes wait on the frontend and ride in the compute's call, but a cap of
64 KiB a write sent the mask alone: each batch cost the flush of the smaller writes, the mask's own
call, then the compute, three synchronous round trips where one does. llama-bench's prompt runs
through the real apir-host on the CPU, with the buffers in the host's memory as a GPU's are, counted
in apir-host's own trace.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from apirctl.apir import protocol
from apirctl.apir import trace as apir_trace
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import apir_host, workdir  # noqa: F401 (workdir: a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH = 256


def test_each_prompt_batch_is_one_synchronous_call(llama_build: llamacpp.Build, demo_model: Path,
                                                   workdir: Path) -> None:  # noqa: F811
    trace = workdir / "trace.bin"
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, _log):
        env = {**os.environ, "GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0"}
        done = subprocess.run([str(llama_build.binary("llama-bench")), "-m", str(demo_model), "-p", str(BATCH),
                               "-n", "0", "-b", str(BATCH), "-ub", str(BATCH), "-r", "3", "-ngl", "99", "-t", "1",
                               "-o", "json"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"\"n_prompt\": {BATCH}" in done.stdout, done.stdout[-2000:]

    forwarded = [r for r in apir_trace.read(trace.read_bytes()) if r.cmd_type == protocol.CommandType.FORWARD]
    runs = [i for i, r in enumerate(forwarded) if (found := r.graph_run()) is not None and found[0].graph_id != 0]
    assert len(runs) >= 4, "the warm-up and three repetitions computed on the host"
    # from the second repetition on, the graph is a kept one: between two of its computes nothing else
    # is asked (before: a flush of held writes, then a buffer_set_tensor of the 128 KiB mask)
    between = [[forwarded[j].name for j in range(a + 1, b)] for a, b in zip(runs[-3:-1], runs[-2:], strict=True)]
    assert between == [[], []], between
    alone = [r.arguments()["request"].get("size") for r in forwarded[runs[0]:] if r.name == "buffer_set_tensor"]
    assert alone == [], "a batch's input went in a call of its own"
