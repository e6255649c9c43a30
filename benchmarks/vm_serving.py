"""The seeds' Lima-style comparison on this machine: one model served natively, in a micro-VM on the VM's
own CPU (`vm-cpu`), and in a micro-VM computing through remoting on the host (`vm-remoting`).

It runs `apirctl bench MODEL --serving --modes ...` (apirctl/bench/serving.py: the rows alternated,
each remoting or VM row against the native rows around it), or with `--llama-bench` llama-bench's
pp and tg in each mode (`apirctl bench MODEL --modes ...`, apirctl/bench/modes.py; each mode's row
against the native row of the same run), and writes its JSON, with what the figures
depend on (the CPU, the accelerator a VM got and why, the patch digest, the build's CPU target), to a
file under benchmarks/results/.

    python benchmarks/vm_serving.py MODEL [--modes native,vm-cpu,vm-remoting] [--rounds 1]
        [--concurrency 1] [--requests 4] [--max-tokens 32] [--out FILE]
    python benchmarks/vm_serving.py MODEL --llama-bench [--pp 64] [--tg 16] [--reps 2] [--out FILE]
        [--links region,stream --passes 2]

`--links` runs the whole comparison once per link, alternated pass by pass: `region`, the remoting
VM's rings in the memory it shares with its backend (llama_patches/ 0024, the default), and `stream`,
every byte through QEMU's user network and the relay (the backend started with `GGML_RPC_NO_SHM=1`,
so that it offers no region).

On a host whose KVM cannot boot ordinary guests the VMs run on QEMU's emulation; where the host's CPU
has AVX-512, set `native_cpu` false first (docs/vm.md) so that the VM's image can run there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--modes", default="native,vm-cpu,vm-remoting")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--llama-bench", action="store_true", help="llama-bench's pp and tg, not serving")
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--tg", type=int, default=16)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--links", default="region", help="region, stream or both (comma-separated)")
    parser.add_argument("--passes", type=int, default=1)
    opts = parser.parse_args()
    links = [link.strip() for link in opts.links.split(",") if link.strip()]
    if not links or set(links) - {"region", "stream"}:
        parser.error("--links: region, stream or both")

    from apirctl import config
    from apirctl.build import llamacpp
    from apirctl.vm import accel

    if opts.llama_bench:
        command = [sys.executable, "-m", "apirctl", "bench", opts.model, "--modes", opts.modes, "--pp", str(opts.pp),
                   "--tg", str(opts.tg), "--reps", str(opts.reps), "--json", "--no-save"]
    else:
        command = [sys.executable, "-m", "apirctl", "bench", opts.model, "--serving", "--modes", opts.modes,
                   "--rounds", str(opts.rounds), "--concurrency", opts.concurrency, "--requests", str(opts.requests),
                   "--max-tokens", str(opts.max_tokens), "--json", "--no-save"]
    runs = []
    for number in range(opts.passes):
        for link in links:
            env = {**os.environ, "GGML_RPC_NO_SHM": "1"} if link == "stream" else None
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"bench failed ({link}, pass {number + 1}): {done.stderr.strip()}")
            bench = json.loads(done.stdout)
            if "model_file" in bench:  # the file's name: where this machine keeps it is not a result
                bench["model_file"] = Path(bench["model_file"]).name
            runs.append({"pass": number + 1, "link": link, "bench": bench})
    chosen = accel.choose(config.settings().vm_accel)
    stamp = datetime.now(tz=timezone.utc)
    kind = "vm_bench" if opts.llama_bench else "vm_serving"
    result = {"benchmark": kind, "date": stamp.isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "cpu": cpu_model(), "model": Path(opts.model).name, "modes": opts.modes,
              "vm_accel": {"name": chosen.name, "why": chosen.why}, "kvm_problem": accel.kvm_problem(),
              "native_cpu": config.settings().native_cpu, "patch_digest": llamacpp.patches_digest(),
              "command": command[1:], "links": links, "passes": opts.passes, "runs": runs}
    if len(runs) == 1:  # the layout of the earlier files
        result["bench"] = runs[0]["bench"]
    out = opts.out or Path(__file__).parent / "results" / f"{kind}-cpu-{stamp:%Y-%m-%d}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
