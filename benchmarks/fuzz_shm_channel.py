#!/usr/bin/env python3
"""Fuzz the shared-memory channel's position checks with generated inputs, under ASan and UBSan.

The channel (`transport-shm.cpp` of llama_patches/) reads positions that an untrusted container
writes. `llama_patches/tests/shm_channel_test.cpp fuzz N` writes N random read/write positions and
payload bytes and checks that every server call succeeds exactly when the position is consistent;
the sanitizers check that nothing is read or written outside the mapping on the way. CI runs a few
thousand cases (tests/remoting/test_shm_native.py); this runs a million and records the counts.

    benchmarks/fuzz_shm_channel.py --cases 1000000 --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    from apirctl.build import llamacpp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="folder for the JSON record")
    args = ap.parse_args(argv)
    src = llamacpp.source_dir()
    test = REPO / "llama_patches" / "tests" / "shm_channel_test.cpp"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "shm_channel_test"
        subprocess.run(["c++", "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined",
                        "-fno-sanitize-recover=undefined", f"-I{src / 'ggml/include'}", f"-I{src / 'ggml/src'}",
                        f"-I{src / 'ggml/src/ggml-rpc'}", str(test), str(src / "ggml/src/ggml-rpc/transport-shm.cpp"),
                        "-o", str(exe), "-lpthread"], check=True)
        t0 = time.monotonic()
        run = subprocess.run([str(exe), "fuzz", str(args.cases), str(args.seed)], capture_output=True, text=True)
        wall = time.monotonic() - t0
    print(run.stdout.strip(), run.stderr.strip()[-2000:], sep="\n")
    m = re.search(r"fuzz: (\d+) generated cases, (\d+) refused as corrupt, (\d+) unexpected", run.stdout)
    record = {"date": date.today().isoformat(), "cases": args.cases, "seed": args.seed, "exit": run.returncode,
              "refused_as_corrupt": int(m.group(2)) if m else None, "unexpected": int(m.group(3)) if m else None,
              "sanitizers": "address,undefined", "wall_s": round(wall, 1), "patches": llamacpp.patches_digest()}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"fuzz_shm_channel-{record['date']}.json").write_text(json.dumps(record, indent=1) + "\n")
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
