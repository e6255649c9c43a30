"""Transports: the wiring each one adds, how `auto` decides, and rpc for real over slirp4netns and pasta."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from apirctl import engine, transport
from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, MachineStatus


def _status(state: MachineState, **details: object) -> MachineStatus:
    return MachineStatus(platform="linux", state=state, summary=f"state {state.name}",
                         next_step="run `apirctl machine restart --remoting`", details=dict(details))


def test_none_adds_nothing() -> None:
    plan = transport.plan("none")
    spec = engine.ContainerSpec(image="img", command=["--port", "8000"])
    assert plan.apply(spec) == spec and not plan.remoting


def test_rpc_reaches_the_host_loopback_through_slirp4netns() -> None:
    plan = transport.plan("rpc", ngl=99, status=_status(MachineState.READY, port=50100), platform_name="linux")
    assert plan.network_mode == "slirp4netns"
    assert plan.network_options == {"slirp4netns": ["allow_host_loopback=true"]}
    assert plan.llama_args == ["--rpc", "10.0.2.2:50100", "--n-gpu-layers", "99"]
    assert not plan.devices and not plan.security_opt


def test_virtgpu_gets_the_gpu_device_unlabelled() -> None:
    status = _status(MachineState.READY)
    plan = transport.plan("virtgpu", ngl=999, status=status, platform_name="darwin")
    assert (plan.devices, plan.security_opt) == (["/dev/dri"], ["label=disable"])
    spec = plan.apply(engine.ContainerSpec(image="img", command=["--model", "/models/m.gguf"]))
    assert spec.command == ["--model", "/models/m.gguf", "--n-gpu-layers", "999"]
    assert spec.create_kwargs()["devices"] == ["/dev/dri"]


@pytest.mark.parametrize(("platform_name", "expected"), [("linux", "rpc"), ("darwin", "virtgpu")])
def test_auto_picks_the_platforms_remoting_when_ready(platform_name: str, expected: str) -> None:
    for state in (MachineState.READY, MachineState.SERVING):
        plan = transport.plan("auto", status=_status(state), platform_name=platform_name)
        assert plan.transport == expected and plan.requested == "auto" and plan.notice is None


def test_auto_falls_back_to_cpu_with_a_notice() -> None:
    plan = transport.plan("auto", status=_status(MachineState.NOT_RUNNING), platform_name="linux")
    assert plan.transport == "none"
    assert plan.notice and "NOT_RUNNING" in plan.notice and "apirctl machine restart --remoting" in plan.notice


def test_explicit_remoting_that_is_not_ready_is_an_error() -> None:
    with pytest.raises(ApirctlError, match="rpc transport is not ready") as err:
        transport.plan("rpc", status=_status(MachineState.NOT_RUNNING), platform_name="linux")
    assert err.value.hint and "machine restart" in err.value.hint


@pytest.mark.parametrize(("name", "platform_name", "message"), [
    ("virtgpu", "linux", "macOS"), ("rpc", "darwin", "Linux"), ("cuda", "linux", "unknown transport"),
])
def test_transport_platform_mismatch(name: str, platform_name: str, message: str) -> None:
    with pytest.raises(ApirctlError, match=message):
        transport.plan(name, status=_status(MachineState.READY), platform_name=platform_name)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _no_pasta_podman() -> str | None:
    """Why a pasta container cannot run here, or None."""
    from apirctl import hostloopback

    try:
        version = engine.podman_version()
    except Exception as exc:  # noqa: BLE001 - any failure means: no podman to test with
        return f"no usable podman ({exc})"
    if version < hostloopback.PASTA_MIN_PODMAN:
        return f"podman {'.'.join(map(str, version))} has no pasta network (4.4 or newer)"
    return None


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["slirp4netns", "pasta"])
def test_rpc_plan_runs_llama_bench_on_a_host_rpc_server(llama_build, llama_image: str, demo_model: Path,  # type: ignore[no-untyped-def]
                                                        mode: str) -> None:
    """The rpc wiring for real: a container reaches ggml-rpc-server bound to the host's 127.0.0.1
    through its network's host-loopback door."""
    from apirctl.hostloopback import HostLoopback

    if mode == "pasta" and (why := _no_pasta_podman()):
        pytest.skip(why)
    door = HostLoopback(mode=mode)  # type: ignore[arg-type]
    port = _free_port()
    server = subprocess.Popen([str(llama_build.binary("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        plan = transport.rpc_plan(port, ngl=99, loopback=door)
        spec = plan.apply(engine.ContainerSpec(
            image=llama_image, name=f"apirctl-test-{uuid.uuid4().hex[:8]}", entrypoint=["/app/bin/llama-bench"],
            command=["-m", "/models/demo.gguf", "-p", "8", "-n", "2", "-r", "1", "-o", "json"],
            mounts=[engine.BindMount(source=demo_model, target="/models/demo.gguf")],
        ))
        result = engine.run_once(spec, timeout=300)
        assert result.exit_code == 0, result.output[-2000:]
        assert door.endpoint(port) in result.output  # llama-bench reports the RPC device it used
    finally:
        server.terminate()
        server.wait(timeout=30)
