"""A compute's outputs come back in shared memory however many rows it has (llama_patches 0013).

The frontend keeps a resource for the outputs of a kept graph's compute, so that the get_tensor of the
logits that follows is answered there and is not a call. It was 8 MiB: a step of 32 sequences over a
vocabulary of 128k (16 MiB of logits) overflowed it, and every such step cost a `buffer_get_tensor` of
its own. It now grows to what the compute needs, up to 64 MiB. llama-perplexity asks for the logits
of half of each 256-token batch: 128 rows of the demo model's 49,152 entries, 24 MiB, through the real
apir-host on the CPU, counted in apir-host's own trace; its result must be native's.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from apirctl.apir import protocol
from apirctl.apir import trace as apir_trace
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import apir_host

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTEXT = 256
TEXT = ("the river ran past the old mill where a miller kept his grain and counted the sacks each morning "
        "before the carts came down from the hills with news of rain")


def perplexity(build: llamacpp.Build, model: Path, text: Path, env: dict[str, str], context: int = CONTEXT,
               flags: tuple[str, ...] = ("--chunks", "2", "-t", "1")) -> str:
    """llama-perplexity's final estimate line over chunks of `context` tokens, a chunk a batch (by default two
    chunks, one thread)."""
    done = subprocess.run([str(build.binary("llama-perplexity")), "-m", str(model), "-f", str(text),
                           "-c", str(context), "-b", str(context), "-ub", str(context), "-ngl", "99", *flags],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"Final estimate: PPL = [0-9.]+", done.stdout + done.stderr)
    assert found, (done.stdout + done.stderr)[-2000:]
    return found.group(0)


def native_then_remoted(build: llamacpp.Build, model: Path, workdir: Path, repeats: int,
                        run: Callable[[llamacpp.Build, Path, Path, dict[str, str]], str]
                        ) -> list[apir_trace.Record]:
    """`run` over TEXT `repeats` times natively, then through the real apir-host on the CPU (the buffers in
    the host's memory, as a GPU's are); asserts the two results are equal, and returns the host's
    FORWARD records."""
    text = workdir / "text.txt"
    text.write_text(" ".join([TEXT] * repeats) + "\n")
    native = run(build, model, text, {**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    trace = workdir / "trace.bin"
    with apir_host(build.binary("apir-host"), build, workdir, trace) as (_, path, _log):
        env = {**os.environ, "GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0"}
        remoted = run(build, model, text, env)
    assert remoted == native
    return [r for r in apir_trace.read(trace.read_bytes()) if r.cmd_type == protocol.CommandType.FORWARD]


def test_outputs_past_8_mib_come_back_without_a_call(llama_build: llamacpp.Build, demo_model: Path,
                                                     workdir: Path) -> None:
    # about 900 tokens: two chunks of CONTEXT need 512
    forwarded = native_then_remoted(llama_build, demo_model, workdir, 30, perplexity)
    runs = [r for r in forwarded if (found := r.graph_run()) is not None and found[0].graph_id != 0]
    assert len(runs) >= 2, "both chunks computed on the host"
    fetched = [r.arguments()["request"].get("size") for r in forwarded if r.name == "buffer_get_tensor"]
    assert fetched == [], f"outputs fetched by calls of their own: {fetched}"
