"""The remoting mode with the host build's llama-bench as the rpc client (`--client host`).

This is the path of a GPU machine without podman: the client runs on the host with its own
GPUs hidden, and every offloaded layer goes through the real backend that
`apirctl machine restart --remoting` started. The rows must say which client ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from apirctl.bench import modes
from tests.bench.test_bench_cli import one_line_error
from tests.support.bench_helpers import run_cli
from tests.support.ports import free_port


def test_client_endpoint_dials_loopback_for_a_wildcard_bind() -> None:
    assert modes.client_endpoint("0.0.0.0", 50052) == "127.0.0.1:50052"
    assert modes.client_endpoint("127.0.0.1", 6000) == "127.0.0.1:6000"
    assert modes.client_endpoint("::1", 6000) == "[::1]:6000"


def test_unknown_client_is_a_one_line_error(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    one_line_error(run_cli("bench", str(model), "--modes", "remoting", "--client", "vm"), "unknown --client 'vm'")


@pytest.mark.integration
def test_host_client_through_the_rpc_backend(llama_build: Any, demo_model: Path, tmp_path: Path) -> None:
    """`--client host`, then the default client with podman off the PATH: both remoting rows ran on the host."""
    port = free_port()
    started = run_cli("machine", "restart", "--remoting", "--port", str(port), "--threads", "2")
    assert started.returncode == 0, started.stderr
    no_podman = tmp_path / "bin"  # a PATH on which podman cannot be found
    no_podman.mkdir()
    try:
        asked = run_cli("bench", str(demo_model), "--modes", "native,remoting", "--client", "host", "--reps", "1",
                        "--pp", "32", "--tg", "8", "--threads", "2", "--json", "--no-save")
        fallback = run_cli("bench", str(demo_model), "--modes", "remoting", "--reps", "1", "--pp", "0", "--tg", "8",
                           "--threads", "2", "--json", "--no-save", env=dict(os.environ, PATH=str(no_podman)))
    finally:
        run_cli("machine", "stop")
    assert asked.returncode == 0, asked.stderr
    data = json.loads(asked.stdout)
    assert data["system"]["transport"] == "rpc" and data["params"]["client"] == "host"
    remoting = [r for r in data["rows"] if r["mode"] == "remoting"]
    assert [r["test"] for r in remoting] == ["pp32", "tg8"]  # a single -ngl reached llama-bench
    for row in remoting:
        assert row["client"] == "host" and row["backend"] == "RPC"
        assert row["tps_mean"] > 0 and row["ratio_to_native"] > 0
    assert {r["client"] for r in data["rows"] if r["mode"] == "native"} == {"host"}

    assert fallback.returncode == 0, fallback.stderr
    data = json.loads(fallback.stdout)
    [row] = data["rows"]
    assert row["client"] == "host" and row["backend"] == "RPC" and row["tps_mean"] > 0
    assert "podman is not installed" in data["system"]["extra"]["remoting_client"]
