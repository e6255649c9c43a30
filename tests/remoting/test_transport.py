"""Transports: the wiring each one adds, how `auto` decides, and rpc for real over slirp4netns and pasta."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from apirctl import gpu
from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, MachineStatus
from apirctl.podman import containers, engine
from apirctl.remoting import apir_hosts, transport
from tests.support.ports import free_port


def _status(state: MachineState, **details: object) -> MachineStatus:
    return MachineStatus(platform="linux", state=state, summary=f"state {state.name}",
                         next_step="run `apirctl machine restart --remoting`", details=dict(details))


def test_none_adds_nothing() -> None:
    plan = transport.plan("none")
    spec = containers.ContainerSpec(image="img", command=["--port", "8000"])
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
    spec = plan.apply(containers.ContainerSpec(image="img", command=["--model", "/models/m.gguf"]))
    assert spec.command == ["--model", "/models/m.gguf", "--n-gpu-layers", "999"]
    assert spec.create_kwargs()["devices"] == ["/dev/dri"]
    assert plan.image is None  # no bundle image named: serve runs its default image


def test_virtgpu_runs_the_image_the_machine_status_names() -> None:
    status = _status(MachineState.READY, image="quay.io/example/llama-cpp-apir:1")  # the active bundle's
    assert transport.plan("virtgpu", status=status, platform_name="darwin").image == "quay.io/example/llama-cpp-apir:1"


def _fake_build(folder: Path, *, host: bool = True, frontend: bool = True) -> Path:
    """A build directory with the files the Linux APIR plan looks for (empty files: nothing runs)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    names = ["llama-server", "libggml-cpu.so", "libggml-virtgpu-backend.so"]
    names += ["apir-host"] if host else []
    names += ["libggml-virtgpu.so"] if frontend else []
    for name in names:
        (bin_dir / name).write_bytes(b"")
    return folder


def test_virtgpu_on_linux_is_an_apir_host_of_the_containers_own(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No device, no network: the socket directory mounted read-only and the variable pointing at it;
    the macOS plan (device, bundle image) is not used, and no machine status is asked."""
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(_fake_build(tmp_path / "build")))
    plan = transport.plan("virtgpu", ngl=99, platform_name="linux", status=_status(MachineState.NOT_RUNNING))
    assert (plan.transport, plan.apir_link, plan.needs_apir_host) == ("virtgpu", "socket", True)
    assert not plan.devices and not plan.security_opt and plan.network_mode is None and plan.image is None
    assert plan.environment == {"GGML_VIRTGPU_SOCKET": "/run/apirctl-apir/apir.sock"}
    host = apir_hosts.Host(id="0badcafe", directory=str(tmp_path / "apir-0badcafe"), log="x.log", started_at=0.0)
    wired = transport.with_apir_host(plan, host)
    assert not wired.needs_apir_host and wired.apir_host == "0badcafe"
    spec = wired.apply(containers.ContainerSpec(image="img", command=["--model", "/models/m.gguf"]))
    assert spec.command == ["--model", "/models/m.gguf", "--n-gpu-layers", "99"]
    assert [(str(m.source), m.target, m.read_only) for m in spec.mounts] == \
        [(str(tmp_path / "apir-0badcafe"), "/run/apirctl-apir", True)]
    assert spec.environment["GGML_VIRTGPU_SOCKET"] == "/run/apirctl-apir/apir.sock"


@pytest.mark.parametrize(("host", "frontend", "missing"), [(False, True, "no apir-host"),
                                                           (True, False, "no ggml-virtgpu frontend")])
def test_virtgpu_on_linux_without_the_pieces_says_what_to_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                host: bool, frontend: bool, missing: str) -> None:
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(_fake_build(tmp_path / "build", host=host, frontend=frontend)))
    with pytest.raises(ApirctlError, match=missing) as err:
        transport.plan("virtgpu", platform_name="linux")
    assert err.value.hint == "run `apirctl setup`"


NO_GPU = gpu.Blocked(reason="no GPU device on this host")
GPU = gpu.Passthrough(devices=["nvidia.com/gpu=all"], backend="cuda", what="NVIDIA GPU (CDI nvidia.com/gpu=all)")


@pytest.mark.parametrize(("platform_name", "expected"), [("linux", "rpc"), ("darwin", "virtgpu")])
def test_auto_picks_the_platforms_remoting_when_ready(platform_name: str, expected: str) -> None:
    for state in (MachineState.READY, MachineState.SERVING):
        plan = transport.plan("auto", status=_status(state), platform_name=platform_name, offer=NO_GPU)
        assert plan.transport == expected and plan.requested == "auto"
        assert plan.notice and plan.notice.startswith(f"{expected} remoting")


def test_auto_falls_back_to_cpu_with_a_notice() -> None:
    plan = transport.plan("auto", status=_status(MachineState.NOT_RUNNING), platform_name="linux", offer=NO_GPU)
    assert plan.transport == "none"
    assert plan.notice and "NOT_RUNNING" in plan.notice and "apirctl machine restart --remoting" in plan.notice


def test_auto_prefers_passthrough_to_ready_remoting() -> None:
    plan = transport.plan("auto", status=_status(MachineState.READY), platform_name="linux", offer=GPU)
    assert (plan.transport, plan.devices, plan.image_backend) == ("gpu", ["nvidia.com/gpu=all"], "cuda")
    assert plan.notice == "GPU passthrough: NVIDIA GPU (CDI nvidia.com/gpu=all) handed to the container"


def test_gpu_hands_over_the_devices_unlabelled() -> None:
    plan = transport.plan("gpu", ngl=40, platform_name="linux", offer=GPU)
    spec = plan.apply(containers.ContainerSpec(image="img", command=["--model", "/models/m.gguf"]))
    assert spec.devices == ["nvidia.com/gpu=all"] and spec.security_opt == ["label=disable"]
    assert spec.command == ["--model", "/models/m.gguf", "--n-gpu-layers", "40"]
    assert plan.notice is None and plan.remoting


def test_gpu_that_cannot_be_given_is_an_error_with_the_fix() -> None:
    blocked = gpu.Blocked(reason="an NVIDIA GPU is present but ...", hint=gpu.NVIDIA_CDI_FIX)
    with pytest.raises(ApirctlError, match="cannot give the container the GPU: an NVIDIA GPU") as err:
        transport.plan("gpu", platform_name="linux", offer=blocked)
    assert err.value.hint and "nvidia-ctk cdi generate" in err.value.hint
    with pytest.raises(ApirctlError, match="podman machine's VM"):
        transport.plan("gpu", platform_name="darwin", offer=GPU)


def test_explicit_remoting_that_is_not_ready_is_an_error() -> None:
    with pytest.raises(ApirctlError, match="rpc transport is not ready") as err:
        transport.plan("rpc", status=_status(MachineState.NOT_RUNNING), platform_name="linux")
    assert err.value.hint and "machine restart" in err.value.hint


@pytest.mark.parametrize(("name", "platform_name", "message"), [
    ("rpc", "darwin", "Linux"), ("cuda", "linux", "unknown transport"),
])
def test_transport_platform_mismatch(name: str, platform_name: str, message: str) -> None:
    with pytest.raises(ApirctlError, match=message):
        transport.plan(name, status=_status(MachineState.READY), platform_name=platform_name)


def _no_pasta_podman() -> str | None:
    """Why a pasta container cannot run here, or None."""
    from apirctl.remoting import hostloopback

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
    from apirctl.remoting.hostloopback import HostLoopback

    if mode == "pasta" and (why := _no_pasta_podman()):
        pytest.skip(why)
    door = HostLoopback(mode=mode)  # type: ignore[arg-type]
    port = free_port()
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
        spec = plan.apply(containers.ContainerSpec(
            image=llama_image, name=f"apirctl-test-{uuid.uuid4().hex[:8]}", entrypoint=["/app/bin/llama-bench"],
            command=["-m", "/models/demo.gguf", "-p", "8", "-n", "2", "-r", "1", "-o", "json"],
            mounts=[containers.BindMount(source=demo_model, target="/models/demo.gguf")],
        ))
        result = containers.run_once(spec, timeout=300)
        assert result.exit_code == 0, result.output[-2000:]
        assert door.endpoint(port) in result.output  # llama-bench reports the RPC device it used
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_rpc_on_a_unix_socket_host_gets_a_backend_of_its_own_and_no_network() -> None:
    from apirctl.remoting import backends

    ready = _status(MachineState.READY, listen="unix", socket="/run/x/rpc.sock", port=50100)
    for requested in ("rpc", "auto"):
        plan = transport.plan(requested, ngl=99, status=ready, platform_name="linux")
        assert plan.transport == "rpc" and plan.rpc_link == "unix" and plan.needs_backend
        assert plan.llama_args == ["--rpc", "unix:/run/apirctl-rpc/rpc.sock", "--n-gpu-layers", "99"]
        assert plan.network_mode is None and not plan.network_options  # no door to the host is needed
    instance = backends.Instance(id="0123abcd", pid=1, directory="/run/x/rpc-0123abcd", log="l", started_at=0)
    wired = transport.with_backend(plan, instance)
    assert not wired.needs_backend and wired.rpc_instance == "0123abcd"
    spec = wired.apply(containers.ContainerSpec(image="img", network_mode="none"))
    assert spec.network_mode == "none"
    assert [(str(m.source), m.target, m.read_only) for m in spec.mounts] == [
        ("/run/x/rpc-0123abcd", "/run/apirctl-rpc", True)]


def test_rpc_on_a_tcp_host_keeps_the_door_and_labels_its_instance() -> None:
    ready = _status(MachineState.READY, listen="tcp", port=50100, instance="feedf00d")
    plan = transport.plan("rpc", ngl=99, status=ready, platform_name="linux",
                          loopback=transport.hostloopback.HostLoopback(mode="slirp4netns"))
    assert (plan.rpc_link, plan.rpc_instance, plan.needs_backend) == ("tcp", "feedf00d", False)
    assert plan.llama_args[:2] == ["--rpc", "10.0.2.2:50100"] and not plan.mounts
