"""APIR on Linux, as apirctl wires it: the ggml-virtgpu frontend in a real Podman container against an
apir-host of its own (the pinned build's, on the CPU backend), on a socket in the private runtime
directory.

Real parts only: the patched build's apir-host and libggml-virtgpu-backend, the image's frontend,
real containers, the real demo model. The host program's own checks (hostile clients, sanitizers)
are tested with it natively; this file tests apirctl's side: the host's life (private socket, why it
died, revived on the same socket, trace kept), serve, ps, machine status, bench, stop, and a container
generating native's greedy tokens. Containers are reused across assertions: each one costs a model
load on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apirctl import serve
from apirctl.apir import trace as apir_trace
from apirctl.bench import modes as bench_modes
from apirctl.bench.llamabench import Params
from apirctl.machine import RestartOptions
from apirctl.paths import dirs
from apirctl.podman import containers, engine
from apirctl.remoting import apir_hosts, rpc_server
from tests.remoting.test_unix_transport import as_nobody, greedy_tokens, host_server, tcp_listeners_of
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, APIRCTL_PLATFORM="linux"))


def host_of(server_id: str) -> apir_hosts.Host:
    labels = containers.connect().inspect(server_id)["Config"]["Labels"]
    assert labels["apirctl.transport"] == "virtgpu" and labels["llama-cpp.apir"] == "true"
    host = apir_hosts.get(labels["apirctl.apir-host"])
    assert host is not None and host.container == server_id
    return host


def gone(host: apir_hosts.Host) -> bool:
    return (not apir_hosts.alive(host) and not Path(host.directory).exists() and apir_hosts.get(host.id) is None
            and not Path(host.log).exists())


@pytest.fixture
def apir_build(with_build: Any) -> Any:
    assert apir_hosts.host_problem(with_build) is None, "the pinned build has apir-host and the backend library"
    return with_build


def test_an_apir_host_is_private_says_why_it_died_and_comes_back_on_its_socket(apir_build: Any,
                                                                                demo_model: Path) -> None:
    host = apir_hosts.start(apir_build, "lifecycle", trace=True)
    try:
        assert host.socket.parent.parent == dirs().runtime
        assert stat.S_IMODE(host.socket.parent.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(host.socket.stat().st_mode) and stat.S_IMODE(host.socket.stat().st_mode) == 0o600
        assert not tcp_listeners_of(host.pid), "no port is open"
        assert apir_hosts.problem(host.id) is None
        if os.geteuid() == 0:  # another user reaches neither the directory nor the socket
            denied = as_nobody(f"import os, socket; print(os.access({str(host.socket.parent)!r}, os.X_OK)); "
                               f"socket.socket(socket.AF_UNIX).connect({str(host.socket)!r})")
            assert denied.stdout.strip() == "False" and "PermissionError" in denied.stderr, denied

        # the frontend of the host build talks to it (llama-bench lists its device), and `apir trace
        # --follow` shows the calls as the host makes them, until Ctrl-C
        follower = subprocess.Popen([sys.executable, "-m", "apirctl", "apir", "trace", "--server", "lifecycle",
                                     "--follow", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        env = dict(os.environ, GGML_VIRTGPU_SOCKET=str(host.socket))
        listed = subprocess.run([str(apir_build.binary("llama-bench")), "--list-devices"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert "virtgpu" in listed.stdout + listed.stderr, listed
        assert follower.stdout is not None
        seen = [json.loads(follower.stdout.readline()) for _ in range(3)]
        assert [r["function"] for r in seen] == ["handshake", "loadlibrary", seen[2]["function"]] and seen[2]["ok"]
        follower.send_signal(signal.SIGINT)
        rest, errors = follower.communicate(timeout=30)
        assert follower.returncode == 0 and "Traceback" not in errors, errors
        assert json.loads(rest.splitlines()[-1])["summary"]["records"] >= 3

        pid = host.pid
        os.kill(pid, signal.SIGKILL)
        wait_for("the watcher's line", lambda: apir_hosts.problem(host.id), 10)
        assert apir_hosts.problem(host.id) == f"apir host down: apir-host (pid {pid}) was killed by signal 9 (SIGKILL)"

        back = apir_hosts.revive(host.id)
        assert back.pid != pid and apir_hosts.alive(back) and back.socket == host.socket
        assert apir_hosts.problem(host.id) is None
    finally:
        apir_hosts.stop(host.id)
    assert gone(host)
    trace_file = Path(str(host.trace))
    records = apir_trace.read(trace_file.read_bytes())  # kept after the host, and what it says is real
    assert [r.name for r in records[:2]] == ["handshake", "loadlibrary"] and all(r.ok for r in records)
    assert any(r.name == "device_get_name" for r in records)

    # the bench's apir mode with the host client: an apir-host of the run's own, stopped with it
    bench = cli("bench", str(demo_model), "--modes", "apir", "--client", "host", "--reps", "1", "--pp", "8",
                "--tg", "4", "--threads", "1", "--json", "--no-save")
    assert bench.returncode == 0, bench.stderr
    rows = json.loads(bench.stdout)["rows"]
    assert [(r["mode"], r["client"], r["transport"]) for r in rows] == [("apir", "host", "virtgpu-socket")] * 2
    assert all(r["tps_mean"] > 0 for r in rows) and apir_hosts.hosts() == []

    # `machine restart --remoting` checks the host program and says so
    result = rpc_server.restart(RestartOptions(remoting=True, cache=False, threads=2))
    try:
        assert result.details["apir"].startswith("ready: an apir-host of its own per virtgpu container"), result
        assert apir_hosts.hosts() == [], "the check's host is stopped"
    finally:
        rpc_server.stop()


@pytest.fixture
def names(podman: str) -> Iterator[list[str]]:
    made = [f"apirctl-test-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    yield made
    for name in made:
        with contextlib.suppress(Exception):
            serve.stop(name)
        with contextlib.suppress(Exception):
            engine.client().containers.get(name).remove(force=True)


def chat_or_explain(server: serve.Server) -> httpx.Response:
    """A short chat; a server that does not answer fails the test with its state and both logs."""
    try:
        return httpx.post(f"{server.base}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8})
    except httpx.HTTPError as exc:
        api = containers.connect()
        host = host_of(server.id)
        raise AssertionError(f"{server.name} does not answer ({exc}): {api.inspect(server.id)['State']}\n"
                             f"{api.logs(server.id, tail=30)}\n{Path(host.log).read_text()}") from None


def computes(trace_file: Path) -> int:
    """Graph computes the host has traced so far (it may be writing the last record)."""
    with trace_file.open("rb") as fh:
        return sum(r.name == "backend_graph_compute"
                   or ((found := r.graph_run()) is not None and found[0].graph_id != 0)
                   for r in apir_trace.records(fh, live=True))


def _decode_in_background(base: str, results: list[Any]) -> threading.Thread:
    """A long greedy completion whose outcome (a reply or the exception) lands in `results`."""
    def run() -> None:
        try:
            results.append(httpx.post(f"{base}/completion", timeout=120,
                                      json={"prompt": "Once upon a time", "n_predict": 400, "temperature": 0}))
        except httpx.HTTPError as exc:
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_apir_containers_generate_natives_tokens_and_survive_their_hosts_death(
    apir_build: Any, llama_image: str, demo_model: Path, names: list[str]
) -> None:
    native, base = host_server(apir_build, demo_model)
    try:
        expected = greedy_tokens(base)
    finally:
        native.kill()
        native.wait()

    first = serve.start(serve.options(str(demo_model), transport="virtgpu", port=free_port(), name=names[0],
                                      apir_trace=True, threads=2))
    server = first.server
    assert server.transport_name == "virtgpu-socket"
    host = host_of(server.id)
    assert apir_hosts.alive(host) and host.owner_pid == 0, "released to its container"
    inspected = containers.connect().inspect(server.id)
    mounts = {(m["Source"], m["Destination"], m["RW"]) for m in inspected["Mounts"]
              if m["Destination"] == "/run/apirctl-apir"}
    assert mounts == {(host.directory, "/run/apirctl-apir", False)}
    assert "GGML_VIRTGPU_SOCKET=/run/apirctl-apir/apir.sock" in inspected["Config"]["Env"]
    assert not inspected["HostConfig"].get("Devices")

    # the container's frontend, the host's backend library on the CPU: native's greedy tokens
    assert greedy_tokens(server.base) == expected

    # the trace of its host: every command since the handshake, with graph computes for the tokens
    traced = cli("apir", "trace", "--server", names[0], "--summary", "--json")
    assert traced.returncode == 0, traced.stderr
    summary = json.loads(traced.stdout)["summary"]
    assert summary["graph_computes"] >= 16 and summary["failed"] == 0 and summary["calls_per_compute"] > 1
    functions = {f["function"] for f in summary["functions"]}
    assert {"handshake", "loadlibrary", "device_buffer_from_ptr", "ext_get_features", "ext_graph_run"} <= functions
    # the container's frontend names its kept graphs by id (patch 0013): the graph cache is in use
    assert "backend_graph_compute" not in functions
    # an id the host dropped (a buffer freed or cleared) is answered unknown and the graph sent again
    cache = summary["graph_cache"]
    assert cache["by_id"] >= 12 and cache["unknown"] <= cache["sent"], cache
    text = cli("apir", "trace", "--server", names[0], "--summary")
    assert text.returncode == 0 and "computes named a kept graph" in text.stdout, text.stdout

    # a second APIR container at once, on a host of its own: both answer
    second = serve.start(serve.options(str(demo_model), transport="virtgpu", port=free_port(), name=names[1],
                                       threads=2))
    other = host_of(second.server.id)
    assert other.directory != host.directory and other.pid != host.pid and other.trace is None
    for started in (first, second):
        reply = chat_or_explain(started.server)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].strip()
    ps = {r["name"]: r for r in json.loads(cli("ps", "--json").stdout)}
    assert all(ps[n]["transport"] == "virtgpu" and ps[n]["apir_host"] and ps[n]["health"] == "ok" for n in names)
    assert all(any(n in line and "virtgpu-socket" in line for line in cli("ps").stdout.splitlines()) for n in names)
    status = cli("machine", "status", "--json")
    details = json.loads(status.stdout)["details"]
    assert any(line.startswith(f"{names[0]}: pid {host.pid}, {host.socket}, trace") for line in details["apir_hosts"])
    assert details["apir"].startswith("ready")

    # bench's apir mode beside them: llama-bench in a container without network, on a host of its own
    outcome = bench_modes.run("smollm2", demo_model, ["apir"], Params(pp=8, tg=4, reps=1, threads=1))
    assert not outcome.failures, outcome.failures
    assert [(r.mode, r.client, r.transport) for r in outcome.run.rows] == [("apir", "container", "virtgpu-socket")] * 2
    assert all((r.tps_mean or 0) > 0 for r in outcome.run.rows)
    assert {h.container for h in apir_hosts.hosts()} == {server.id, second.server.id}, "the run's host is gone"

    # kill the first host mid-decode: that server fails clearly, the other keeps serving
    results: list[Any] = []
    before = computes(Path(str(host.trace)))
    thread = _decode_in_background(server.base, results)
    wait_for("decoding to start", lambda: computes(Path(str(host.trace))) > before + 8, 60)
    killed = host.pid
    os.kill(killed, signal.SIGKILL)
    thread.join(120)
    assert results and not (isinstance(results[0], httpx.Response) and results[0].status_code == 200), results
    wait_for("the server to exit", lambda: containers.connect().inspect(server.id)["State"]["Status"] != "running", 60)
    assert "the APIR host closed the connection" in containers.connect().logs(server.id, tail=40)
    row = next(r for r in json.loads(cli("ps", "--all", "--json").stdout) if r["name"] == names[0])
    why = f"apir host down: apir-host (pid {killed}) was killed by signal 9 (SIGKILL)"
    assert row["state"] == "exited" and why in row["why"], row
    assert apir_hosts.get(host.id) is not None, "a dead host stays recorded while its container exists"
    assert greedy_tokens(second.server.base) == expected, "the other container's host is untouched"

    # a restart brings it back: a new host on the same socket, the same tokens
    restarted = cli("restart", names[0], "--json")
    assert restarted.returncode == 0, restarted.stderr
    back = host_of(server.id)
    assert back.id == host.id and back.pid != killed and apir_hosts.alive(back)
    assert greedy_tokens(server.base) == expected

    # stop removes the host with its container; the trace stays for reading
    assert serve.stop(names[0]) == [names[0]]
    assert gone(host) and Path(str(host.trace)).exists()
    assert cli("stop", names[1]).returncode == 0
    assert gone(other) and apir_hosts.hosts() == []


def test_with_a_restart_policy_podman_and_the_watcher_bring_the_server_back(
    apir_build: Any, llama_image: str, demo_model: Path, names: list[str]
) -> None:
    """`serve --restart on-failure`: the host killed mid-decode is started again by its watcher, and
    the container Podman restarts after the frontend's abort connects to it; nobody runs a command."""
    started = serve.start(serve.options(str(demo_model), transport="virtgpu", port=free_port(), name=names[0],
                                        apir_trace=True, threads=2, restart="on-failure:5"))
    server = started.server
    host = host_of(server.id)
    assert host.respawn
    expected = greedy_tokens(server.base)
    results: list[Any] = []
    before = computes(Path(str(host.trace)))
    thread = _decode_in_background(server.base, results)
    wait_for("decoding to start", lambda: computes(Path(str(host.trace))) > before + 8, 60)
    killed = apir_hosts.current_pid(host)
    os.kill(killed, signal.SIGKILL)
    thread.join(120)
    assert results and not isinstance(results[0], httpx.Response), results  # that request died with the host

    def back() -> bool:
        state = containers.connect().inspect(server.id)["State"]
        return bool(state.get("Status") == "running" and serve.health(server.base) == "ok"
                    and apir_hosts.current_pid(host) != killed and apir_hosts.alive(host))

    wait_for("Podman to restart the container against a new host", back, 120)
    assert containers.connect().inspect(server.id)["RestartCount"] >= 1
    assert greedy_tokens(server.base) == expected
    line = next(line for line in rpc_server.status().details["apir_hosts"] if line.startswith(names[0]))
    assert f"started again after: apir-host (pid {killed}) was killed by signal 9 (SIGKILL)" in line

    # stopping it does not start the host again
    assert serve.stop(names[0]) == [names[0]]
    assert gone(host) and not apir_hosts.alive(host)
