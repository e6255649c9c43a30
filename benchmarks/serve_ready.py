"""Time from `apirctl serve` to a ready server, against `podman run` of the same image and model.

Both sides end when llama-server's /health answers 200 on the host: `apirctl serve` returns once it
has seen that itself; the baseline is `podman run -d` followed by a /health poll every 20 ms (the
fastest a script would reasonably poll). Same image, model, flags, port and podman settings
(apirctl's CONTAINERS_CONF where the host needs one). Runs alternate which side goes first, and the
containers are removed between runs, outside the timing. Target: ratio of medians <= 1.05.

    python benchmarks/serve_ready.py [--runs 7] [--model PATH] [--json FILE]
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


def time_apirctl(model: Path, env: dict[str, str]) -> float:
    name, port = f"bench-serve-{uuid.uuid4().hex[:6]}", free_port()
    cmd = [*apirctl_command(), "serve", str(model), "--transport", "none", "--port", str(port), "--name", name]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    subprocess.run([*apirctl_command(), "stop", name], capture_output=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"apirctl serve failed:\n{done.stderr}")
    return elapsed


def time_podman_run(model: Path, image: str, env: dict[str, str]) -> float:
    from apirctl import engine

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
    args = parser.parse_args()

    from apirctl import engine, image, llamacpp, models

    model = (args.model or models.resolve("smollm2", pull=True, quiet=True).path).resolve()
    build = llamacpp.container_build()
    if build is None:
        raise SystemExit("no container build: run `apirctl setup` first")
    tag = image.ensure(build)
    env = engine.podman_env()
    engine.discover()  # the service is up before either side is timed
    if shutil.which("podman") is None:
        raise SystemExit("podman is not installed")

    time_apirctl(model, env)  # warm-up: page cache, image layers, the service
    time_podman_run(model, tag, env)
    ours: list[float] = []
    theirs: list[float] = []
    for run in range(args.runs):
        if run % 2 == 0:
            ours.append(time_apirctl(model, env))
            theirs.append(time_podman_run(model, tag, env))
        else:
            theirs.append(time_podman_run(model, tag, env))
            ours.append(time_apirctl(model, env))
        print(f"run {run + 1}: apirctl serve {ours[-1]:.3f} s, podman run + poll {theirs[-1]:.3f} s", flush=True)
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
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
