"""`apirctl machine` on Linux: the real ggml-rpc-server as a background process owned by apirctl."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, RestartOptions
from apirctl.remoting import rpc_server
from tests.support.ports import free_port


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, APIRCTL_PLATFORM="linux"))


def listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            address, port_hex = cols[1].rsplit(":", 1)
            if cols[3] == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


def test_without_a_build_remoting_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("APIRCTL_LLAMA_BUILD", raising=False)
    assert rpc_server.status().state == MachineState.NOT_INSTALLED
    result = cli("machine", "status", "--json")
    assert result.returncode == 127, result.stderr
    data = json.loads(result.stdout)
    assert data["state_name"] == "not_installed" and "apirctl setup" in data["next_step"]
    restart = cli("machine", "restart", "--remoting")
    assert restart.returncode == 127 and "Traceback" not in restart.stderr
    assert "apirctl setup" in restart.stderr


@pytest.mark.integration
def test_not_running_until_restarted(with_build: object) -> None:
    result = cli("machine", "status", "--json")
    assert result.returncode == 11
    assert "machine restart --remoting" in json.loads(result.stdout)["next_step"]


@pytest.mark.integration
def test_restart_status_logs_stop(with_build: object) -> None:
    port = free_port()
    result = cli("machine", "restart", "--remoting", "--port", str(port), "--no-cache", "--json")
    assert result.returncode == 0, result.stderr
    record = rpc_server.read_record()
    assert record is not None and record.port == port and rpc_server.is_backend_process(record.pid)
    try:
        assert listeners(port) == {"0100007F"}, "bound to 127.0.0.1 and nothing else"
        status = cli("machine", "status", "--json")
        assert status.returncode == 0, status.stdout
        details = json.loads(status.stdout)["details"]
        assert details["port"] == port and details["pid"] == record.pid
        assert details["protocol"].startswith("7.") and "MiB free of" in details["memory"]
        assert details["device"]  # from the server's own "Devices:" lines
        assert all(0 < d["free"] <= d["total"] for d in details["memory_bytes"])
        logs = cli("machine", "logs", "--tail", "100")
        assert logs.returncode == 0 and "Starting RPC server" in logs.stdout and f"127.0.0.1:{port}" in logs.stdout
    finally:
        stopped = cli("machine", "stop", "--json")
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["state"] == 11
    assert not rpc_server.is_backend_process(record.pid)
    assert not listeners(port)
    assert cli("machine", "status").returncode == 11


@pytest.mark.integration
def test_port_taken_names_the_process_that_holds_it(with_build: object) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import socket,sys,time\n"
        "s=socket.create_server(('127.0.0.1',0)); print(s.getsockname()[1], flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        result = cli("machine", "restart", "--remoting", "--port", str(port))
        assert result.returncode == 1 and "Traceback" not in result.stderr
        first = result.stderr.splitlines()[0]
        assert f"port {port}" in first and f"pid {holder.pid}" in first and "python" in first.lower()
        assert rpc_server.read_record() is None, "a failed start leaves no backend behind"
        assert cli("machine", "status").returncode == 11
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.integration
def test_failed_restart_keeps_the_backend_that_ran(backend: int) -> None:
    steps: list[str] = []
    with pytest.raises(ApirctlError, match="unknown device"):
        rpc_server.restart(RestartOptions(remoting=True, port=backend, cache=False, device="NO_SUCH_DEVICE"),
                           progress=steps.append)
    assert [step.split(" (pid")[0] for step in steps] == [
        "stopping the running ggml-rpc-server", f"starting ggml-rpc-server on 127.0.0.1:{backend}",
        "starting the previous ggml-rpc-server again"]
    status = rpc_server.status()
    assert status.state == MachineState.READY and status.details["port"] == backend


@pytest.mark.integration
def test_restart_without_remoting_stops_the_backend(backend: int) -> None:
    record = rpc_server.read_record()
    assert record is not None
    assert rpc_server.restart(RestartOptions(remoting=False)).state == MachineState.NOT_RUNNING
    assert not rpc_server.is_backend_process(record.pid)


@pytest.mark.integration
def test_a_killed_backend_is_reported_down(backend: int) -> None:
    record = rpc_server.read_record()
    assert record is not None
    os.kill(record.pid, 9)
    deadline = time.monotonic() + 10
    while rpc_server.is_backend_process(record.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status = rpc_server.status()
    assert status.state == MachineState.NOT_RUNNING and "down" in status.summary
    assert status.next_step and "machine restart --remoting" in status.next_step
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", backend)) != 0
    back = rpc_server.restart(RestartOptions(remoting=True, port=backend, cache=False))
    assert back.state == MachineState.READY


@pytest.mark.integration
def test_a_client_that_vanishes_mid_reply_does_not_kill_the_backend(backend: int) -> None:
    """ggml-rpc-server dies of SIGPIPE when it answers a client that is gone (a killed container),
    unless it inherits SIGPIPE ignored: apirctl starts it that way."""
    import struct

    from apirctl.remoting import rpc_client

    record = rpc_server.read_record()
    assert record is not None
    hello = struct.pack("<BQ", int(rpc_client.Command.HELLO), rpc_client.CAPS_SIZE) + bytes(rpc_client.CAPS_SIZE)
    count = struct.pack("<BQ", int(rpc_client.Command.DEVICE_COUNT), 0)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", backend), timeout=5) as sock:
            sock.sendall(hello + count * 64)  # queued requests whose answers find the socket closed
    deadline = time.monotonic() + 10
    while True:
        status = rpc_server.status()
        if status.state == MachineState.READY:
            break
        assert rpc_server.is_backend_process(record.pid), "the backend died when its client vanished"
        assert time.monotonic() < deadline, status.summary
        time.sleep(0.1)
    assert rpc_server.is_backend_process(record.pid)


def test_only_servers_of_this_backend_count_as_its_users(monkeypatch: pytest.MonkeyPatch) -> None:
    from apirctl.podman import servers as podman_servers

    def server(name: str, **extra: object) -> podman_servers.Server:
        fields: dict = {"name": name, "id": name, "model": "m", "transport": "rpc", "url": "", "state": "running",
                        "health": "ok", "port": 1} | extra
        return podman_servers.Server(**fields)

    found = [server("local", rpc_target="10.0.2.2:50052"), server("other-port", rpc_target="10.0.2.2:50999"),
             server("remote", rpc_backends=["gpu-box:50052"], rpc_target="127.0.0.1:41000"),
             server("plain", transport="none"), server("stopped", state="exited", rpc_target="10.0.2.2:50052"),
             server("unlabelled")]
    monkeypatch.setattr(podman_servers, "list_servers", lambda *_a, **_k: found)
    assert [s.name for s in rpc_server.rpc_servers(50052)] == ["local", "unlabelled"]
    assert [s.name for s in rpc_server.rpc_servers()] == ["local", "other-port", "unlabelled"]


def test_a_container_on_a_backend_of_its_own_counts_only_in_the_home_that_started_the_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Homes may share one Podman (the suite's parallel workers do): a container on another home's own
    backend (unix or shm link, an instance this home has no record of) is not this home's user, so
    this home's backend is not "serving" because of it."""
    from apirctl.podman import servers as podman_servers
    from apirctl.remoting import backends

    def server(name: str, instance: str, link: str) -> podman_servers.Server:
        return podman_servers.Server(name=name, id=name, model="m", transport="rpc", url="", state="running",
                                     health="ok", port=1, rpc_instance=instance, rpc_link=link)

    found = [server("mine", "aaaa0001", "shm"), server("theirs", "bbbb0002", "unix")]
    monkeypatch.setattr(podman_servers, "list_servers", lambda *_a, **_k: found)
    ours = {"aaaa0001"}
    monkeypatch.setattr(backends, "get", lambda instance_id: object() if instance_id in ours else None)
    assert [s.name for s in rpc_server.rpc_servers()] == ["mine"]
    ours.clear()
    assert rpc_server.rpc_servers() == []


@pytest.mark.parametrize(("listen", "port", "says"), [
    ("tcp", 50052, None),
    ("tcp", 50060, "the backend moved from tcp port 50052 to 50060"),
    ("unix", 0, "the backend moved from tcp port 50052 to a Unix socket"),
], ids=["same-port", "other-port", "unix"])
def test_a_backend_restarted_elsewhere_leaves_its_servers_stale(monkeypatch: pytest.MonkeyPatch, listen: str,
                                                                port: int, says: str | None) -> None:
    """Servers labelled with an earlier instance are stale wherever the backend came back; those
    whose container dials a port the backend left are restarted in a new container."""
    from apirctl.podman import servers as podman_servers

    record = rpc_server.BackendRecord(pid=os.getpid(), listen=listen, port=port, instance="new", log="x",
                                      started_at=time.time(), binary="x",
                                      socket="/run/x/rpc.sock" if listen == "unix" else None)

    def server(name: str, **extra: object) -> podman_servers.Server:
        fields: dict = {"name": name, "id": name, "model": "m", "transport": "rpc", "url": "", "state": "running",
                        "health": "ok", "port": 1, "rpc_link": "tcp", "rpc_target": "10.0.2.2:50052",
                        "rpc_instance": "old", "started": time.time() - 60} | extra
        return podman_servers.Server(**fields)

    found = [server("stale"), server("dead", state="exited", exit_code=134),
             server("current", rpc_instance="new", rpc_target=f"10.0.2.2:{port}"),
             server("explicit", rpc_backends=["127.0.0.1:50052"], rpc_instance=""),
             server("unlabelled", rpc_instance="")]
    found.append(server("other-home", rpc_instance="elsewhere"))  # another home's backend, same Podman
    monkeypatch.setattr(podman_servers, "list_servers", lambda *_a, **_k: found)
    monkeypatch.setattr(rpc_server, "read_record", lambda: record)
    monkeypatch.setattr(rpc_server, "is_backend_process", lambda pid: pid == os.getpid())
    rpc_server.remember_instance("old")
    rpc_server.remember_instance("new")
    stale = rpc_server.stale_servers()
    assert [s.name for s in stale] == ["stale", "dead"]
    for s in stale:
        assert s.why.startswith("started against the previous backend, its connection is dead")
        assert s.why.endswith(f"{says}: restart it (in a new container)" if says else ": restart it"), s.why
    lines = rpc_server.server_lines(found, record)
    fix = f"{says}: restart this server (in a new container)" if says else "restart this server"
    assert f"stale: rpc backend restarted: {fix}" in lines
    assert f"dead: exited (code 134): rpc backend restarted: {fix}" in lines
    assert "current: serving (rpc-tcp)" in lines and not [line for line in lines if "explicit" in line]
    monkeypatch.setattr(rpc_server, "is_backend_process", lambda pid: False)
    assert rpc_server.stale_servers() == []  # nothing to restart against
    assert "stale: rpc backend down: it aborts at its next request; restart it after the backend" in \
        rpc_server.server_lines(found, record)
