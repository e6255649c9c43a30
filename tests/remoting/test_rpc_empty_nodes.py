"""A micro-batch that asks for no outputs stays on the RPC server's device (llama_patches 0022).

llama.cpp splits a prompt longer than its micro-batch; every micro-batch but the last asks for no
logits, so the last layer's nodes have no rows. ggml-rpc-server's node checks refuse such a node's
strides, and before 0022 the client answered supports_op false for it: the scheduler ran that layer
on the CPU, after the RPC split, and read its weights and the output matrix back from the server in
every such micro-batch. Now the client answers it supported and leaves it out of the graph it sends.
The real llama-server through the real ggml-rpc-server on the CPU over a Unix socket, seen in the
scheduler's own split listing (GGML_SCHED_DEBUG=1, printed at llama-server's -v); the greedy tokens
are native's.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.remoting.test_apir_empty_nodes import MICRO_BATCH, greedy_tokens
from tests.remoting.test_shm_native import rpc_offload, rpc_server, workdir  # noqa: F401 (workdir: a fixture)
from tests.support import build_servers

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]

# ggml_backend_sched_print_assignments: one line per split of every graph it schedules, from #0
SPLIT = re.compile(r"^## SPLIT #(\d+): (\S+) # \d+ inputs", re.MULTILINE)


def scheduled_graphs(log: str) -> list[list[str]]:
    """The backends of each scheduled graph's splits, in order."""
    graphs: list[list[str]] = []
    for m in SPLIT.finditer(log):
        if m.group(1) == "0":
            graphs.append([])
        assert graphs, f"a split listing that does not start at #0: {m.group(0)}"
        graphs[-1].append(m.group(2))
    return graphs


def cpu_after_rpc(graph: list[str]) -> bool:
    """A split on the CPU after one on the RPC device: part of the model came back to the client."""
    seen_rpc = False
    for backend in graph:
        if backend.startswith("RPC"):
            seen_rpc = True
        elif backend.startswith("CPU") and seen_rpc:
            return True
    return False


def test_a_prompt_longer_than_the_micro_batch_keeps_every_layer_on_the_server(
        llama_build: llamacpp.Build, demo_model: Path, workdir: Path) -> None:  # noqa: F811
    flags = ["-b", str(MICRO_BATCH), "-ub", str(MICRO_BATCH)]
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", *flags]) as (_, url, _log):
        native = greedy_tokens(url)
    debug = {**os.environ, "GGML_SCHED_DEBUG": "1"}
    with rpc_server(llama_build, workdir) as (_, endpoint, _server_log), \
            build_servers.llama_server(llama_build, demo_model, workdir, [*rpc_offload(endpoint), *flags, "-v"],
                                       debug) as (_, url, log):
        assert greedy_tokens(url) == native
        text = log.read_text(errors="replace")

    graphs = scheduled_graphs(text)
    # the listing is there to be read: the graphs reserved at load, and those of the prompt and the
    # generation (a graph llama.cpp reuses is not scheduled again; the first micro-batch without
    # outputs, the last one with its output and the first token's each are)
    assert "new prompt" in text, text[-3000:]
    computed = scheduled_graphs(text[text.index("new prompt"):])
    assert len(computed) >= 3 and all(any(b.startswith("RPC") for b in g) for g in computed), (computed, text[-3000:])
    # the token embedding on the CPU, then the model on the server; never a layer back on the CPU
    bad = [g for g in graphs if cpu_after_rpc(g)]
    assert bad == [], f"{len(bad)} of {len(graphs)} graphs ran nodes on the CPU after the RPC split: {bad[:3]}"
