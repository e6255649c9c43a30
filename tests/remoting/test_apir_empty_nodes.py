"""A micro-batch that asks for no outputs stays on the remote device (llama_patches 0022).

llama.cpp splits a prompt longer than its micro-batch; every micro-batch but the last asks for no
logits, so the last layer's nodes have no rows. The hosts' node checks refuse such a node's strides,
and before 0022 the frontend answered supports_op false for it: the scheduler ran that layer on the
CPU and read its weights and the output matrix back from the host in every such micro-batch (on a
GPU under serving load, 7-35 % of the time). Now the frontend answers it supported and leaves it out
of the graph it sends. The real llama-server through the real apir-host on the CPU, counted in
apir-host's own trace; the greedy tokens are native's.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from apirctl.apir import protocol
from apirctl.apir import trace as apir_trace
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import apir_host, workdir  # noqa: F401 (workdir: a fixture)
from tests.support import build_servers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MICRO_BATCH = 32
# about 130 tokens: four micro-batches of 32 without outputs before the last
PROMPT = " ".join(f"Item {n} of the list is a colour, a river or a town." for n in range(10))


def greedy_tokens(url: str) -> list[int]:
    body = json.dumps({"prompt": PROMPT, "n_predict": 8, "temperature": 0, "top_k": 1, "seed": 7,
                       "cache_prompt": False, "return_tokens": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    assert answer["timings"]["prompt_n"] > 3 * MICRO_BATCH, answer["timings"]
    return [int(t) for t in answer["tokens"]]


# With op classes off (the frontend's GGML_VIRTGPU_OP_CLASSES=0, and every host backend but ggml-cpu's and
# ggml-cuda's, which never grant them) the frontend asks the host to size each node, and the host's node
# checks refused an empty one: the prompt ended llama-server. The frontend sizes it itself now.
@pytest.mark.parametrize("op_classes", ["1", "0"])
def test_a_prompt_longer_than_the_micro_batch_keeps_every_layer_on_the_host(
        llama_build: llamacpp.Build, demo_model: Path, workdir: Path, op_classes: str) -> None:  # noqa: F811
    flags = ["-b", str(MICRO_BATCH), "-ub", str(MICRO_BATCH)]
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", *flags]) as (_, url, _log):
        native = greedy_tokens(url)
    trace = workdir / "trace.bin"
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, trace) as (_, path, _host_log):
        remote_env = {"GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0",
                      "GGML_VIRTGPU_OP_CLASSES": op_classes}
        with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "99", *flags],
                                        remote_env) as (_, url, _log):
            assert greedy_tokens(url) == native

    forwarded = [r for r in apir_trace.read(trace.read_bytes()) if r.cmd_type == protocol.CommandType.FORWARD]
    computes = [r for r in forwarded if r.name == "backend_graph_compute" or r.graph_run() is not None]
    assert len(computes) >= 5 + 8, "the prompt's micro-batches and the generation ran on the host"
    refused = [r.arguments()["request"] for r in forwarded
               if r.name == "device_supports_op" and r.ok and not r.arguments()["reply"]["supported"]]
    assert refused == [], f"{len(refused)} ops answered unsupported: the layer went to the CPU"
    # nothing of the model's weights comes back: what the host is asked for is the KV cache's and the
    # logits' bytes, not a layer's matrices (before 0022, every micro-batch without outputs read them)
    weights_read = [r for r in forwarded if r.name == "buffer_get_tensor"
                    and r.arguments()["request"].get("size", 0) > 1 << 20]
    assert weights_read == [], [r.arguments()["request"] for r in weights_read]
