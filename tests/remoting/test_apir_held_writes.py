"""A prompt batch's inputs of over 32 MiB ride in its compute's call (llama_patches 0013's held writes).

0013 holds a batch's writes in a resource of their own, up to 64 MiB of bytes, and sends them with the
compute: one call, one copy on the frontend. A batch of 2048 tokens of the demo model writes 33 MiB:
its token embeddings (computed on the CPU, as llama.cpp keeps the input layer there) three times, as
the scheduler copies a split's input, 4.5 MiB each, 3 MiB of cache indices and, without flash attention,
a 16 MiB float mask. With writes held up to 8 MiB each and 32 MiB in all, the mask went in a call of
its own after a flush. llama-perplexity over one such batch, through the real apir-host on the CPU with
the buffers in the host's memory as a GPU's are: its result must be native's, and no write of the batch
may go in a call of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.remoting import test_apir_outputs_grow as outputs_grow

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTEXT = 2048


def perplexity(build: llamacpp.Build, model: Path, text: Path, env: dict[str, str]) -> str:
    """One chunk of CONTEXT tokens in one batch, flash attention off (its mask is then floats: 4 bytes a cell)."""
    return outputs_grow.perplexity(build, model, text, env, CONTEXT, ("--chunks", "1", "-fa", "off", "-t", "2"))


def test_a_batch_of_33_mib_of_inputs_is_one_call(llama_build: llamacpp.Build, demo_model: Path,
                                                 workdir: Path) -> None:
    # about 4,600 tokens: llama-perplexity wants twice CONTEXT
    forwarded = outputs_grow.native_then_remoted(llama_build, demo_model, workdir, 140, perplexity)
    runs = [i for i, r in enumerate(forwarded) if (found := r.graph_run()) is not None and found[0].graph_id != 0]
    assert runs, "the batch computed on the host"
    # from the first compute on (the weights were written before it), the inputs (embeddings, indices, the
    # 16 MiB mask) went in the computes' calls, not in calls of their own
    alone = [r.arguments()["request"].get("size") for r in forwarded[runs[0]:] if r.name == "buffer_set_tensor"]
    assert not [size for size in alone if size and size >= 1 << 20], alone
    flushes = [r for r in forwarded[runs[0]:] if (found := r.graph_run()) is not None and found[0].graph_id == 0]
    assert flushes == [], "held writes were flushed before a compute"  # (a write past the cap forced one)
