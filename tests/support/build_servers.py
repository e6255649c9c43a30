"""The pinned build's own llama-server, run directly (no container) by the native transport tests,
the greedy tokens they compare between native and remote runs, and upstream's test-backend-ops
compiled against the build."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl import serve
from apirctl.build import llamacpp
from tests.conftest import SHARED_CACHE, shared_env
from tests.support import native_builds
from tests.support.waiting import wait_for


@contextlib.contextmanager
def llama_server(build: llamacpp.Build, model: Path, workdir: Path, offload: list[str] | None = None,
                 env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """llama-server on 127.0.0.1 with one thread and a small context; `offload` are the flags that
    put the layers on a remote device (none: native CPU). Yields (process, URL, log) once healthy."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [str(build.binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "-c", "512", "--no-warmup", *(offload if offload else ["-ngl", "0"])]
    log = workdir / f"llama-server-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env=env if env is not None else dict(os.environ))
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        return serve.health(url, timeout=2) == "ok"

    try:
        wait_for("llama-server", healthy, 180)
        yield proc, url, log
    finally:
        proc.kill()
        proc.wait()


def greedy_tokens(url: str, n: int = 24) -> list[int]:
    """The token ids of a greedy completion of a fixed prompt."""
    body = json.dumps({"prompt": "The three primary colours are", "n_predict": n, "temperature": 0,
                       "top_k": 1, "seed": 7, "cache_prompt": False, "return_tokens": True}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    tokens = answer["tokens"]
    assert len(tokens) == n, answer
    return [int(t) for t in tokens]


def backend_ops_tester(build: llamacpp.Build) -> Path:
    """Upstream's test-backend-ops from the patched source, linked against the build's own ggml
    libraries (so it runs the frontend, `libggml-virtgpu`, that the build ships). One file compiled
    instead of a second configure with tests on, which would compile all of ggml again: about a minute
    on 2 cores, cached by the build's identity."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    with shared_env():
        src = llamacpp.source_dir()
    exe = SHARED_CACHE / "test-backend-ops" / build.identity / "test-backend-ops"
    with native_builds.locked("test-backend-ops"):
        if exe.exists():
            return exe
        exe.parent.mkdir(parents=True, exist_ok=True)
        return native_builds.compile_program(
            compiler, ["-std=c++17", "-O1", "-pthread", f"-I{src / 'ggml/include'}"],
            [src / "tests/test-backend-ops.cpp"], exe,
            [f"-L{build.bin_dir}", f"-Wl,-rpath,{build.bin_dir}", "-lggml", "-lggml-base"], "test-backend-ops")


def batched_bench(build: llamacpp.Build) -> Path:
    """Upstream's llama-batched-bench of the build (benchmarks/gpu_batched.py runs it), built in the
    build's own tree when it lacks it: apirctl's builds do not make it, and one more target there
    compiles the tool's two files and links them (seconds, through ccache)."""
    exe = build.bin_dir / "llama-batched-bench"
    with native_builds.locked(f"batched-bench-{build.identity}"):
        if not exe.exists():
            done = subprocess.run(["cmake", "--build", str(build.bin_dir.parent), "--target", "llama-batched-bench"],
                                  env=native_builds.build_environment(), capture_output=True, text=True, timeout=900,
                                  check=False)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return exe
