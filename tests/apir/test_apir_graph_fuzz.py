"""The graph fuzzers (tests/apir/graph_fuzz/): their seed corpus, and a short campaign of each against
the pinned, patched source built with AddressSanitizer and UndefinedBehaviorSanitizer.

Each campaign computes graphs through a host's real entry point (the APIR backend library's
dispatcher; ggml-rpc's server loop) on the real CPU backend: any sanitizer report, abort, signal or
slow input is a finding, and the test asserts none. On the APIR host, inputs with their delta flag
also update the kept graph by EXT_GRAPH_DELTA (patch 0021) and compute it again, and with their
clear flag clear one of its buffers first and run it by id (BUFFER_CLEAR keeps kept graphs since
patch 0013, so the run's index checks must refuse indices a clear made -1). The long campaign
is benchmarks/fuzz_graphs.py; its figures are in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.apir.graph_fuzz import build as graph_build
from tests.apir.graph_fuzz import campaign, seeds
from tests.support import waiting


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
HOSTS = ["apir_graph_fuzz", "rpc_graph_fuzz"]
#: Reproducers of what the campaigns found past patches 0015 and 0018 (docs/reliability.md); the
#: series' rules refuse each on both hosts.
FINDINGS = sorted(p.name for p in (campaign.HERE / "findings").iterdir())
#: Reproducers of kernel faults on data, in graphs the checks rightly take (patch 0023: a NaN quantized).
COMPUTED = sorted(p.name for p in (campaign.HERE / "computed").iterdir())


@pytest.fixture(scope="module")
def fuzzers(sanitized_ggml) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Both fuzzers: their harnesses linked against the suite's one sanitized tree (tests/apir/conftest.py),
    the dispatch fuzzer's; cached by the harnesses' digest. The tree is built once: these cost seconds."""
    from tests.support import native_builds

    digest = graph_build.harness_digest()
    out = sanitized_ggml.harness_dir(digest)
    exes = {name: out / name for name in graph_build.HARNESSES}
    # one maker at a time: pytest-xdist may hand this module's tests to several workers at once
    with native_builds.locked(f"graph-fuzz-harnesses-{digest}"):
        if not all(exe.exists() for exe in exes.values()):
            with native_builds.timed("the graph fuzzers' harnesses (against the sanitized tree)"):
                exes = graph_build.build_fuzzers(sanitized_ggml.src, sanitized_ggml.lib_dir, out)
    return exes


@pytest.mark.integration
@pytest.mark.parametrize("host", HOSTS)
def test_the_host_computes_every_seed(fuzzers: dict[str, Path], host: str, tmp_path: Path) -> None:
    """The corpus replayed once: each seed is a graph the host accepts and computes, with no finding
    (the generator still builds what the host's checks take, so the campaign reaches the kernels)."""
    done = campaign.run(fuzzers[host], 0, tmp_path / "artifacts")
    assert done.result.clean, f"{done.result.findings}\n{done.result.reports}\n{done.result.log_tail}"
    n = len(list(campaign.CORPUS.iterdir()))
    assert done.graphs_built >= n and done.graphs_computed >= n - 2, done.result.log_tail
    if host == "apir_graph_fuzz":
        # the delta seeds' updated graphs pass the delta's checks and compute; the hostile change is refused
        assert done.deltas_computed >= DELTA_SEEDS_COMPUTED and done.deltas_refused >= 1, done.result.log_tail
        # a kept graph run by id after a clear: benign contents computed, indices cleared to -1 refused
        assert done.clears_computed >= CLEAR_SEEDS_COMPUTED >= 1, done.result.log_tail
        assert done.clears_refused >= CLEAR_SEEDS_REFUSED >= 1, done.result.log_tail
    else:
        assert done.deltas_computed == done.deltas_refused == 0  # the RPC transport has no deltas
        assert done.clears_computed == done.clears_refused == 0


#: The updates by EXT_GRAPH_DELTA that the corpus's delta seeds (seeds.py) compute: 3 of mul_mat-batch, 1 of
#: kv-store-batch and of rope-hostile, 2 of each of the other eleven.
DELTA_SEEDS_COMPUTED = 27
#: The clear seeds' runs by id after a clear (seeds.py): computed, 1 each of get_rows-ids and
#: mul_mat_id-ids and 2 of set_rows-f32; refused (a clear to 0xff of the indices), get_rows-ids,
#: mul_mat_id-ids and set_rows-i64-kv.
CLEAR_SEEDS_COMPUTED = 4
CLEAR_SEEDS_REFUSED = 3


# An input slower than this is a finding. A quantizing copy into IQ4_NL of a large tensor took 23 s
# under the sanitizers, nice'd, beside the suite's other workers on 2 cores: slow there, not hung.
SLOW_INPUT_SECONDS = 120


@pytest.mark.integration
@pytest.mark.parametrize("host", HOSTS)
def test_a_short_campaign_finds_nothing(fuzzers: dict[str, Path], host: str, tmp_path: Path) -> None:
    """A smoke run: the corpus, then mutations for SMOKE_SECONDS: no sanitizer report, no abort, no
    signal, no input slower than SLOW_INPUT_SECONDS. The long campaign is benchmarks/fuzz_graphs.py."""
    done = campaign.run(fuzzers[host], 10_000_000, tmp_path / "artifacts", seed=30, max_total_time=SMOKE_SECONDS,
                        timeout=SLOW_INPUT_SECONDS)
    findings = [campaign.classify(fuzzers[host], Path(p)) for p in done.result.findings]
    # every finding counts: the RPC harness's stops that replayed cleanly alone were libFuzzer's timer
    # signal interrupting a socket call (test_the_rpc_harness_runs_on_through_signals)
    assert not findings and done.result.clean, f"{findings}\n{done.result.reports}\n{done.result.log_tail}"
    n = len(list(campaign.CORPUS.iterdir()))
    assert done.graphs_computed >= n - 2 and done.result.edges > 0
    if host == "apir_graph_fuzz":  # the delta path reached the kernels, not only its refusals
        assert done.deltas_computed >= DELTA_SEEDS_COMPUTED, done.result.log_tail


@pytest.mark.integration
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("finding", FINDINGS)
def test_a_finding_is_refused(fuzzers: dict[str, Path], host: str, finding: str) -> None:
    """Each committed reproducer, once: the host's checks refuse its graph (none computed), and no
    sanitizer report or abort follows."""
    done = campaign.replay(fuzzers[host], campaign.HERE / "findings" / finding)
    assert done.returncode == 0, done.log
    assert done.counts == campaign.Counts(built=1, computed=0, refused=1), done.log


@pytest.mark.integration
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("finding", COMPUTED)
def test_a_kernel_finding_computes_cleanly(fuzzers: dict[str, Path], host: str, finding: str) -> None:
    """Each committed reproducer of a kernel's fault on the data of a graph the checks take: the host
    computes it, and no sanitizer report follows (`cpy-of-nans-into-q5_0`: a buffer cleared to 0xff, NaNs,
    copied into q5_0, whose quantizer converted NaN to an integer before patch 0023)."""
    done = campaign.replay(fuzzers[host], campaign.HERE / "computed" / finding)
    assert done.returncode == 0, done.log
    assert done.counts.computed >= 1 and done.counts.refused == 0, done.log


@pytest.mark.integration
def test_a_fuzzer_that_is_killed_has_counted_its_graphs(fuzzers: dict[str, Path], tmp_path: Path) -> None:
    """The counts the campaigns sum are in a file each fuzzer process maps, so a process that dies
    (a finding's crash handler, or SIGKILL here) has left them: a campaign's count misses no round."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for seed_file in campaign.CORPUS.glob("mul_mat-*"):  # matrix products: many graphs, quickly
        shutil.copy(seed_file, corpus / seed_file.name)
    counts = tmp_path / "counts"
    counts.mkdir()
    proc = subprocess.Popen([str(fuzzers["apir_graph_fuzz"]), str(corpus), "-runs=100000000", "-seed=7",
                             f"-artifact_prefix={tmp_path}/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=campaign.environment(counts))
    try:
        waiting.wait_for("20 graphs computed by the fuzzer", lambda: campaign.read_counts(counts).computed >= 20,
                         timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    counted = campaign.read_counts(counts)
    assert counted.computed >= 20 and counted.built >= counted.computed + counted.refused


@pytest.mark.integration
def test_the_apir_harness_moves_to_a_new_client_before_its_buffer_ids_run_out(fuzzers: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """The library gives a client buffer ids up to a bound and never reuses one, so one long fuzzer
    process ran out of them (the harness aborted after 656,263 inputs, "a buffer of 16 bytes was
    refused"). The harness moves to a new client first, as a guest reconnects; here after 30 ids, so
    that a few hundred inputs cross several clients and every one of them still computes."""
    patches = campaign.HERE.parents[2] / "llama_patches"
    objects = next(patches.glob("0009-ggml-virtgpu-the-backend-names-guest-objects*.patch")).read_text()
    bound = re.search(r"#define APIR_MAX_BUFFER_ID +\(\(uint64_t\) 1 << (\d+)\)", objects)
    harness = (campaign.HERE / "apir_graph_fuzz.cpp").read_text()
    assert bound is not None and f"IDS_PER_CLIENT      = ((uint64_t) 1 << {bound.group(1)}) - 1;" in harness
    corpus, counts = tmp_path / "corpus", tmp_path / "counts"
    corpus.mkdir()
    counts.mkdir()
    for seed_file in campaign.CORPUS.iterdir():
        shutil.copy(seed_file, corpus / seed_file.name)
    done = subprocess.run([str(fuzzers["apir_graph_fuzz"]), str(corpus), "-runs=300", "-seed=11", "-detect_leaks=0",
                           "-max_len=512", f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True,
                          errors="replace", env={**campaign.environment(counts), "GFUZZ_IDS_PER_CLIENT": "30"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    clients = [int(n) for n in re.findall(r"apir-graph-fuzz: client (\d+),", done.stderr)]
    assert len(clients) >= 3 and clients == list(range(2, 2 + len(clients))), done.stderr[-4000:]
    counted = campaign.read_counts(counts)
    assert counted.computed >= 100 and counted.deltas_computed >= 1, counted


@pytest.mark.integration
def test_the_rpc_harness_runs_on_through_signals(fuzzers: dict[str, Path], tmp_path: Path) -> None:
    """libFuzzer's timer (SIGALRM every -timeout/2 s) interrupted a socket call of the RPC harness or of
    its server's thread now and then; on a fresh connection that stopped the campaign ("a fresh
    connection failed"), on an input that replayed cleanly alone: the 15 stops of the long campaigns
    (docs/reliability.md). Here the signal comes every few milliseconds: the harness retries an
    interrupted call, the server's thread never takes the signal, and every input runs."""
    corpus, counts, log = tmp_path / "corpus", tmp_path / "counts", tmp_path / "fuzz.log"
    corpus.mkdir()
    counts.mkdir()
    for seed_file in campaign.CORPUS.iterdir():
        shutil.copy(seed_file, corpus / seed_file.name)
    with log.open("wb") as out:
        proc = subprocess.Popen([str(fuzzers["rpc_graph_fuzz"]), str(corpus), "-runs=400", "-seed=5",
                                 "-timeout=120", "-detect_leaks=0", "-close_fd_mask=1", "-max_len=512",
                                 f"-artifact_prefix={tmp_path}/"],
                                stdout=subprocess.DEVNULL, stderr=out, env=campaign.environment(counts))
    signals = 0
    try:
        # libFuzzer's handlers are in place once it reads the corpus (before, SIGALRM would end it)
        waiting.wait_for("the fuzzer reading its corpus", lambda: "files found in" in log.read_text(errors="replace")
                         or proc.poll() is not None, timeout=120)
        while proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGALRM)
                signals += 1
            time.sleep(0.002)  # the pace of the signals, not a wait for anything
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and "fresh connection failed" not in text, text[-3000:]
    counted = campaign.read_counts(counts)
    assert signals >= 50 and counted.computed >= len(list(campaign.CORPUS.iterdir())) - 2, (signals, counted)


@pytest.mark.integration
def test_a_campaign_of_packed_fuzzers_names_the_harness_they_were_built_from(fuzzers: dict[str, Path],
                                                                             sanitized_ggml, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A pack travels to the GPU machine and may be older than the checkout that runs it (the generator's
    own fix came after one): the results file names the pack's harness digest, not the checkout's, and
    says that they differ, so that a docs figure can tell which generator computed its graphs."""
    script = campaign.HERE.parents[2] / "benchmarks" / "fuzz_graphs.py"
    pack = tmp_path / "pack"
    done = subprocess.run([sys.executable, str(script), "--build-dir", str(sanitized_ggml.root), "--pack", str(pack),
                           "--hosts", "apir_graph_fuzz"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["harness_digest"] == graph_build.harness_digest()
    older = "0123456789ab"  # as if packed from an earlier harness
    (pack / "manifest.json").write_text(json.dumps({**manifest, "harness_digest": older}))
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, str(script), "--prebuilt", str(pack), "--work", str(tmp_path / "work"),
                           "--hosts", "apir_graph_fuzz", "--campaign", "--workers", "1", "--graphs", "200",
                           "--max-total-time", "60", "--seed", "3", "--label", "packed", "--results-dir",
                           str(results)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the packed harnesses are not this checkout's" in done.stderr
    written = json.loads(next(results.glob("fuzz_graphs-*-packed.json")).read_text())
    assert written["harness_digest"] == older and written["packed"]["harness_digest"] == older
    assert written["hosts"]["apir_graph_fuzz"]["graphs_computed"] >= 1
