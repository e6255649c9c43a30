"""The rpc transport over a Unix socket and shared memory, as apirctl wires it.

Real parts only: the patched ggml-rpc-server and llama-server from the pinned build, real Podman
containers (one with `--network none`), the real demo model. The C++ side (rings, faults, sanitizers,
the same tokens native/TCP/shared memory between host processes, the socket's own refusal of
another user) is tested against ggml-rpc-server directly in test_shm_native.py; this file tests
apirctl's side: the host backend in the private runtime directory, a backend of its own per
container, labels, ps, machine status, stop and cleaning, bench beside a running server, and a
`--network none` container answering with the same greedy tokens as native.
Containers are reused across assertions: each one costs a model load on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apirctl import serve
from apirctl.machine import MachineState, RestartOptions
from apirctl.paths import dirs
from apirctl.podman import containers, engine
from apirctl.remoting import backends, rpc_client, rpc_server, transport
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
PROMPT = "The capital of France is"
GREEDY = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "seed": 7, "return_tokens": True, "cache_prompt": False}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, APIRCTL_PLATFORM="linux"))


def tcp_listeners_of(pid: int) -> set[str]:
    """The TCP sockets a process listens on (inodes), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                listening.add(cols[9])
    return listening


def as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """Python code run as the user `nobody` (the system interpreter: the venv may be out of its reach)."""
    return subprocess.run(["/usr/bin/python3", "-I", "-c", code], capture_output=True, text=True, timeout=30,
                          user="nobody", group="nogroup", extra_groups=[], cwd="/")


@pytest.fixture
def unix_backend(with_build: Any) -> rpc_server.BackendRecord:
    """The host backend on its Unix socket (the default listen), as `machine restart --remoting` starts it."""
    result = rpc_server.restart(RestartOptions(remoting=True, cache=False, threads=2))
    assert result.state == MachineState.READY, result
    record = rpc_server.read_record()
    assert record is not None and record.listen == "unix"
    return record


def test_the_host_backend_listens_on_a_private_socket_only(unix_backend: rpc_server.BackendRecord,
                                                           demo_model: Path) -> None:
    sock = Path(str(unix_backend.socket))
    assert sock == dirs().runtime / "rpc.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert not tcp_listeners_of(unix_backend.pid), "no port is open for remoting"

    status = cli("machine", "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    details = json.loads(status.stdout)["details"]
    assert details["listen"] == "unix" and details["socket"] == str(sock) and details["endpoint"] == f"unix:{sock}"
    assert details["protocol"].startswith("7.") and "MiB free of" in details["memory"]
    assert "unix socket" in details["transport"]
    assert rpc_client.probe(f"unix:{sock}").devices  # the Python client speaks the socket too
    text = cli("machine", "status")
    assert f"ready on unix:{sock}" in text.stdout and "transport: unix socket" in text.stdout

    if os.geteuid() == 0:  # another user cannot even reach the socket: the directory keeps it out
        denied = as_nobody(f"import os, socket; print(os.access({str(sock.parent)!r}, os.X_OK)); "
                           f"socket.socket(socket.AF_UNIX).connect({str(sock)!r})")
        assert denied.stdout.strip() == "False" and "PermissionError" in denied.stderr, denied

    # the host client (a GPU machine without podman) dials a backend of the run's own over the socket
    bench = cli("bench", str(demo_model), "--modes", "remoting", "--client", "host", "--reps", "1", "--pp", "0",
                "--tg", "4", "--threads", "1", "--json", "--no-save")
    assert bench.returncode == 0, bench.stderr
    [row] = json.loads(bench.stdout)["rows"]
    assert (row["client"], row["transport"], row["backend"]) == ("host", "rpc-shm", "RPC") and row["tps_mean"] > 0
    assert backends.instances() == [], "the run's own backend is stopped with it"

    unit = cli("serve", "smollm2", "--transport", "rpc", "--generate", "quadlet")
    assert unit.returncode == 1 and "Traceback" not in unit.stderr and "--listen tcp" in unit.stderr, unit.stderr

    stopped = cli("machine", "stop", "--json")
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["state_name"] == "not_running"
    assert not rpc_server.is_backend_process(unix_backend.pid) and not sock.exists()


def chat(base: str, **extra: Any) -> dict[str, Any]:
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, **extra})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def instance_of(server_id: str) -> backends.Instance:
    labels = containers.connect().inspect(server_id)["Config"]["Labels"]
    assert labels["apirctl.transport"] == "rpc" and labels["apirctl.rpc-link"] == "unix"
    instance = backends.get(labels["apirctl.rpc-instance"])
    assert instance is not None and instance.container == server_id
    return instance


def gone(instance: backends.Instance) -> bool:
    return (not backends.is_backend_process(instance.pid) and not Path(instance.directory).exists()
            and backends.get(instance.id) is None)


@pytest.fixture
def names(podman: str) -> Iterator[list[str]]:
    made = [f"apirctl-test-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    yield made
    for name in made:
        with contextlib.suppress(Exception):
            engine.client().containers.get(name).remove(force=True)


def test_two_remoting_containers_each_on_a_backend_of_its_own(
    unix_backend: rpc_server.BackendRecord, llama_image: str, demo_model: Path, names: list[str]
) -> None:
    first, second = (serve.start(serve.options(str(demo_model), transport="rpc", port=free_port(), name=name))
                     for name in names)
    for started in (first, second):
        server = started.server
        assert server.transport_name == "rpc-shm", server
        instance = instance_of(server.id)
        assert instance.link == "shm" and backends.alive(instance) and instance.pid != unix_backend.pid
        directory = Path(instance.directory)
        assert directory.parent == dirs().runtime and stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(instance.socket.stat().st_mode) == 0o600 and not tcp_listeners_of(instance.pid)
        mounts = containers.connect().inspect(server.id)["Mounts"]
        assert {(m["Source"], m["Destination"], m["RW"]) for m in mounts if m["Destination"] == "/run/apirctl-rpc"} \
            == {(str(directory), "/run/apirctl-rpc", False)}
    assert instance_of(first.server.id).directory != instance_of(second.server.id).directory
    answers = [chat(s.server.base)["choices"][0]["message"]["content"] for s in (first, second)]
    assert all(answer.strip() for answer in answers), answers  # both answer at once
    for started in (first, second):  # across the container boundary, its backend maps its host buffers too
        assert b"shared host buffer 1: " in Path(instance_of(started.server.id).log).read_bytes()

    status = rpc_server.status()
    assert status.state == MachineState.SERVING and set(names) <= set(status.details["serving"].split(", "))
    lines = status.details["backends"]
    for name, started in zip(names, (first, second), strict=True):
        instance = instance_of(started.server.id)
        assert f"{name}: pid {instance.pid}, rpc-shm, {instance.socket}" in lines
    # on an NVIDIA host each backend's line carries the GPU memory its context holds (the driver's report
    # of the first backend's pid, given here: this machine has no GPU)
    first_pid = instance_of(first.server.id).pid
    with_gpu = rpc_server.own_backends(gpu={first_pid: 300 * 2**20, 1: 2**30})
    assert sum(f"pid {first_pid}," in line and line.endswith(", GPU memory 300 MiB") for line in with_gpu) == 1
    assert sum("GPU memory" in line for line in with_gpu) == 1
    printed = cli("machine", "status")
    assert printed.returncode == 1 and "backends:" in printed.stdout and names[0] in printed.stdout
    assert "gpu_sharing" not in rpc_server.status(gpu_memory=True).details  # no NVIDIA GPU here: no line

    ps = cli("ps", "--json")
    rows = {r["name"]: r for r in json.loads(ps.stdout)}
    assert all(rows[n]["transport"] == "rpc" and rows[n]["rpc_link"] == "shm" and rows[n]["health"] == "ok"
               for n in names), rows
    assert all(any(n in line and "rpc-shm" in line for line in cli("ps").stdout.splitlines()) for n in names)

    # bench runs remoting beside them, on a backend of its own, and says which link ran
    bench = cli("bench", str(demo_model), "--modes", "remoting", "--reps", "1", "--pp", "16", "--tg", "4",
                "--threads", "1", "--json", "--no-save", timeout=600)
    assert bench.returncode == 0, bench.stderr
    rows_run = json.loads(bench.stdout)["rows"]
    assert [r["transport"] for r in rows_run] == ["rpc-shm", "rpc-shm"] and all(r["tps_mean"] > 0 for r in rows_run)
    assert {i.container for i in backends.instances()} == {first.server.id, second.server.id}, "bench cleaned up"

    # stop removes the backend with the container: no process, socket or directory left
    one = instance_of(first.server.id)
    assert serve.stop(names[0]) == [names[0]]
    assert gone(one)

    # a container that dies leaves nothing behind at the next `ps`
    two = instance_of(second.server.id)
    engine.client().containers.get(second.server.id).kill()
    wait_for("the container to exit", lambda: containers.connect().inspect(second.server.id)["State"]["Status"]
             != "running", 30)
    assert cli("ps").returncode == 0
    assert gone(two)
    assert cli("stop", names[1]).returncode == 0
    assert [p.name for p in dirs().runtime.iterdir()] == ["rpc.sock"]  # only the host backend's socket


def host_server(build: Any, model: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The host build's llama-server on the model, on the CPU (native)."""
    port = free_port()
    args = [str(build.binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "512", "-t", "2", "-np", "1"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_for("llama-server", lambda: process.poll() is not None or serve.health(base) == "ok", 180)
    assert process.poll() is None, f"llama-server exited with {process.returncode}"
    return process, base


def greedy_tokens(base: str, client: httpx.Client | None = None) -> list[int]:
    reply = (client or httpx).post(f"{base}/completion", json=GREEDY, timeout=120)  # type: ignore[attr-defined]
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    assert len(tokens) == GREEDY["n_predict"]
    return list(tokens)


def test_a_network_none_container_answers_with_the_same_greedy_tokens_as_native(
    with_build: Any, podman: str, llama_image: str, demo_model: Path
) -> None:
    """A container with no network at all, on a backend of its own through the mounted socket (its
    API on a Unix socket too), generates what native CPU llama-server generates."""
    native, base = host_server(with_build, demo_model)
    try:
        expected = greedy_tokens(base)
    finally:
        native.kill()
        native.wait()

    # the container: no network at all; its API on a Unix socket in a folder of the test's own
    instance = rpc_server.start_own_backend("network-none")
    api_dir = Path(tempfile.mkdtemp(prefix="apirctl-api-"))
    name = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    try:
        plan = transport.with_backend(transport.local_rpc_plan(99), instance)
        spec = plan.apply(containers.ContainerSpec(
            image=llama_image, name=name, network_mode="none",
            command=["--model", "/models/demo.gguf", "--host", "/run/api/api.sock", "-c", "512", "-t", "2",
                     "-np", "1"],
            mounts=[containers.BindMount(source=demo_model, target="/models/demo.gguf"),
                    containers.BindMount(source=api_dir, target="/run/api", read_only=False)],
        ))
        assert spec.network_mode == "none" and "unix:/run/apirctl-rpc/rpc.sock" in spec.command
        api = containers.connect()
        container = api.create(spec)
        api.start(container, name)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(api_dir / "api.sock"))) as client:
            def healthy() -> bool:
                assert api.inspect(container)["State"]["Status"] == "running", api.logs(container, tail=20)
                with contextlib.suppress(httpx.HTTPError):
                    return client.get("http://container/health", timeout=2).status_code == 200
                return False

            wait_for("the network-none server", healthy, 180)
            assert api.inspect(container)["HostConfig"]["NetworkMode"] == "none"
            reply = client.post("http://container/v1/chat/completions", timeout=120,
                                json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].strip()
            tokens = greedy_tokens("http://container", client)
        assert backends.used_shm(Path(instance.log))
    finally:
        with contextlib.suppress(Exception):
            engine.client().containers.get(name).remove(force=True)
        backends.stop(instance)
        import shutil

        shutil.rmtree(api_dir, ignore_errors=True)
    assert tokens == expected


def test_serve_memory_limits_the_container_and_caps_what_its_backend_shares(
    unix_backend: rpc_server.BackendRecord, podman: str, llama_image: str, demo_model: Path, names: list[str]
) -> None:
    """`serve --memory` is the container's memory limit in Podman, and the same bytes are the shared-memory
    cap (GGML_RPC_SHM_CAP) of the backend of its own, read from that process's environment."""
    limit = 768 * 1024**2
    done = cli("serve", str(demo_model), "--transport", "rpc", "--memory", "768m", "--port", str(free_port()),
               "--name", names[0], "--json")
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)
    assert (server["transport"], server["rpc_link"]) == ("rpc", "shm"), server
    inspected = subprocess.run(["podman", "--remote", "--url", podman, "inspect", names[0], "--format",
                                "{{.HostConfig.Memory}}"], capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0 and inspected.stdout.strip() == str(limit), inspected.stderr
    instance = instance_of(server["id"])
    assert backends.alive(instance) and instance.pid != unix_backend.pid
    environ = Path(f"/proc/{instance.pid}/environ").read_bytes().split(b"\0")
    assert [v for v in environ if v.startswith(b"GGML_RPC_SHM_CAP=")] == [f"GGML_RPC_SHM_CAP={limit}".encode()]
    assert chat(server["url"].removesuffix("/v1"))["choices"][0]["message"]["content"].strip()  # it serves under it
    assert cli("stop", names[0]).returncode == 0
    assert gone(instance)
