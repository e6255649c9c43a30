"""Several models behind one port over remoting: `apirctl serve A B --transport rpc` runs llama-server's
router in one container, and every model it loads goes through the container's one backend (a
ggml-rpc-server of its own, on shared memory).

Real parts only: the host backend started as `machine restart --remoting` starts it, the real image,
the demo model under two names. The backend serves one client at a time and each loaded model is a
client of its own, so the router keeps one model loaded: a request for the other unloads the first,
and the backend then serves the second (the same backend process, which is the proof that both went
through it). Over `virtgpu` on Linux the same holds with the container's apir-host, which serves the router's
own connection beside the loaded model's.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apirctl.machine import MachineState, RestartOptions
from apirctl.podman import containers, engine
from apirctl.remoting import apir_hosts, backends, rpc_server
from tests.serve.test_serve_router import named_copy
from tests.support.ports import free_port

pytestmark = pytest.mark.integration
FIRST, SECOND = "first-model", "second-model"


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, APIRCTL_PLATFORM="linux"))


@pytest.fixture
def name(podman: str) -> Iterator[str]:
    made = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    yield made
    with contextlib.suppress(Exception):
        cli("stop", made)
    with contextlib.suppress(Exception):
        engine.client().containers.get(made).remove(force=True)


def states(port: int) -> dict[str, str]:
    answer = httpx.get(f"http://127.0.0.1:{port}/models", timeout=30).json()
    return {entry["id"]: entry["status"]["value"] for entry in answer["data"]}


def answer(port: int, model: str, name: str) -> dict[str, Any]:
    """A greedy chat answer from `model` through the one port (the router loads it on this request); a
    failure shows the container's last log lines."""
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                       json={"model": model, "messages": [{"role": "user", "content": "Say hi."}],
                             "max_tokens": 6, "temperature": 0, "seed": 3})
    if reply.status_code != 200:
        raise AssertionError(f"{model}: {reply.text}\n{containers.connect().logs(name, tail=60)}")
    body: dict[str, Any] = reply.json()
    assert body["choices"][0]["message"]["content"].strip(), body
    return body


def serve_two(demo_model: Path, tmp_path: Path, name: str, port: int, transport: str) -> dict[str, Any]:
    done = cli("serve", str(named_copy(demo_model, tmp_path / f"{FIRST}.gguf")),
               str(named_copy(demo_model, tmp_path / f"{SECOND}.gguf")), "--transport", transport,
               "-p", str(port), "-n", name, "-c", "512", "-t", "2", "--json")
    assert done.returncode == 0, done.stderr
    server: dict[str, Any] = json.loads(done.stdout)
    assert server["router"] is True and server["models"] == {FIRST: "unloaded", SECOND: "unloaded"}
    assert "one model loaded at a time" in server["notice"]
    return server


def both_answer_in_turn(port: int, name: str) -> list[str]:
    """Each model answers through the one port; asking the other unloads the loaded one. Returns
    the answers (the same weights under two names, greedy: the same text)."""
    texts = []
    for model, other in ((FIRST, SECOND), (SECOND, FIRST), (FIRST, SECOND)):
        texts.append(answer(port, model, name)["choices"][0]["message"]["content"])
        found = states(port)
        assert found[model] == "loaded" and found[other] != "loaded", found
    return texts


def test_a_router_over_rpc_sends_both_models_through_its_one_backend(
        with_build: Any, llama_image: str, demo_model: Path, tmp_path: Path, name: str) -> None:
    result = rpc_server.restart(RestartOptions(remoting=True, cache=False, threads=2))
    assert result.state == MachineState.READY, result
    port = free_port()
    server = serve_two(demo_model, tmp_path, name, port, "rpc")
    assert server["transport"] == "rpc"
    labels = containers.connect().inspect(server["id"])["Config"]["Labels"]
    instance = backends.get(labels["apirctl.rpc-instance"])
    assert instance is not None and instance.container == server["id"] and backends.alive(instance)
    pid = instance.pid

    texts = both_answer_in_turn(port, name)
    assert texts[0] == texts[1] == texts[2], texts
    # one backend, the same process all along, and every loaded model was a client of it: each
    # child llama-server moved its link to shared memory on that backend (one line per client)
    after = backends.get(instance.id)
    assert after is not None and after.pid == pid and backends.alive(after)
    log = Path(instance.log).read_bytes()
    assert log.count(b"shared host buffer 1: ") >= 3, log[-2000:]
    assert [i.id for i in backends.instances()] == [instance.id]
    ps = {row["name"]: row for row in json.loads(cli("ps", "--json").stdout)}
    assert ps[name]["rpc_link"] == "shm" and ps[name]["health"] == "ok"
    assert ps[name]["models"] == states(port)

    assert cli("stop", name).returncode == 0
    assert backends.get(instance.id) is None and not backends.alive(instance)


def test_a_router_over_virtgpu_sends_both_models_through_its_apir_host(
        with_build: Any, llama_image: str, demo_model: Path, tmp_path: Path, name: str) -> None:
    """The router process itself registers the virtgpu frontend when it parses its arguments, connects
    to the container's apir-host and keeps the connection; the apir-host serves a few clients at once,
    each in a child of its own, so each model the router starts is a second client beside it."""
    assert apir_hosts.host_problem(with_build) is None, "the pinned build has apir-host and the backend library"
    port = free_port()
    server = serve_two(demo_model, tmp_path, name, port, "virtgpu")
    assert server["transport"] == "virtgpu"
    labels = containers.connect().inspect(server["id"])["Config"]["Labels"]
    host = apir_hosts.get(labels["apirctl.apir-host"])
    assert host is not None and host.container == server["id"] and apir_hosts.alive(host)
    pid = apir_hosts.current_pid(host)

    texts = both_answer_in_turn(port, name)
    assert texts[0] == texts[1] == texts[2], texts
    # the same apir-host all along; each model's llama-server was a client of its own (a child of the
    # host that loaded the backend library), and each left when the router unloaded its model
    after = apir_hosts.get(host.id)
    assert after is not None and apir_hosts.current_pid(after) == pid and apir_hosts.alive(after)
    # two clients now: the router's own connection and the loaded model's, a child of the host each
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 2, children
    log = Path(host.log).read_text(errors="replace")
    assert log.count("client disconnected") == 2, log[-3000:]  # the first two loads, unloaded
    assert "crashed" not in log and "refused" not in log, log[-3000:]

    assert cli("stop", name).returncode == 0
    assert apir_hosts.get(host.id) is None
