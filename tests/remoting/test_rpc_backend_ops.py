"""Upstream's test-backend-ops through the RPC transport: the build's `libggml-rpc` as the client against
a real `ggml-rpc-server` on the CPU, each case computed on the RPC device and compared with the CPU
backend in the same process (llama_patches/ 0018).

The client asks the server's device whether it supports an op (SUPPORTS_OP, once per op signature),
so a case the server's CPU cannot run is reported "not supported" on the RPC backend instead of
reaching the server; before, the client claimed every op and the server computed whatever it got.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.conftest import SHARED_CACHE, shared_env
from tests.support.backend_ops import RPC_ENDPOINT_ENV, RPC_SHIM, SUBSETS, read_counts
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Unix socket")]

# a case the CPU refuses (no conversion to iq2_xxs), and one of every other kind that it runs
OPS = {"CPY": "type_dst=iq2_xxs,", "RMS_NORM": None}


@pytest.fixture(scope="module")
def tester(llama_build: llamacpp.Build) -> Path:
    """test-backend-ops with the shim, linked against the build's ggml and ggml-rpc (about a minute)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    with shared_env():
        src = llamacpp.source_dir()
    exe = SHARED_CACHE / "test-backend-ops-rpc" / llama_build.identity / "test-backend-ops"
    if exe.exists():
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    shim = exe.with_name("rpc_shim.cpp")
    shim.write_text(RPC_SHIM)
    partial = exe.with_name(exe.name + ".partial")
    done = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-pthread", f"-I{src / 'ggml/include'}",
         str(src / "tests/test-backend-ops.cpp"), str(shim), "-o", str(partial), f"-L{llama_build.bin_dir}",
         f"-Wl,-rpath,{llama_build.bin_dir}", "-lggml", "-lggml-base", "-lggml-rpc"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    os.replace(partial, exe)
    return exe


@pytest.fixture
def server(llama_build: llamacpp.Build, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    path, log = tmp_path / "rpc.sock", tmp_path / "rpc.log"

    def connects() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(path))
            except OSError:
                return False
        return True

    with log.open("wb") as out:
        proc = subprocess.Popen([str(llama_build.binary("ggml-rpc-server")), "-H", f"unix:{path}", "-d", "CPU"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for("the rpc server's socket", lambda: path.exists() and connects(), 60)
        yield proc, path, log
    finally:
        proc.kill()
        proc.wait()


def test_backend_ops_through_rpc_pass_or_are_unsupported(tester: Path, server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, path, log = server
    for op, refused in OPS.items():
        args = [str(tester), "test", "-b", "RPC0", "-o", op]
        if op in SUBSETS:
            args += ["-p", SUBSETS[op]]
        done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                              env={**os.environ, RPC_ENDPOINT_ENV: f"unix:{path}"})
        where = f"{op}: {done.stdout[-2000:]}{done.stderr[-2000:]}\nserver: {log.read_text(errors='replace')[-2000:]}"
        counts = read_counts(done.stdout)
        assert proc.poll() is None, f"the server died during {where}"
        assert "graph refused" not in log.read_text(errors="replace"), where  # the client asked first
        assert done.returncode == 0 and not counts.failed, where
        assert counts.passed > 0, where
        if refused:
            # the client asked the server: the RPC backend is named among those that cannot run them
            named = [case for case in counts.unsupported if refused in case]
            assert named and all("RPC" in case for case in named), where
