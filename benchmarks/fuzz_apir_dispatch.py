#!/usr/bin/env python3
"""The long APIR dispatch fuzz campaign: the sanitized backend library under libFuzzer, 1e6 inputs.

CI runs a smoke of it (tests/apir/test_apir_fuzz.py: the committed corpus and 15 s of mutations);
this builds the same fuzzer (tests/apir/fuzz/build.py, from the pinned, patched source, through
ccache) into a folder of its own and runs the campaign (tests/apir/fuzz/campaign.py), about an hour
on 2 cores; figures go to docs/reliability.md.

    benchmarks/fuzz_apir_dispatch.py --runs 1000000 [--seed 1] [--build-dir DIR] [--out benchmarks/results/]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    from apirctl.build import ccache, llamacpp
    from apirctl.paths import dirs
    from tests.apir.fuzz import build as fuzz_build
    from tests.apir.fuzz import campaign

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build-dir", type=Path, default=None, help="default: apir-fuzz/ in apirctl's cache")
    ap.add_argument("--artifacts", type=Path, default=REPO / "apir-fuzz-artifacts")
    ap.add_argument("--out", type=Path, help="folder for the JSON record")
    args = ap.parse_args(argv)
    build_dir = (args.build_dir or dirs().cache / "apir-fuzz" / llamacpp.patches_digest()).resolve()
    exe = build_dir / "apir_dispatch_fuzz"
    if not exe.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        source = ccache.link_source(llamacpp.source_dir(), build_dir)  # the tests' layout: ccache hits
        os.environ.update(ccache.environment(dirs().cache, build_dir.parent))
        if ccache.enabled():
            os.environ.update({"CMAKE_C_COMPILER_LAUNCHER": "ccache", "CMAKE_CXX_COMPILER_LAUNCHER": "ccache"})
        fuzz_build.build(source, build_dir)
    result = campaign.run(exe, args.runs, args.artifacts.resolve(), seed=args.seed)
    record = {"date": date.today().isoformat(), "runs": args.runs, "seed": args.seed,
              "patches": llamacpp.patches_digest(), **asdict(result), "clean": result.clean}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"fuzz_apir_dispatch-{record['date']}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0 if result.clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
