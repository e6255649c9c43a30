"""The APIR dispatch fuzzer (tests/apir/fuzz/): its seeds from a trace, and a short campaign against
the backend library built with AddressSanitizer and UndefinedBehaviorSanitizer.

The campaign is what issue 22 asks to keep at 0 findings: each input is a sequence of forwarded
calls with the shared memory they name (graphs, tensor data), reusing the handles the library
answered. The long run (1e6 inputs) is `python -m tests.apir.fuzz.campaign FUZZER --runs 1000000`;
its counts are in docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from apirctl.apir import extensions, messages, protocol, trace
from apirctl.apir.tensor import RPC_TENSOR_SIZE, RPC_TENSOR_WIDE_SIZE, Tensor
from tests.apir.fuzz import build as fuzz_build
from tests.apir.fuzz import campaign, seeds_from_trace
from tests.apir.fuzz.seeds_from_trace import CALL, PLACEHOLDER, RES_BUFFER, RES_GRAPH, RES_SIZE

BUFT, BUFFER = 0x7F00_1234_5000, 0x6100_0000_0A10


def record(fn: str, reply: bytes = b"", ok: bool = True, wide: bool = False, **values: Any) -> bytes:
    return trace.encode_record(messages.encode_forward(fn, 1, wide=wide, **values), reply, ret=4 if ok else 5)


def features_record(wanted: int, granted: int) -> bytes:
    request = messages.encode_command(protocol.CommandType.FORWARD, extensions.GET_FEATURES, 1)
    return trace.encode_record(request + extensions.encode_features_request(wanted), struct.pack("<Q", granted), ret=4)


def sample_trace() -> bytes:
    """A frontend's session as apir-host records it: a buffer type, a 64 MiB shared buffer, calls on both."""
    tensor = Tensor((16,), buffer=BUFFER, offset=64)
    return trace.MAGIC + b"".join([
        record("device_get_count", struct.pack("<i", 1)),
        record("device_get_buffer_type", struct.pack("<Q", BUFT)),
        record("buffer_type_get_alignment", struct.pack("<Q", 32), buft=BUFT),
        record("device_buffer_from_ptr", struct.pack("<QQ", BUFFER, BUFT + 8), res_id=7, size=64 << 20,
               max_tensor_size=64 << 20),
        record("buffer_set_tensor", tensor=tensor.to_rpc(), buffer=BUFFER, res_id=2, offset=0, size=64),
        record("backend_graph_compute", struct.pack("<i", 0), res_id=2, graph_size=4096),
        record("buffer_get_base", b"", ok=False, buffer=0xDEAD),
    ])


def calls_of(data: bytes) -> list[tuple[int, int, bytes, bytes]]:
    """The harness's reading of an input: (fn, resource, request, resource bytes) per call."""
    out, at = [], 0
    while len(data) - at >= CALL.size:
        fn, sel, req_len, _off, res_len = CALL.unpack_from(data, at)
        at += CALL.size
        request, res = data[at:at + req_len], data[at + req_len:at + req_len + res_len]
        at += req_len + res_len
        out.append((fn, sel, request, res))
    assert at == len(data)
    return out


def test_seeds_name_handles_by_the_harness_numbering_and_map_resources() -> None:
    calls = seeds_from_trace.calls_from_trace(trace.read(sample_trace()))
    assert [c.fn for c in calls] == [1, 7, 11, 9, 17, 22, 16]
    start = calls_of(seeds_from_trace.encode_input(calls))
    # the buffer type is the harness's handle 0; the buffer 1 (its buffer type, 2, follows it)
    assert start[2][2] == struct.pack("<Q", PLACEHOLDER | 0)
    res_id, size, max_size = struct.unpack_from("<IQQ", start[3][2])
    assert (res_id, size, max_size) == (RES_BUFFER, RES_SIZE, RES_SIZE)
    set_tensor = start[4][2]
    assert struct.unpack_from("<Q", set_tensor, 0)[0] == PLACEHOLDER | 1
    assert struct.unpack_from("<Q", set_tensor, 8 + 16)[0] == PLACEHOLDER | 1  # the tensor's buffer
    # graph_compute: our graph in the graph resource, every tensor in the session's buffer
    fn, sel, request, graph = start[5]
    assert (fn, sel) == (22, RES_GRAPH)
    assert struct.unpack("<IQ", request) == (RES_GRAPH, len(graph))
    n_nodes = struct.unpack_from("<I", graph)[0]
    first = 4 + 8 * n_nodes + 4
    n_tensors = struct.unpack_from("<I", graph, first - 4)[0]
    assert n_tensors >= 3 and len(graph) == first + n_tensors * RPC_TENSOR_SIZE
    assert all(struct.unpack_from("<Q", graph, first + i * RPC_TENSOR_SIZE + 16)[0] == PLACEHOLDER | 1
               for i in range(n_tensors))
    # an unknown handle stays as it was
    assert start[6][2] == struct.pack("<Q", 0xDEAD)


def test_seeds_carry_the_calls_that_made_their_handles() -> None:
    calls = seeds_from_trace.calls_from_trace(trace.read(sample_trace()))
    found = seeds_from_trace.seeds(calls)
    alignment = calls_of(found["fn11-0"])
    assert [c[0] for c in alignment] == [7, 11] and alignment[1][2] == struct.pack("<Q", PLACEHOLDER | 0)
    set_tensor = calls_of(found["fn17-0"])
    assert [c[0] for c in set_tensor] == [9, 17]
    assert struct.unpack_from("<Q", set_tensor[1][2])[0] == PLACEHOLDER | 0  # renumbered: the seed's own table
    assert {name.split("-")[0] for name in found} >= {"session", "graph", "buffer"}


def test_a_wide_trace_gives_wide_calls_that_negotiate_first() -> None:
    """A host that granted the wide records: the trace's tensors are wide, and so are the seed's calls,
    each input asking for them before its first wide call (the harness starts every input narrow)."""
    tensor = Tensor((16,), buffer=BUFFER, offset=64)
    data = trace.MAGIC + b"".join([
        record("device_get_buffer_type", struct.pack("<Q", BUFT)),
        record("device_buffer_from_ptr", struct.pack("<QQ", BUFFER, BUFT + 8), res_id=7, size=64 << 20,
               max_tensor_size=64 << 20),
        features_record(extensions.FEATURES, extensions.FEATURES),
        record("buffer_set_tensor", wide=True, tensor=tensor.to_rpc(), buffer=BUFFER, res_id=2, offset=0, size=64),
    ])
    records = trace.read(data)
    assert [r.wide_tensors for r in records] == [False, False, False, True]
    assert records[3].arguments()["request"]["tensor"]["ne"] == [16, 1, 1, 1]
    calls = seeds_from_trace.calls_from_trace(records)
    assert [(c.fn, c.wide) for c in calls] == [(7, False), (9, False), (17, True)]
    only_set = calls_of(seeds_from_trace.encode_input(seeds_from_trace.with_producers(calls, [2])))
    assert [c[0] for c in only_set] == [9, seeds_from_trace.EXT_GET_FEATURES, 17]
    assert only_set[1][2] == struct.pack("<Q", extensions.FEATURES)
    set_tensor = only_set[2][2]
    assert len(set_tensor) == 8 + RPC_TENSOR_WIDE_SIZE + 20
    assert struct.unpack_from("<I", set_tensor, 8 + RPC_TENSOR_WIDE_SIZE)[0] == seeds_from_trace.RES_DATA


def test_the_wide_seeds_reach_the_wide_decoding() -> None:
    found = seeds_from_trace.seeds(seeds_from_trace.calls_from_trace(trace.read(sample_trace())))
    assert {"wide-buffer-life", "wide-graph-run-life", "wide-graph"} <= set(found)
    for name in ("wide-buffer-life", "wide-graph-run-life", "wide-graph"):
        calls = calls_of(found[name])
        asks = [i for i, c in enumerate(calls) if c[0] == seeds_from_trace.EXT_GET_FEATURES]
        assert asks and calls[asks[0]][2] == struct.pack("<Q", extensions.FEATURES), name
    life = calls_of(found["wide-buffer-life"])
    set_tensor = next(c for c in life if c[0] == 17)[2]
    ne = struct.unpack_from("<4q", set_tensor, 8 + 24)
    assert ne[1] == 1 << 33  # a shape no narrow record holds
    graph = next(c for c in calls_of(found["wide-graph"]) if c[0] == 22)[3]
    first = 4 + 8 * struct.unpack_from("<I", graph)[0] + 4
    assert (len(graph) - first) % RPC_TENSOR_WIDE_SIZE == 0 and (len(graph) - first) % RPC_TENSOR_SIZE != 0


def test_the_committed_corpus_is_small_and_free_of_machine_paths() -> None:
    files = list(campaign.CORPUS.iterdir())
    assert 8 <= len(files) <= 80
    assert sum(f.stat().st_size for f in files) < 1 << 20
    for f in files:
        data = f.read_bytes()
        assert re.search(rb"/(home|root|tmp|Users|srv|opt)/", data) is None, f.name  # no path of a machine
        calls_of(data)  # each one is a whole number of calls
    assert any(f.name.startswith("wide-") for f in files)  # the negotiated, wide records among them


# --- the campaign -------------------------------------------------------------------------------

#: CI's fuzz smoke: seconds, not a campaign (docs/testing.md).
SMOKE_SECONDS = 15


@pytest.fixture(scope="module")
def fuzzer(sanitized_ggml) -> Path:  # type: ignore[no-untyped-def]
    """The fuzzer: its harness linked against the suite's one sanitized tree (tests/apir/conftest.py),
    which the graph fuzzers share; cached by the harness's digest."""
    from tests.support import native_builds

    digest = hashlib.sha256(fuzz_build.HARNESS.read_bytes()).hexdigest()[:8]
    exe = sanitized_ggml.harness_dir(digest) / "apir_dispatch_fuzz"
    with native_builds.locked(f"apir-dispatch-fuzz-{digest}"):  # the workers' other tests may need it too
        if not exe.exists():
            exe.parent.mkdir(parents=True, exist_ok=True)
            with native_builds.timed("the APIR dispatch fuzzer's harness (against the sanitized tree)"):
                fuzz_build.build_fuzzer(sanitized_ggml.lib_dir, exe)
    return exe


@pytest.mark.integration
def test_a_short_campaign_finds_nothing(fuzzer: Path, tmp_path: Path) -> None:
    """A smoke run: the committed corpus, then mutations for SMOKE_SECONDS (or 20,000 inputs): no
    sanitizer report, no signal, no abort, no leak, no slow input. The long campaigns (1e6 inputs, an
    hour on 2 cores) are benchmarks: `python benchmarks/fuzz_apir_dispatch.py --runs 1000000`, with
    their figures in docs/reliability.md."""
    result = campaign.run(fuzzer, 20_000, tmp_path / "artifacts", seed=22, max_total_time=SMOKE_SECONDS)
    assert result.clean, f"{result.findings}\n{result.reports}\n{result.log_tail}"
    assert result.inputs >= len(list(campaign.CORPUS.iterdir())) and result.edges > 0


@pytest.mark.integration
def test_earlier_findings_stay_fixed(fuzzer: Path) -> None:
    """The inputs that crashed the library before it checked what it is sent, replayed once each."""
    inputs = sorted(campaign.REGRESSIONS.iterdir())
    assert inputs
    done = campaign.replay(fuzzer, inputs)
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_delta_seed_reaches_the_graph_delta_command() -> None:
    """EXT_GRAPH_DELTA (llama_patches 0021) has a decoder of its own: a seed takes it, after a graph
    kept in the wide records, with a delta that applies, one the host refuses, and one after a free."""
    found = seeds_from_trace.seeds(seeds_from_trace.calls_from_trace(trace.read(sample_trace())))
    calls = calls_of(found["wide-graph-delta-life"])
    fns = [c[0] for c in calls]
    assert fns.count(seeds_from_trace.EXT_GRAPH_DELTA) == 3 and seeds_from_trace.EXT_GRAPH_RUN in fns
    asks = [c for c in calls if c[0] == seeds_from_trace.EXT_GET_FEATURES]
    assert asks and struct.unpack("<Q", asks[0][2])[0] & extensions.FEATURE_GRAPH_DELTA
    first_delta = next(c for c in calls if c[0] == seeds_from_trace.EXT_GRAPH_DELTA)
    assert extensions.GraphRun.decode(first_delta[2], delta=True).n_changes == 4
    assert len(first_delta[3]) == 4 * extensions.CHANGE_SIZE == 448
    assert any(f.name.startswith("wide-graph-delta-life-") for f in campaign.CORPUS.iterdir())


def test_the_tensors_get_seed_reaches_its_command() -> None:
    """EXT_TENSORS_GET (llama_patches 0028) has a decoder of its own: a seed takes it with two reads that
    are made, a batch the host refuses (its second read past the tensor), and a read after a free."""
    found = seeds_from_trace.seeds(seeds_from_trace.calls_from_trace(trace.read(sample_trace())))
    calls = calls_of(found["wide-tensors-get-life"])
    gets = [c for c in calls if c[0] == seeds_from_trace.EXT_TENSORS_GET]
    assert [extensions.TensorsGet.decode(c[2]).n_reads for c in gets] == [2, 2, 1]
    assert len(gets[0][3]) == 2 * extensions.WRITE_SIZE_WIDE
    asks = [c for c in calls if c[0] == seeds_from_trace.EXT_GET_FEATURES]
    assert asks and struct.unpack("<Q", asks[0][2])[0] & extensions.FEATURE_WIDE_TENSORS
    assert any(f.name.startswith("wide-tensors-get-life-") for f in campaign.CORPUS.iterdir())
