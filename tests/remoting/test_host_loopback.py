"""Which door to the host's loopback the rpc transport picks, and the wiring each door gives.

The podman-machine case cannot run here (no VM): it runs against the faithful fake of `podman
machine` in tests/support/fakes (see its README: built from podman 5's recorded `machine list` / `machine
inspect` output; here with the Linux `qemu` provider, whose API socket gvproxy forwards to
$XDG_RUNTIME_DIR/podman/NAME-api.sock), with a real unix socket at that path answering the API's
`_ping` the way the forwarded socket does.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, MachineStatus
from apirctl.podman import containers, engine
from apirctl.remoting import hostloopback, transport
from apirctl.remoting.hostloopback import HostLoopback


def _which(*present: str):  # type: ignore[no-untyped-def]
    return lambda name: f"/usr/bin/{name}" if name in present else None


def _choose(*present: str, version: tuple[int, ...] = (5, 4, 2), requested: str = "auto") -> HostLoopback:
    local = engine.Endpoint(url="unix:///run/user/1000/podman/podman.sock", source="rootless")
    return hostloopback.choose(requested, endpoint=local, which=_which(*present), podman_version=lambda: version,
                               machine_sockets=set)


def _ready(port: int) -> MachineStatus:
    return MachineStatus(platform="linux", state=MachineState.READY, summary="ready", details={"port": port})


# --- the choice on this host ----------------------------------------------------------------------


def test_slirp4netns_when_installed_else_pasta() -> None:
    assert _choose("slirp4netns", "pasta").mode == "slirp4netns"
    assert _choose("slirp4netns").mode == "slirp4netns"
    door = _choose("pasta")
    assert door.mode == "pasta" and "slirp4netns is not" in door.why


def test_the_setting_overrides_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _choose("slirp4netns", "pasta", requested="pasta").mode == "pasta"
    monkeypatch.setenv("APIRCTL_RPC_NETWORK", "pasta")
    local = engine.Endpoint(url="unix:///run/podman/podman.sock", source="rootful")
    door = hostloopback.choose(endpoint=local, which=_which("slirp4netns", "pasta"), podman_version=lambda: (5, 0))
    assert (door.mode, door.why) == ("pasta", "rpc_network = pasta")


@pytest.mark.parametrize(("present", "requested", "message", "hint"), [
    ((), "auto", "needs slirp4netns or pasta", "apt-get install passt"),
    (("pasta",), "slirp4netns", "slirp4netns is not installed", "apt-get install slirp4netns"),
    (("slirp4netns",), "pasta", "pasta is not installed", "dnf install passt"),
    (("pasta",), "bogus", "unknown rpc network 'bogus'", None),
])
def test_a_missing_tool_is_a_one_line_error(present: tuple[str, ...], requested: str, message: str,
                                            hint: str | None) -> None:
    with pytest.raises(ApirctlError, match=message) as err:
        _choose(*present, requested=requested)
    assert hint is None or (err.value.hint and hint in err.value.hint)


def test_pasta_needs_podman_4_4() -> None:
    with pytest.raises(ApirctlError, match=r"podman 4\.3\.1 has no pasta network \(it needs 4\.4") as err:
        _choose("pasta", version=(4, 3, 1))
    assert err.value.hint and "slirp4netns" in err.value.hint
    assert _choose("pasta", version=(4, 4, 0)).mode == "pasta"
    with pytest.raises(ApirctlError, match="rpc_network is pasta, but podman 4.3.1") as err:
        _choose("slirp4netns", "pasta", version=(4, 3, 1), requested="pasta")
    assert err.value.hint and "rpc_network auto" in err.value.hint


@pytest.mark.parametrize(("url", "where"), [
    (None, "here"),
    ("unix:///run/user/1000/podman/podman.sock", "here"),
    ("unix:///run/user/1000/podman/podman-machine-default-api.sock", "machine"),
    ("unix:///tmp/other-api.sock", "here"),  # named like one, but no machine has it
    ("ssh://core@127.0.0.1:41235/run/user/1000/podman/podman.sock", "machine"),
    ("ssh://root@localhost:41235/run/podman/podman.sock", "machine"),
    ("ssh://me@gpu-box.lan/run/user/1000/podman/podman.sock", "remote"),
    ("tcp://127.0.0.1:8888", "here"),
    ("tcp://192.0.2.10:8888", "remote"),
])
def test_where_containers_run(url: str | None, where: str) -> None:
    sockets = {"/run/user/1000/podman/podman-machine-default-api.sock"}
    assert hostloopback.where_containers_run(url, lambda: sockets) == where


def test_a_podman_on_another_host_is_refused() -> None:
    remote = engine.Endpoint(url="ssh://me@gpu-box.lan/run/podman/podman.sock", source="CONTAINER_HOST")
    with pytest.raises(ApirctlError, match="on another host") as err:
        hostloopback.choose("auto", endpoint=remote, which=_which("slirp4netns"))
    assert err.value.hint and "CONTAINER_HOST" in err.value.hint


def test_auto_falls_back_to_the_cpu_when_no_door_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostloopback.shutil, "which", lambda name: None)
    monkeypatch.delenv("CONTAINER_HOST", raising=False)
    plan = transport.plan("auto", status=_ready(50100), platform_name="linux")
    assert plan.transport == "none" and plan.notice
    assert "backend is ready, but" in plan.notice and "apt-get install passt" in plan.notice
    with pytest.raises(ApirctlError, match="needs slirp4netns or pasta"):
        transport.plan("rpc", status=_ready(50100), platform_name="linux")


# --- the wiring of each door ----------------------------------------------------------------------


def test_slirp4netns_wiring() -> None:
    plan = transport.plan("rpc", ngl=99, status=_ready(50100), platform_name="linux",
                          loopback=HostLoopback(mode="slirp4netns"))
    assert (plan.network_mode, plan.network_options) == ("slirp4netns", {"slirp4netns": ["allow_host_loopback=true"]})
    assert plan.llama_args == ["--rpc", "10.0.2.2:50100", "--n-gpu-layers", "99"]


def test_pasta_forwards_only_the_backend_port_to_the_container_loopback() -> None:
    plan = transport.plan("rpc", ngl=99, status=_ready(50100), platform_name="linux",
                          loopback=HostLoopback(mode="pasta"))
    assert (plan.network_mode, plan.network_options) == ("pasta", {"pasta": ["-T", "50100"]})
    assert plan.llama_args == ["--rpc", "127.0.0.1:50100", "--n-gpu-layers", "99"]
    kwargs = plan.apply(containers.ContainerSpec(image="img")).create_kwargs()
    assert kwargs["network_mode"] == "pasta" and kwargs["network_options"] == {"pasta": ["-T", "50100"]}


def test_pasta_with_several_backends_forwards_each_port() -> None:
    door = HostLoopback(mode="pasta")
    plan = transport.remote_rpc_plan(["127.0.0.1:50053", "localhost:50052", "192.0.2.10:50052"], ngl=99,
                                     insecure_network=True, loopback=door)
    assert plan.llama_args[:2] == ["--rpc", "127.0.0.1:50053,127.0.0.1:50052,192.0.2.10:50052"]
    assert plan.network_options == {"pasta": ["-T", "50052,50053"]}


def test_network_backends_alone_need_no_door() -> None:
    plan = transport.remote_rpc_plan(["192.0.2.10:50052"], ngl=99, insecure_network=True,
                                     loopback=HostLoopback(mode="pasta"))
    assert plan.network_mode is None and plan.network_options == {}


def test_machine_containers_use_gvproxys_host_address_on_their_default_network() -> None:
    plan = transport.plan("rpc", ngl=99, status=_ready(50100), platform_name="linux",
                          loopback=HostLoopback(mode="machine"))
    assert plan.network_mode is None and plan.network_options == {}
    assert plan.llama_args[:2] == ["--rpc", "192.168.127.254:50100"]
    kwargs = plan.apply(containers.ContainerSpec(image="img")).create_kwargs()
    assert "network_mode" not in kwargs and "network_options" not in kwargs


# --- a Linux podman machine, with the fake podman -------------------------------------------------


@pytest.fixture
def linux_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The fake `podman` with a running qemu machine, and its API socket answering `_ping`."""
    from tests.support import fake_tools

    fake_tools.install(tmp_path / "fake-bin", monkeypatch)
    machine = {"name": "podman-machine-default", "provider": "qemu", "default": True, "state": "running",
               "created": "2026-11-01T10:00:00Z"}
    fake_tools.machine_state(tmp_path / "fake-state.json", monkeypatch, "qemu", [machine])
    runtime = Path(tempfile.mkdtemp(prefix="apirctl-xdg-"))  # short: a socket path has 108 bytes at most
    (runtime / "podman").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("CONTAINERS_MACHINE_PROVIDER", raising=False)
    path = runtime / "podman" / "podman-machine-default-api.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    server.settimeout(0.1)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(5)
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}"
    finally:
        stop.set()
        server.close()
        thread.join(timeout=5)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_linux_podman_machine_is_recognised_from_its_api_socket(linux_machine: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert hostloopback.machine_api_sockets() == {linux_machine.removeprefix("unix://")}
    monkeypatch.setenv("CONTAINER_HOST", linux_machine)
    plan = transport.plan("rpc", ngl=99, status=_ready(50100), platform_name="linux")
    assert plan.network_mode is None and plan.llama_args[:2] == ["--rpc", "192.168.127.254:50100"]
    door = hostloopback.choose()
    assert door.mode == "machine" and linux_machine in door.why


def test_a_local_socket_is_not_taken_for_the_machine(linux_machine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    local = engine.Endpoint(url="unix:///run/user/1000/podman/podman.sock", source="rootless")
    assert hostloopback.choose("auto", endpoint=local, which=_which("slirp4netns")).mode == "slirp4netns"
    monkeypatch.delenv("CONTAINER_HOST", raising=False)  # no CONTAINER_HOST: containers run here
    assert hostloopback.choose("slirp4netns", which=_which("slirp4netns")).mode == "slirp4netns"
