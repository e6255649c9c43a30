"""A state save's reads in one call (llama_patches 0027 and 0028).

llama-server saves an idle slot's cells to its prompt cache before it starts a new task, and llama.cpp
read them one ggml_backend_tensor_get at a time: through APIR a round trip each, while every other
sequence waited. llama.cpp now reads them with ggml_backend_tensor_get_async and synchronizes each
backend once; the frontend keeps the reads until that synchronize and sends them as one EXT_TENSORS_GET.
Through the real apir-host on the CPU (its buffers in the host's memory, as a GPU's are): requests that
evict and restore each other's cached prompts keep native's greedy tokens, and apir-host's own trace
shows the reads leaving `buffer_get_tensor` for EXT_TENSORS_GET, read for read. Through ggml-rpc-server,
whose client queues asynchronous reads on its dispatcher, the restored prompts keep native's tokens too.
The third and fourth requests are checked to have been served from the prompt cache. The sanitized apir-host
refuses a hostile batch before it copies anything, ends that client and serves on.
"""

from __future__ import annotations

import json
import struct
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from apirctl.apir import extensions, protocol
from apirctl.apir import trace as apir_trace
from apirctl.apir.tensor import Tensor
from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import (  # noqa: F401 (asan_host, workdir: fixtures)
    DATA_RES,
    FORWARD,
    FORWARD_BASE,
    OUT,
    OUT_RES,
    GraphRunClient,
    apir_host,
    asan_host,
    workdir,
)
from tests.remoting.test_shm_native import rpc_offload, rpc_server
from tests.support import build_servers

pytestmark = pytest.mark.integration

#: each evicts the other's cells from the one slot, and the third and fourth find theirs in the prompt cache
PROMPTS = ["The river ran past the old mill where a miller kept his grain", "Counting the sacks each morning, he",
           "The river ran past the old mill where a miller kept his grain", "Counting the sacks each morning, he"]


def completions(url: str) -> list[list[int]]:
    """Each prompt's greedy tokens, one request after the other; the third and fourth must have found
    their prompt's cells in the prompt cache (restored from what the save read)."""
    out, cached = [], []
    for prompt in PROMPTS:
        body = json.dumps({"prompt": prompt, "n_predict": 12, "temperature": 0, "top_k": 1, "seed": 7,
                           "cache_prompt": True, "return_tokens": True}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.load(r)
        out.append([int(t) for t in answer["tokens"]])
        cached.append(int(answer["timings"]["cache_n"]))
    assert cached[0] == 0 and min(cached[2:]) > 0, cached
    return out


def remote_reads(build: llamacpp.Build, model: Path, workdir: Path, env: dict[str, str],  # noqa: F811
                 native: list[list[int]]) -> tuple[int, list[int]]:
    """Through apir-host with the frontend's `env`: asserts native's tokens; (buffer_get_tensor calls,
    each EXT_TENSORS_GET's count of reads) in the host's trace."""
    trace = workdir / f"trace-{len(list(workdir.glob('trace-*')))}.bin"
    with apir_host(build.binary("apir-host"), build, workdir, trace) as (_, path, _log):
        remote_env = {"GGML_VIRTGPU_SOCKET": str(path), "GGML_VIRTGPU_SHARED_BUFFERS": "0", **env}
        with build_servers.llama_server(build, model, workdir, ["-ngl", "99", "-np", "1"], remote_env) as (_, url, _):
            assert completions(url) == native
    records = [r for r in apir_trace.read(trace.read_bytes()) if r.cmd_type == protocol.CommandType.FORWARD]
    gets = [found.n_reads for r in records if (found := r.tensors_get()) is not None]
    return sum(1 for r in records if r.name == "buffer_get_tensor"), gets


@pytest.mark.slow
def test_a_prompt_cache_save_is_one_call_and_keeps_native_tokens(llama_build: llamacpp.Build, demo_model: Path,
                                                                 workdir: Path) -> None:  # noqa: F811
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", "-np", "1"]) as (_, url, _log):
        native = completions(url)
    assert native[0] == native[2] and native[1] == native[3]
    one_by_one, none = remote_reads(llama_build, demo_model, workdir, {"GGML_VIRTGPU_TENSORS_GET": "0"}, native)
    left, batched = remote_reads(llama_build, demo_model, workdir, {}, native)
    assert none == []
    # a save per new task after the first, each one call of the layers' K and V (two at least)
    assert len(batched) >= len(PROMPTS) - 1 and min(batched) >= 2, batched
    # read for read, what went one by one now goes in those calls
    assert one_by_one - left == sum(batched), (one_by_one, left, batched)


@pytest.mark.slow
def test_through_rpc_a_save_read_on_the_backend_keeps_native_tokens(llama_build: llamacpp.Build, demo_model: Path,
                                                                      workdir: Path) -> None:  # noqa: F811
    """0027 on the RPC client, whose backend queues asynchronous reads on its dispatcher: the restored
    prompts' tokens are native's."""
    with build_servers.llama_server(llama_build, demo_model, workdir, ["-ngl", "0", "-np", "1"]) as (_, url, _log):
        native = completions(url)
    with rpc_server(llama_build, workdir) as (_, endpoint, _server_log), \
            build_servers.llama_server(llama_build, demo_model, workdir,
                                       [*rpc_offload(endpoint), "-np", "1"]) as (_, url, _log):
        assert completions(url) == native


def _negotiate(c: GraphRunClient, wanted: int) -> int:
    ret, reply = c.call(FORWARD, extensions.GET_FEATURES, extensions.encode_features_request(wanted))
    assert ret == FORWARD_BASE
    return extensions.decode_features(reply)


def _get(c: GraphRunClient, reads: list[extensions.Write], n_reads: int | None = None, res_id: int = DATA_RES) -> int:
    """One EXT_TENSORS_GET of `reads`, their records at offset 0 of `res_id`: the forward return."""
    records = extensions.encode_writes(reads)
    target = c.maps[res_id]
    target[0:min(len(records), len(target))] = records[:len(target)]
    request = extensions.TensorsGet(res_id, len(reads) if n_reads is None else n_reads).encode()
    return c.call(FORWARD, extensions.TENSORS_GET, request)[0]


def _computed(path: Path) -> tuple[GraphRunClient, Tensor, Tensor]:
    """A client granted the command (narrow records) whose x and y were written and computed."""
    c = GraphRunClient(path)
    wanted = extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_TENSORS_GET
    assert _negotiate(c, wanted) == wanted
    x, y, graph = c.graph()
    assert c.run(1, graph, c.inputs(x, y), OUT, ONES, TENS) == (FORWARD_BASE, extensions.RESULT_DONE, 0)
    c.maps[DATA_RES][AT:AT + 128] = b"\xee" * 128
    return c, x, y


ONES, TENS = [1.0 + i for i in range(16)], [10.0 * i for i in range(16)]
AT = 8192  # where the reads land in the data resource


#: a read the host refuses, of the client's y (16 floats at offset 64 of its 4 KiB buffer)
BAD_READS: dict[str, Callable[[GraphRunClient, Tensor], extensions.Write]] = {
    "past its tensor": lambda c, y: extensions.Write(c.buffer, y.to_rpc(), 32, 64, AT + 64),
    "an offset that wraps the size": lambda c, y: extensions.Write(c.buffer, y.to_rpc(), (1 << 64) - 8, 16, AT + 64),
    "past the resource": lambda c, y: extensions.Write(c.buffer, y.to_rpc(), 0, 64, (1 << 20) - 32),
    "a destination that wraps": lambda c, y: extensions.Write(c.buffer, y.to_rpc(), 0, 64, (1 << 64) - 32),
    "a tensor past its buffer": lambda c, y: extensions.Write(
        c.buffer, Tensor((16,), name="outside", buffer=c.buffer, offset=4096 - 32).to_rpc(), 0, 16, AT + 64),
    "an unknown buffer": lambda c, y: extensions.Write(c.buffer + 1, y.to_rpc(), 0, 16, AT + 64),
}


def test_apir_host_reads_in_one_call_and_ends_a_client_that_asks_too_much(asan_host: Path,  # noqa: F811
                                                                           llama_build: llamacpp.Build,
                                                                           workdir: Path) -> None:  # noqa: F811
    """Through the sanitized apir-host, after a compute: both inputs read back in one call. Every refusal
    copies nothing, not even the good read before the bad one, and ends that client as any refused call
    does; the next client is served."""
    with apir_host(asan_host, llama_build, workdir) as (host, path, log):
        c, x, y = _computed(path)
        assert _get(c, [extensions.Write(c.buffer, x.to_rpc(), 0, 64, AT),
                        extensions.Write(c.buffer, y.to_rpc(), 32, 32, AT + 64)]) == FORWARD_BASE
        assert list(struct.unpack_from("<16f", c.maps[DATA_RES], AT)) == ONES
        assert list(struct.unpack_from("<8f", c.maps[DATA_RES], AT + 64)) == TENS[8:]
        c.close()

        for name, bad in BAD_READS.items():
            c, x, y = _computed(path)
            good = extensions.Write(c.buffer, x.to_rpc(), 0, 64, AT)
            assert _get(c, [good, bad(c, y)]) == FORWARD_BASE + 1, name
            assert bytes(c.maps[DATA_RES][AT:AT + 128]) == b"\xee" * 128, name
            assert c.closed_by_host(), name
            c.close()
        for name, n_reads, res_id in (("no reads", 0, DATA_RES),
                                      ("more than the host takes", extensions.MAX_READS + 1, DATA_RES),
                                      ("records past the resource", extensions.MAX_READS, OUT_RES)):
            c, x, _y = _computed(path)
            good = extensions.Write(c.buffer, x.to_rpc(), 0, 64, AT)
            assert _get(c, [good], n_reads=n_reads, res_id=res_id) == FORWARD_BASE + 1, name
            assert bytes(c.maps[DATA_RES][AT:AT + 128]) == b"\xee" * 128, name
            assert c.closed_by_host(), name
            c.close()
        assert host.poll() is None, log.read_text(errors="replace")[-3000:]
