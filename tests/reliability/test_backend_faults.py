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
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.test_serve_faults import exists, port_is_free
from tests.support.ports import free_port
from tests.support.sweep import REPO, Outcome, sweep
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
LINUX = {"APIRCTL_PLATFORM": "linux"}


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
    row = ps_row(name)
    assert row["health"] == row["why"] == "rpc backend restarted: restart this server"
    status = json.loads(machine("status", "--json").stdout)
    assert status["details"]["restart"] == name
    assert f"{name}: rpc backend restarted: restart this server" in status["details"]["servers"]

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
    assert f"{name}: serving (rpc-tcp)" in status["details"]["servers"]


def in_a_terminal(*args: str, answer: str) -> tuple[int, str]:
    """`apirctl ARGS` on a pseudo-terminal, answering its yes/no question with `answer`."""
    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "apirctl", *args], env={**os.environ, **LINUX}, cwd=str(REPO),
                          encoding="utf-8", timeout=300, dimensions=(40, 200))
    child.expect_exact("restart them now?")
    shown = f"{child.before}{child.after}"
    child.sendline(answer)
    child.expect(pexpect.EOF)
    child.close()
    return int(child.exitstatus if child.exitstatus is not None else -1), shown + str(child.before)


def test_an_exited_server_is_offered_a_restart_on_a_terminal(backend: int, demo_model: Path,
                                                             served: list[str]) -> None:
    """llama-server aborts at its first request after its backend died; on a terminal `machine restart
    --remoting` names it and asks (no: nothing restarted, the hint; yes: it answers again)."""
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
    wait_for("the container to exit", lambda: ps_row_all(name)["state"] == "exited", 60)
    assert ps_row_all(name)["why"].startswith("exited (code ")

    restart = ("machine", "restart", "--remoting", "--port", str(backend), "--no-cache")
    code, shown = in_a_terminal(*restart, answer="n")
    assert code == 0 and "Traceback" not in shown
    assert f"{name}: started against the previous backend, its connection is dead (it exited)" in shown
    assert "--restart-servers" in shown  # the hint, after a no
    row = ps_row_all(name)
    assert row["state"] == "exited" and row["why"].endswith(": rpc backend restarted: restart this server")
    status = json.loads(machine("status", "--json").stdout)
    assert status["details"]["restart"] == name
    lines = status["details"]["servers"]
    assert any(line.startswith(f"{name}: exited (code ") and line.endswith(": rpc backend restarted: restart this "
                                                                             "server") for line in lines), lines

    code, shown = in_a_terminal(*restart, answer="y")
    assert code == 0 and "Traceback" not in shown and "--restart-servers" not in shown
    assert chat(url).status_code == 200
    assert ps_row(name)["health"] == "ok"


def test_a_backend_back_on_another_port_or_a_socket_leaves_its_servers_stale(backend: int, demo_model: Path,
                                                                             served: list[str]) -> None:
    """A server's container dials the backend's old port: a backend back on another port or on a Unix
    socket is not its backend either. ps, machine status and machine restart say so, and
    --restart-servers makes its container again against the backend as it is (a restart of the old
    one would dial the old port): same name, same URL, and it answers."""
    from apirctl.remoting import rpc_server

    name = f"rel-rpc-{uuid.uuid4().hex[:6]}"
    served.append(name)
    out = sweep("serve", str(demo_model), "--transport", "rpc", "--port", str(free_port()), "--name", name,
                "--json", env=LINUX, timeout=300).succeeds()
    url = json.loads(out.stdout)["url"]
    other = free_port()
    for where, was, says in ((["--port", str(other)], backend, f"to {other}"),
                             (["--listen", "unix", "--json"], other, "to a Unix socket")):
        old = rpc_server.read_record()
        assert old is not None
        os.kill(old.pid, signal.SIGKILL)  # (a running backend with users refuses a restart)
        wait_for("the backend to die", lambda pid=old.pid: not rpc_server.is_backend_process(pid), 10)
        moved = f"the backend moved from tcp port {was} {says}"
        plain = machine("restart", "--remoting", *where, "--no-cache").succeeds()
        if "--json" in where:  # no question, the same lines and hint on stderr; stdout is the state alone
            assert json.loads(plain.stdout)["details"]["restart"] == name
        assert f"{name}: started against the previous backend, its connection is dead; {moved}: restart it " \
               "(in a new container)" in plain.stderr
        assert "--restart-servers" in plain.stderr and "Traceback" not in plain.stderr
        assert ps_row(name)["health"] == "rpc backend restarted: restart this server"
        status = json.loads(machine("status", "--json").stdout)
        assert status["details"]["restart"] == name
        assert f"{name}: rpc backend restarted: {moved}: restart this server (in a new container)" in \
            status["details"]["servers"]

        again = [w for w in where if w != "--json"]
        machine("restart", "--remoting", *again, "--no-cache", "--restart-servers").succeeds()
        assert chat(url).status_code == 200
        row = ps_row(name)
        assert row["health"] == "ok" and row["url"] == url, row
        if "unix" in where:  # a backend of its own now, over the socket or shared memory
            assert row["rpc_link"] in ("unix", "shm") and row["transport"] == "rpc", row
        else:
            assert row["rpc_link"] == "tcp" and row["rpc_target"].endswith(f":{other}"), row
        assert not json.loads(machine("status", "--json").stdout)["details"].get("restart")


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
