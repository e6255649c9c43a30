"""The host RPC backend killed and restarted under a running server, and parallel serves: real podman,
the real image and the demo model, driven through the CLI as a user would.

llama-server does not reconnect to a restarted backend (its first request aborts it), so apirctl
has to say which servers need a restart and, with `--restart-servers`, restart them itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.test_serve_faults import exists, free_port, port_is_free
from tests.support.sweep import Outcome, sweep

pytestmark = pytest.mark.integration
LINUX = {"APIRCTL_PLATFORM": "linux"}


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def chat(url: str) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})


def ps_row(name: str) -> dict[str, Any]:
    out = sweep("ps", "--json").succeeds()
    return next(r for r in json.loads(out.stdout) if r["name"] == name)


def machine(*args: str) -> Outcome:
    return sweep("machine", *args, env=LINUX, timeout=300)


@pytest.fixture
def backend(llama_build, podman: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """The host RPC backend on a free TCP port, started by the CLI; killed by its pid afterwards."""
    from apirctl.remoting import rpc_server

    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(llama_build.root))
    port = free_port()
    try:
        machine("restart", "--remoting", "--port", str(port), "--no-cache").succeeds()
        yield port
    finally:
        record = rpc_server.read_record()
        if record is not None and rpc_server.is_backend_process(record.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)


@pytest.fixture
def served(podman: str) -> Iterator[list[str]]:
    """Names of the servers a test starts; stopped (and checked gone) afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        sweep("stop", name)
    assert not [n for n in names if exists(n)], "a server was left behind"


def test_backend_killed_then_restart_servers(backend: int, demo_model: Path, served: list[str]) -> None:
    from apirctl.remoting import rpc_server

    name = f"rel-rpc-{uuid.uuid4().hex[:6]}"
    served.append(name)
    out = sweep("serve", str(demo_model), "--transport", "rpc", "--port", str(free_port()), "--name", name,
                "--json", env=LINUX, timeout=300).succeeds()
    url = json.loads(out.stdout)["url"]
    assert chat(url).status_code == 200
    old = rpc_server.read_record()
    assert old is not None

    os.kill(old.pid, signal.SIGKILL)
    wait_for("the backend to die", lambda: not rpc_server.is_backend_process(old.pid), 10)
    assert ps_row(name)["health"] == "rpc backend down"

    # a plain restart starts a new backend, and names the server it left behind, with the way out
    plain = machine("restart", "--remoting", "--port", str(backend), "--no-cache").succeeds()
    assert f"{name}: started against the previous backend" in plain.stderr
    assert "--restart-servers" in plain.stderr and "Traceback" not in plain.stderr
    assert ps_row(name)["health"] == "rpc backend restarted: restart this server"
    status = json.loads(machine("status", "--json").stdout)
    assert status["details"]["restart"] == name

    fixed = machine("restart", "--remoting", "--port", str(backend), "--no-cache", "--restart-servers").succeeds()
    assert f"serving: {name}" in fixed.stdout and "started against the previous backend" not in fixed.stderr
    new = rpc_server.read_record()
    assert new is not None and new.instance != old.instance
    assert chat(url).status_code == 200  # its connection goes to the new backend
    row = ps_row(name)
    assert row["state"] == "running" and row["health"] == "ok"
    assert row["url"] == url  # same name, same port
    status = json.loads(machine("status", "--json").stdout)
    assert status["details"].get("restart") is None and name in status["details"]["serving"]


def test_a_server_that_exited_with_the_killed_backend_is_restarted_too(backend: int, demo_model: Path,
                                                                      served: list[str]) -> None:
    from apirctl.remoting import rpc_server

    name = f"rel-rpc-{uuid.uuid4().hex[:6]}"
    served.append(name)
    out = sweep("serve", str(demo_model), "--transport", "rpc", "--port", str(free_port()), "--name", name,
                "--json", env=LINUX, timeout=300).succeeds()
    url = json.loads(out.stdout)["url"]
    old = rpc_server.read_record()
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    wait_for("the backend to die", lambda: not rpc_server.is_backend_process(old.pid), 10)
    with contextlib.suppress(httpx.HTTPError):
        chat(url)  # llama-server finds the backend gone here, aborts, and its container exits
    wait_for("the container to exit", lambda: ps_row_all(name)["state"] == "exited")

    plain = machine("restart", "--remoting", "--port", str(backend), "--no-cache").succeeds()
    assert f"{name}: started against the previous backend, its connection is dead (it exited)" in plain.stderr
    machine("restart", "--remoting", "--port", str(backend), "--no-cache", "--restart-servers").succeeds()
    assert chat(url).status_code == 200
    assert ps_row(name)["health"] == "ok"


def ps_row_all(name: str) -> dict[str, Any]:
    out = sweep("ps", "--all", "--json").succeeds()
    return next(r for r in json.loads(out.stdout) if r["name"] == name)


def test_five_parallel_serves_on_different_ports(llama_image: str, demo_model: Path, podman: str,
                                                 served: list[str]) -> None:
    runs = [(f"rel-par{i}-{uuid.uuid4().hex[:4]}", free_port()) for i in range(5)]
    served.extend(name for name, _ in runs)

    def serve(run: tuple[str, int]) -> Outcome:
        name, port = run
        return sweep("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                     "--json", timeout=400)

    with ThreadPoolExecutor(5) as pool:
        outcomes = list(pool.map(serve, runs))
    for outcome in outcomes:
        outcome.succeeds()
    for (name, port), outcome in zip(runs, outcomes, strict=True):
        url = json.loads(outcome.stdout)["url"]
        assert f":{port}/" in url and chat(url).status_code == 200
        assert ps_row(name)["health"] == "ok"

    # by name, in parallel too: `stop --all` would also stop the servers of other test runs on this host
    with ThreadPoolExecutor(5) as pool:
        stops = list(pool.map(lambda run: sweep("stop", run[0]), runs))
    for (name, _), stop in zip(runs, stops, strict=True):
        assert name in stop.succeeds().stdout
    assert not [name for name, _ in runs if exists(name)]
    assert all(port_is_free(port) for _, port in runs)
