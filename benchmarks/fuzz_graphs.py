"""The graph fuzzers' campaigns (tests/apir/graph_fuzz/), with a results file written by the harness.

Two modes, each over both hosts (APIR backend library, ggml-rpc server) built from a patched tree:

- `--campaign`: libFuzzer runs from the committed corpus until `--graphs` graphs were computed by the
  host or `--max-total-time` seconds passed, a new run (another seed) after each; a run stops at its
  first finding, which is classified and counted. This is issue 30's "1e6 computed graphs, 0 findings".
- `--hunt SECONDS`: fork mode that goes on past findings; every finding is classified and mapped to
  issue 30's list, with the seconds it took to find the first of each (the rediscovery figures).

    python benchmarks/fuzz_graphs.py --src TREE --build-dir DIR --patches llama_patches \\
        --campaign --graphs 1000000 --max-total-time 36000 --label after-0022
    python benchmarks/fuzz_graphs.py --src TREE --build-dir DIR --hunt 900 --label series-0021

The results file (benchmarks/results/fuzz_graphs-DATE-LABEL.json) names the patch series' digest (as
`apirctl` computes it, over the files in --patches' series), the harness sources' digest, the corpus,
the counts, the CPU seconds the fuzzers used, and every finding with its reproducer's name.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import resource
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.apir.graph_fuzz import build as graph_build  # noqa: E402
from tests.apir.graph_fuzz import campaign  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


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


def run_campaign(fuzzer: Path, graphs: int, max_total_time: int, artifacts: Path, runs_per_round: int,
                 timeout: int) -> dict:
    start, cpu0 = time.monotonic(), cpu_seconds()
    totals = {"inputs": 0, "graphs_built": 0, "graphs_computed": 0, "rounds": 0, "edges": 0}
    findings: list[dict] = []
    seed = 1
    while totals["graphs_computed"] < graphs:
        left = max_total_time - (time.monotonic() - start)
        if left < 5:
            break
        done = campaign.run(fuzzer, runs_per_round, artifacts, seed=seed, max_total_time=int(left), timeout=timeout)
        totals["rounds"] += 1
        totals["inputs"] += done.result.inputs
        totals["graphs_built"] += done.graphs_built
        totals["graphs_computed"] += done.graphs_computed
        totals["edges"] = max(totals["edges"], done.result.edges)
        for path in done.result.findings:
            f = campaign.classify(fuzzer, Path(path))
            findings.append({**asdict(f), "path": Path(f.path).name, "issue": campaign.issue_finding(f)})
        if not done.result.clean and not done.result.findings:
            findings.append({"path": "", "kind": f"exit {done.result.returncode}", "reports": done.result.reports,
                             "log_tail": done.result.log_tail[-1500:]})
        seed += 1
    return {**totals, "seconds": round(time.monotonic() - start, 1), "cpu_seconds": round(cpu_seconds() - cpu0, 1),
            "findings": findings, "clean": not findings,
            # a C assert() stops only a build with them on (the libraries here; not the hosts' release builds)
            "findings_other_than_debug_asserts": len([f for f in findings if f.get("kind") != "assert"])}


def run_hunt(fuzzer: Path, seconds: int, artifacts: Path) -> dict:
    start_wall, cpu0 = time.time(), cpu_seconds()
    done = campaign.hunt(fuzzer, seconds, artifacts)
    found = campaign.classify_all(fuzzer, [Path(p) for p in done.result.findings])
    return {"inputs": done.result.inputs, "graphs_built_lower_bound": done.graphs_built,
            "graphs_computed_lower_bound": done.graphs_computed, "seconds": done.result.seconds,
            "cpu_seconds": round(cpu_seconds() - cpu0, 1), "findings": len(found),
            **campaign.summary(found, start_wall)}


def reclassify(results: Path, build_dir: Path, artifacts: Path) -> None:
    """Read a hunt's findings again (a newer classifier), keeping its counts; the seconds to each are
    from the hunt's start (the file's date) to the finding's file time. A campaign's are counted again."""
    out = json.loads(results.read_text())
    start = datetime.datetime.fromisoformat(out["date"]).timestamp()
    for host, figures in out["hosts"].items():
        if out["mode"] == "campaign":  # its findings are classified already: count them again
            figures["findings"] = [f for f in figures["findings"] if not f["path"].startswith("slow-unit-")]
            figures["findings_other_than_debug_asserts"] = len(
                [f for f in figures["findings"] if f.get("kind") != "assert"])
            continue
        found = [p for p in (artifacts / f"{out['label']}-{host}").iterdir() if not p.name.startswith("slow-unit-")]
        classified = campaign.classify_all(build_dir / host, found)
        figures.update({"findings": len(classified), **campaign.summary(classified, start)})
    results.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="the llama.cpp tree the libraries are built from")
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--patches", type=Path, default=Path(__file__).resolve().parent.parent / "llama_patches",
                        help="the folder with the series applied to --src (for its digest)")
    parser.add_argument("--hosts", default="apir_graph_fuzz,rpc_graph_fuzz")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--campaign", action="store_true")
    mode.add_argument("--hunt", type=int, help="seconds of fork mode per host")
    mode.add_argument("--reclassify", type=Path, help="a hunt's results file: classify its findings again")
    parser.add_argument("--graphs", type=int, default=1_000_000, help="computed graphs to reach per host")
    parser.add_argument("--max-total-time", type=int, default=3600, help="seconds per host")
    parser.add_argument("--runs-per-round", type=int, default=10_000_000)
    parser.add_argument("--timeout", type=int, default=60, help="seconds an input may take (2 loaded cores: generous)")
    parser.add_argument("--label", default="run")
    parser.add_argument("--artifacts", type=Path, default=Path("graph-fuzz-artifacts"))
    parser.add_argument("--no-build", action="store_true", help="use the fuzzers already in --build-dir")
    parser.add_argument("--local-change", default="", help="a change to --src beyond the series, recorded as is")
    args = parser.parse_args()

    build_dir = args.build_dir.resolve()
    if args.reclassify:
        reclassify(args.reclassify, build_dir, args.artifacts.resolve())
        return
    if args.no_build:
        exes = {name: build_dir / name for name in graph_build.HARNESSES}
    else:
        exes = graph_build.build(args.src.resolve(), build_dir)
    digest, names = series_digest(args.patches)
    harness = hashlib.sha256(b"".join((graph_build.HERE / s).read_bytes() for s in graph_build.SOURCES))
    corpus = sorted(campaign.CORPUS.iterdir())
    out: dict = {
        "benchmark": "fuzz_graphs", "mode": "hunt" if args.hunt else "campaign", "label": args.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "patch_digest": digest, "patches": names, "local_change": args.local_change or None,
        "harness_digest": harness.hexdigest()[:12],
        "corpus": {"files": len(corpus), "bytes": sum(p.stat().st_size for p in corpus),
                   "digest": hashlib.sha256(b"".join(p.read_bytes() for p in corpus)).hexdigest()[:12],
                   "folder": "tests/apir/graph_fuzz/corpus"},
        "sanitizers": "address,undefined (libraries and harness), libFuzzer", "hosts": {},
    }
    for host in args.hosts.split(","):
        artifacts = args.artifacts.resolve() / f"{args.label}-{host}"
        if args.hunt:
            shutil.rmtree(artifacts, ignore_errors=True)
            out["hosts"][host] = run_hunt(exes[host], args.hunt, artifacts)
        else:
            out["hosts"][host] = run_campaign(exes[host], args.graphs, args.max_total_time, artifacts,
                                              args.runs_per_round, args.timeout)
        print(host, json.dumps({k: v for k, v in out["hosts"][host].items() if k != "distinct"}, default=str)[:2000])
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fuzz_graphs-{datetime.date.today().isoformat()}-{args.label}.json"
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(path)


if __name__ == "__main__":
    main()
