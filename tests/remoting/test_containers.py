"""Containers on the rpc transport against the apirctl-owned backend: reach, serve, faults.

Real podman, the real image and the real demo model. What llama-server does when its backend
dies is upstream behaviour, measured here: it notices at its next request, aborts ("Remote RPC
server crashed"), and its container exits; it does not reconnect, so after
`machine restart --remoting` the container has to be started again.
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

import httpx
import pytest

from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, RestartOptions
from apirctl.podman import containers
from apirctl.remoting import rpc_server
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def name(podman: str) -> Iterator[str]:
    from podman.errors import NotFound

    from apirctl.podman import engine

    value = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    yield value
    with contextlib.suppress(NotFound):
        engine.client().containers.get(value).remove(force=True)


def test_a_container_reaches_the_backend_through_host_loopback(
    backend: int, podman: str, llama_image: str, demo_model: Path
) -> None:
    from apirctl.remoting import transport

    plan = transport.plan("rpc", ngl=99, status=rpc_server.status(), platform_name="linux")
    assert plan.llama_args[:2] == ["--rpc", f"10.0.2.2:{backend}"]
    spec = plan.apply(containers.ContainerSpec(
        image=llama_image, name=f"apirctl-test-{uuid.uuid4().hex[:8]}", entrypoint=["/app/bin/llama-bench"],
        command=["-m", "/models/demo.gguf", "-p", "8", "-n", "4", "-r", "1", "-o", "json"],
        mounts=[containers.BindMount(source=demo_model, target="/models/demo.gguf")],
    ))
    result = containers.run_once(spec, timeout=300)
    assert result.exit_code == 0, result.output[-2000:]
    rows = json.loads(result.output[result.output.index("["):result.output.rindex("]") + 1])
    assert rows[0]["gpu_info"] == f"10.0.2.2:{backend}" and "RPC" in rows[0]["backends"]
    assert rpc_server.status().state == MachineState.READY  # the container's connection is gone again


def test_serve_rpc_while_the_backend_is_down_says_what_to_run(with_build: object, demo_model: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "apirctl", "serve", str(demo_model), "--transport", "rpc",
                             "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, APIRCTL_PLATFORM="linux"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("apirctl: error:") and "not running" in lines[0]
    assert "apirctl machine restart --remoting" in result.stderr


def chat(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})


def test_kill_the_backend_while_a_container_uses_it(
    backend: int, podman: str, llama_image: str, demo_model: Path, name: str
) -> None:
    from apirctl import serve

    started = serve.start(serve.options(str(demo_model), transport="rpc", port=free_port(), name=name))
    base = started.server.base
    assert started.server.transport == "rpc" and chat(base).status_code == 200

    status = rpc_server.status()
    assert status.state == MachineState.SERVING and name in status.details["serving"]
    with pytest.raises(ApirctlError, match=name):
        rpc_server.stop()  # a remoting container depends on it

    record = rpc_server.read_record()
    assert record is not None
    os.kill(record.pid, 9)
    wait_for("the backend to die", lambda: not rpc_server.is_backend_process(record.pid), 10)
    down = rpc_server.status()
    assert down.state == MachineState.NOT_RUNNING and "down" in down.summary
    # llama-server's own /health still says ok: `apirctl ps` shows the reason instead
    ps = subprocess.run([sys.executable, "-m", "apirctl", "ps", "--json"], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ))
    assert ps.returncode == 0, ps.stderr
    row = next(r for r in json.loads(ps.stdout) if r["name"] == name)
    assert row["state"] == "running" and row["health"] == "rpc backend down"
    assert row["rpc_link"] == "tcp" and row["rpc_instance"] == record.instance

    # a new backend is not the one the server's connection went to: ps says so (its label names the instance)
    restarted = rpc_server.restart(RestartOptions(remoting=True, port=backend, cache=False))
    assert restarted.state == MachineState.READY and restarted.details["restart"] == name, restarted
    assert serve.find_server(name).health == "rpc backend restarted: restart this server"

    # llama-server finds out at its next request: it aborts and its container exits
    with contextlib.suppress(httpx.HTTPError):
        chat(base)

    def exited() -> serve.Server | None:
        server = next(s for s in serve.list_servers(all=True, probe_health=False) if s.name == name)
        return server if server.state != "running" else None

    assert wait_for("the container to exit", exited, 60).health == "-"
    api = containers.connect()
    assert "Remote RPC server crashed" in api.logs(started.server.id)

    assert rpc_server.restart(RestartOptions(remoting=True, port=backend, cache=False)).state == MachineState.READY
    api.start(started.server.id, name)  # it does not reconnect by itself
    wait_for("the server to answer again", lambda: serve.health(base) == "ok", 180)
    assert chat(base).status_code == 200
    assert serve.find_server(name).health == "ok"  # started after the backend: connected to this one
    assert rpc_server.status().state == MachineState.SERVING

    # --force is the command's: it stops the servers that use the backend, then the backend
    stop = subprocess.run([sys.executable, "-m", "apirctl", "machine", "stop", "--force", "--json"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, APIRCTL_PLATFORM="linux"))
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout)["state_name"] == "not_running"
    assert not any(s.name == name for s in serve.list_servers(all=True))
