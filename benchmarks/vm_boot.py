"""Boot time and serve-to-ready time of `serve --isolation vm` against a container, for one model.

Each round serves the model once in a micro-VM and once in a container (alternated), through the real
CLI, and records: the wall time from the command's start until it returned ready; serve's own phases;
for the VM, the boot time (from QEMU's start to the initramfs's `apirctl-init: starting` line in its
console, polled every 5 ms) and the accelerator (kvm, or tcg with the reason). Results go to a JSON
file under benchmarks/results/.

    python benchmarks/vm_boot.py MODEL --image IMAGE [--rounds 1] [--out benchmarks/results/vm_boot-....json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def watch_boot(console: Path, started: float, found: dict[str, float], stop: threading.Event) -> None:
    """The moment init's line appears in the VM's console (seconds after `started`)."""
    while not stop.is_set():
        try:
            if b"apirctl-init: starting" in console.read_bytes():
                found["boot_s"] = time.monotonic() - started
                return
        except OSError:
            pass
        time.sleep(0.005)


def serve_once(model: str, image: str, isolation: str, name: str) -> dict[str, object]:
    from apirctl.vm import machines

    args = [sys.executable, "-m", "apirctl", "serve", model, "--image", image, "--name", name, "--port",
            str(free_port()), "--ctx-size", "512", "--json", "--timeout", "1200"]
    args += ["--transport", "none", *(["--isolation", "vm"] if isolation == "vm" else [])]  # both on their own CPU
    found: dict[str, float] = {}
    stop = threading.Event()
    started = time.monotonic()
    watcher = threading.Thread(target=watch_boot, args=(machines.console_path(name), started, found, stop))
    if isolation == "vm":
        watcher.start()
    done = subprocess.run(args, capture_output=True, text=True)
    ready = time.monotonic() - started
    stop.set()
    if watcher.is_alive():
        watcher.join()
    try:
        if done.returncode != 0:
            raise SystemExit(f"serve --isolation {isolation} failed: {done.stderr.strip()}")
        served = json.loads(done.stdout)
        row: dict[str, object] = {"isolation": isolation, "ready_s": round(ready, 3),
                                  "phases": {p["name"]: round(p["seconds"], 3) for p in served["phases"]},
                                  "notice": served.get("notice")}
        if isolation == "vm":
            row["boot_s"] = round(found["boot_s"], 3) if "boot_s" in found else None
        return row
    finally:
        subprocess.run([sys.executable, "-m", "apirctl", "stop", name], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--image", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    rows = []
    for number in range(opts.rounds):
        for isolation in ("vm", "container") if number % 2 == 0 else ("container", "vm"):
            row = serve_once(opts.model, opts.image, isolation, f"bench-{isolation}-{os.getpid()}-{number}")
            row["round"] = number
            rows.append(row)
            print(json.dumps(row), flush=True)
    from apirctl import config
    from apirctl.build import llamacpp
    from apirctl.vm import accel

    stamp = datetime.now(tz=timezone.utc)
    result = {"benchmark": "vm_boot", "date": stamp.isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "model": Path(opts.model).name, "image": opts.image,
              "kvm_problem": accel.kvm_problem(), "native_cpu": config.settings().native_cpu,
              "patch_digest": llamacpp.patches_digest(), "rows": rows}
    out = opts.out or Path(__file__).parent / "results" / f"vm_boot-cpu-{stamp:%Y-%m-%d}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
