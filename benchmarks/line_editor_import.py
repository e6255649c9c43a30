"""What prompt_toolkit would add to `apirctl chat`'s start, against the readline module it uses.

Each probe is a fresh interpreter (the one given, which must have prompt_toolkit installed) that
times, in process, the import of the line editor and, for prompt_toolkit, the making of a
`PromptSession` (on a pipe input, so no terminal is needed). Medians and minimums over the runs;
the probe order rotates from run to run.

    python benchmarks/line_editor_import.py --python /path/to/venv/bin/python --runs 20 [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROBES = {
    "readline": "import time\nt = time.perf_counter()\nimport readline\nprint(time.perf_counter() - t)",
    "prompt_toolkit import": (
        "import time\nt = time.perf_counter()\nfrom prompt_toolkit import PromptSession\n"
        "print(time.perf_counter() - t)"
    ),
    "PromptSession()": (
        "import time\nfrom prompt_toolkit import PromptSession\nfrom prompt_toolkit.input import create_pipe_input\n"
        "from prompt_toolkit.output import DummyOutput\nwith create_pipe_input() as pipe:\n"
        "    t = time.perf_counter()\n    PromptSession(input=pipe, output=DummyOutput())\n"
        "    print(time.perf_counter() - t)"
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="an interpreter with prompt_toolkit installed")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    names = list(PROBES)
    times: dict[str, list[float]] = {name: [] for name in names}
    for run in range(args.runs):
        for name in names[run % len(names):] + names[:run % len(names)]:
            done = subprocess.run([args.python, "-c", PROBES[name]], capture_output=True, text=True, check=True)
            times[name].append(float(done.stdout) * 1000)
    version = subprocess.run([args.python, "-c", "import prompt_toolkit; print(prompt_toolkit.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    result = {"prompt_toolkit": version, "runs": args.runs,
              "ms": {name: {"median": round(statistics.median(v), 1), "min": round(min(v), 1)}
                     for name, v in times.items()}}
    for name, value in result["ms"].items():  # type: ignore[union-attr]
        print(f"{name:24s} median {value['median']:7.1f} ms   min {value['min']:7.1f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
