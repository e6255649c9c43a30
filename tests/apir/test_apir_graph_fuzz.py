"""The graph fuzzers (tests/apir/graph_fuzz/): their seed corpus, and a short campaign of each against
the pinned, patched source built with AddressSanitizer and UndefinedBehaviorSanitizer.

Each campaign computes graphs through a host's real entry point (the APIR backend library's
dispatcher; ggml-rpc's server loop) on the real CPU backend: any sanitizer report, abort, signal or
slow input is a finding, and the test asserts none. The long campaign is benchmarks/fuzz_graphs.py;
its figures are in docs/reliability.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.apir.graph_fuzz import build as graph_build
from tests.apir.graph_fuzz import campaign, seeds


def test_the_committed_corpus_is_what_seeds_writes(tmp_path: Path) -> None:
    written = {p.name: p.read_bytes() for p in seeds.write(tmp_path)}
    committed = {p.name: p.read_bytes() for p in campaign.CORPUS.iterdir()}
    assert written == committed


def test_the_corpus_is_small_covers_the_ops_and_holds_no_machine_paths() -> None:
    files = list(campaign.CORPUS.iterdir())
    assert 20 <= len(files) <= 100 and sum(f.stat().st_size for f in files) < 64 << 10
    ops = {data[6] for data in (f.read_bytes() for f in files)}  # the first node's op selector
    assert ops == set(range(15))  # every op the generator builds starts a seed
    for f in files:
        assert re.search(rb"/(home|root|tmp|work|Users)/", f.read_bytes()) is None, f.name


def test_a_dimension_reads_as_the_generator_reads_it() -> None:
    assert seeds.dim(1) == b"\x00" and seeds.dim(48) == b"\x2f"
    assert seeds.dim(256) == b"\xef\x00\x01"  # beyond one byte's range: exact, little-endian


# --- the campaigns ------------------------------------------------------------------------------

#: CI's fuzz smoke, per host: seconds, not a campaign (docs/testing.md).
SMOKE_SECONDS = 15


# The campaigns find two reads that patch 0015's rules still let through (ROPE frequency factors shorter
# than half a row; SCALE of a permuted source with a dimension of 1: tests/apir/graph_fuzz/findings/), so
# they run where APIRCTL_GRAPH_FUZZ=1 until both rules are in the series; the corpus tests above run
# everywhere.
CAMPAIGNS = pytest.mark.skipif(os.environ.get("APIRCTL_GRAPH_FUZZ") != "1",
                               reason="set APIRCTL_GRAPH_FUZZ=1: two findings of 0015 are open (docs/reliability.md)")


@pytest.fixture(scope="module")
def fuzzers(sanitized_ggml) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Both fuzzers: their harnesses linked against the suite's one sanitized tree (tests/apir/conftest.py),
    the dispatch fuzzer's; cached by the harnesses' digest. The tree is built once: these cost seconds."""
    from tests.support import native_builds

    out = sanitized_ggml.harness_dir(graph_build.harness_digest())
    exes = {name: out / name for name in graph_build.HARNESSES}
    if not all(exe.exists() for exe in exes.values()):
        with native_builds.timed("the graph fuzzers' harnesses (against the sanitized tree)"):
            exes = graph_build.build_fuzzers(sanitized_ggml.src, sanitized_ggml.lib_dir, out)
    return exes


# ggml-rpc's server checks a graph's tensors against their buffers, not what the kernels assume of a
# node (issue 30, item 2: one rule per op for both hosts); until it does, its campaign finds kernel
# aborts and overflows at once. Strict: the day it checks them, these fail and the marks come off.
RPC_UNCHECKED = pytest.mark.xfail(strict=True, reason="ggml-rpc's server does not check the kernels' preconditions yet")
HOSTS = ["apir_graph_fuzz", pytest.param("rpc_graph_fuzz", marks=RPC_UNCHECKED)]


@CAMPAIGNS
@pytest.mark.integration
@pytest.mark.parametrize("host", HOSTS)
def test_the_host_computes_every_seed(fuzzers: dict[str, Path], host: str, tmp_path: Path) -> None:
    """The corpus replayed once: each seed is a graph the host accepts and computes, with no finding
    (the generator still builds what the host's checks take, so the campaign reaches the kernels)."""
    done = campaign.run(fuzzers[host], 0, tmp_path / "artifacts")
    assert done.result.clean, f"{done.result.findings}\n{done.result.reports}\n{done.result.log_tail}"
    n = len(list(campaign.CORPUS.iterdir()))
    assert done.graphs_built >= n and done.graphs_computed >= n - 2, done.result.log_tail


@CAMPAIGNS
@pytest.mark.integration
@pytest.mark.parametrize("host", HOSTS)
def test_a_short_campaign_finds_nothing(fuzzers: dict[str, Path], host: str, tmp_path: Path) -> None:
    """A smoke run: the corpus, then mutations for SMOKE_SECONDS: no sanitizer report, no abort, no
    signal, no input slower than 20 s. The long campaign is benchmarks/fuzz_graphs.py."""
    done = campaign.run(fuzzers[host], 10_000_000, tmp_path / "artifacts", seed=30, max_total_time=SMOKE_SECONDS)
    findings = [campaign.classify(fuzzers[host], Path(p)) for p in done.result.findings]
    assert done.result.clean, f"{findings}\n{done.result.reports}\n{done.result.log_tail}"
    n = len(list(campaign.CORPUS.iterdir()))
    assert done.graphs_computed >= n - 2 and done.result.edges > 0
