"""Time from `apirctl serve` to a ready server, against `podman run` of the same image and model.

Both sides end when llama-server's /health answers 200 on the host: `apirctl serve` returns once it
has seen that itself; the baseline is `podman run -d` followed by a /health poll every 20 ms (the
fastest a script would reasonably poll). Same image, model, flags, port and podman settings
(apirctl's CONTAINERS_CONF where the host needs one). Runs alternate which side goes first, and the
containers are removed between runs, outside the timing. Target: ratio of medians <= 1.05.

    python benchmarks/serve_ready.py [--runs 7] [--model PATH] [--json FILE] [--baseline-tree DIR]

`apirctl serve` runs as users run it: through the resident apirctl process (apirctl.resident), which
the warm-up run starts. `--no-resident` also times it with APIRCTL_RESIDENT=0 (every command in a fresh
interpreter: what the first command after a boot or an upgrade costs).

`--baseline-tree DIR` also times `python -m apirctl serve` run from another checkout (a git worktree of
an older commit: `git worktree add --detach DIR COMMIT`), interleaved with the others, for a
before/after under the same machine load. Run the benchmark itself from a checkout nobody edits
(PYTHONPATH=that checkout): an edit of apirctl's files retires the resident process mid-run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def apirctl_command() -> list[str]:
    script = Path(sys.executable).parent / "apirctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "apirctl"]


def time_apirctl(model: Path, env: dict[str, str], tree: Path | None = None) -> float:
    """`apirctl serve` to its exit; from `tree` (another checkout, run with -m from there) if given."""
    name, port = f"bench-serve-{uuid.uuid4().hex[:6]}", free_port()
    program = [sys.executable, "-m", "apirctl"] if tree else apirctl_command()
    cmd = [*program, "serve", str(model), "--transport", "none", "--port", str(port), "--name", name]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    elapsed = time.perf_counter() - start
    subprocess.run([*program, "stop", name], capture_output=True, env=env, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"apirctl serve failed:\n{done.stderr}")
    return elapsed


def time_podman_run(model: Path, image: str, env: dict[str, str]) -> float:
    from apirctl.podman import engine

    name, port = f"bench-podman-{uuid.uuid4().hex[:6]}", free_port()
    cmd = engine.podman_cli(
        "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000",
        "-v", f"{model}:/models/{model.name}:ro", image,
        "--model", f"/models/{model.name}", "--host", "0.0.0.0", "--port", "8000", "--ctx-size", "4096",
        "--alias", model.stem,
    )
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    deadline = start + 300
    with httpx.Client(timeout=2.0) as http:
        while time.perf_counter() < deadline:
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        else:
            raise SystemExit("podman run: the server was not ready in 300 s")
    elapsed = time.perf_counter() - start
    subprocess.run(engine.podman_cli("rm", "-f", "-t", "0", name), capture_output=True, env=env)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the demo model from the store)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--baseline-tree", type=Path, help="also time apirctl from this checkout (before/after)")
    parser.add_argument("--no-resident", action="store_true",
                        help="also time apirctl serve without the resident process (APIRCTL_RESIDENT=0)")
    args = parser.parse_args()

    from apirctl import models
    from apirctl.build import image, llamacpp
    from apirctl.podman import engine

    model = (args.model or models.resolve("smollm2", pull=True).path).resolve()
    build = llamacpp.container_build()
    if build is None:
        raise SystemExit("no container build: run `apirctl setup` first")
    tag = image.ensure(build)
    env = engine.podman_env()
    # As installed: pip writes the bytecode at install time. A shell with PYTHONDONTWRITEBYTECODE (or a
    # fresh checkout without __pycache__) would time the compiler on every start instead.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    import compileall

    import apirctl

    compileall.compile_dir(Path(apirctl.__file__).parent, quiet=1)
    if args.baseline_tree:
        compileall.compile_dir(args.baseline_tree / "apirctl", quiet=1)
    engine.discover()  # the service is up before either side is timed
    if shutil.which("podman") is None:
        raise SystemExit("podman is not installed")

    tree = args.baseline_tree.resolve() if args.baseline_tree else None
    sides = {"ours": lambda: time_apirctl(model, env), "podman": lambda: time_podman_run(model, tag, env)}
    if tree:
        sides["baseline"] = lambda: time_apirctl(model, {**env, "APIRCTL_RESIDENT": "0"}, tree)
    if args.no_resident:
        sides["cold"] = lambda: time_apirctl(model, {**env, "APIRCTL_RESIDENT": "0"})
    for measure in sides.values():  # warm-up: page cache, image layers, the service
        measure()
    times: dict[str, list[float]] = {key: [] for key in sides}
    order = list(sides)
    for run in range(args.runs):
        for key in order[run % len(order):] + order[:run % len(order)]:  # rotate who goes first
            times[key].append(sides[key]())
        line = f"run {run + 1}: apirctl serve {times['ours'][-1]:.3f} s, podman run + poll {times['podman'][-1]:.3f} s"
        line += f", baseline tree {times['baseline'][-1]:.3f} s" if tree else ""
        print(line + (f", no resident {times['cold'][-1]:.3f} s" if args.no_resident else ""), flush=True)
    ours, theirs = times["ours"], times["podman"]
    result = {
        "runs": args.runs,
        "model": model.name,
        "image": tag,
        "apirctl_serve_median_s": round(statistics.median(ours), 3),
        "podman_run_median_s": round(statistics.median(theirs), 3),
        "ratio": round(statistics.median(ours) / statistics.median(theirs), 3),
        "apirctl_serve_s": [round(x, 3) for x in ours],
        "podman_run_s": [round(x, 3) for x in theirs],
    }
    if tree:
        base = times["baseline"]
        result.update({
            "baseline_median_s": round(statistics.median(base), 3),
            "baseline_ratio": round(statistics.median(base) / statistics.median(theirs), 3),
            "baseline_s": [round(x, 3) for x in base],
        })
    if args.no_resident:
        cold = times["cold"]
        result.update({
            "no_resident_median_s": round(statistics.median(cold), 3),
            "no_resident_ratio": round(statistics.median(cold) / statistics.median(theirs), 3),
            "no_resident_s": [round(x, 3) for x in cold],
        })
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
