"""`auto`'s decision table and the passthrough offer, each combination of what a host has."""

from __future__ import annotations

import itertools

import pytest

from apirctl.gpu import (
    Blocked,
    CdiDevice,
    CdiInventory,
    DeviceFiles,
    Passthrough,
    Remoting,
    RenderNode,
    backend_on_cpu,
    decide,
    device_names,
)
from apirctl.gpu import find_passthrough as offer

NVIDIA = CdiDevice(kind="nvidia.com/gpu", name="all", spec="/etc/cdi/nvidia.yaml")
AMD = CdiDevice(kind="amd.com/gpu", name="0", spec="/etc/cdi/amd.json")
TEST_DEV = CdiDevice(kind="example.com/dev", name="null", spec="/etc/cdi/test.json")
NODE = RenderNode(path="/dev/dri/renderD128", driver="i915")
LOCKED = NODE.model_copy(update={"accessible": False})


def _inv(*devs: CdiDevice) -> CdiInventory:
    return CdiInventory(devices=list(devs))


@pytest.mark.parametrize(
    ("cdi_devs", "files", "backends", "expected"),
    [
        ((NVIDIA,), DeviceFiles(nvidia=True), {"cuda"}, (["nvidia.com/gpu=all"], "cuda")),
        ((NVIDIA,), DeviceFiles(nvidia=True), {"cuda", "vulkan"}, (["nvidia.com/gpu=all"], "cuda")),
        ((NVIDIA,), DeviceFiles(nvidia=True), {"vulkan"}, (["nvidia.com/gpu=all"], "vulkan")),
        ((NVIDIA,), DeviceFiles(nvidia=True), set(), "no apirctl image has a GPU backend"),
        ((), DeviceFiles(nvidia=True), {"cuda"}, "nvidia-ctk cdi generate"),
        ((), DeviceFiles(nvidia=True, render_nodes=[NODE]), {"cuda"}, "nvidia-ctk cdi generate"),
        ((), DeviceFiles(nvidia=True, render_nodes=[NODE]), {"vulkan"}, (["/dev/dri/renderD128"], "vulkan")),
        ((AMD,), DeviceFiles(), {"vulkan"}, (["amd.com/gpu=0"], "vulkan")),
        ((AMD,), DeviceFiles(), {"cuda"}, "apirctl setup --vulkan"),
        ((), DeviceFiles(render_nodes=[NODE]), {"vulkan"}, (["/dev/dri/renderD128"], "vulkan")),
        ((), DeviceFiles(render_nodes=[NODE]), set(), "apirctl setup --vulkan"),
        ((), DeviceFiles(render_nodes=[LOCKED]), {"vulkan"}, "usermod -aG render"),
        ((), DeviceFiles(render_nodes=[RenderNode(path="/dev/dri/renderD128", driver="virtio_gpu")]), {"vulkan"},
         "no GPU device on this host"),
        ((TEST_DEV,), DeviceFiles(), {"cuda", "vulkan"}, "no GPU device on this host"),  # not a GPU kind
        ((), DeviceFiles(), {"cuda", "vulkan"}, "no GPU device on this host"),
    ],
)
def test_the_offer(cdi_devs: tuple[CdiDevice, ...], files: DeviceFiles, backends: set[str],
                   expected: tuple[list[str], str] | str) -> None:
    got = offer(_inv(*cdi_devs), files, backends)
    if isinstance(expected, str):
        assert isinstance(got, Blocked)
        assert expected in got.reason + " " + (got.hint or "")
    else:
        assert isinstance(got, Passthrough) and (got.devices, got.backend) == expected


def test_no_offer_when_the_engine_runs_in_a_vm() -> None:
    got = offer(_inv(NVIDIA), DeviceFiles(nvidia=True), {"cuda"}, engine_in_vm=True)
    assert isinstance(got, Blocked) and "virtual machine" in got.reason


def test_requested_devices() -> None:
    inv = _inv(TEST_DEV, NVIDIA)
    got = offer(inv, DeviceFiles(), set(), requested=["example.com/dev=null"], own_image=True)
    assert isinstance(got, Passthrough) and got.devices == ["example.com/dev=null"] and got.backend is None
    missing = offer(inv, DeviceFiles(), {"cuda"}, requested=["example.com/dev=absent"])
    assert isinstance(missing, Blocked) and "no CDI device example.com/dev=absent" in missing.reason
    assert "example.com/dev" in missing.reason  # which specs were found
    no_spec = offer(_inv(), DeviceFiles(), {"cuda"}, requested=["nvidia.com/gpu=all"])
    assert isinstance(no_spec, Blocked) and "nvidia-ctk cdi generate" in (no_spec.hint or "")
    assert "no CDI spec found" in no_spec.reason
    cuda = offer(inv, DeviceFiles(), {"cuda", "vulkan"}, requested=["nvidia.com/gpu=all"])
    assert isinstance(cuda, Passthrough) and cuda.backend == "cuda"
    no_image = offer(inv, DeviceFiles(), set(), requested=["example.com/dev=null"])
    assert isinstance(no_image, Blocked) and "apirctl setup --vulkan" in (no_image.hint or "")
    bad = offer(inv, DeviceFiles(), {"vulkan"}, requested=["renderD128"])
    assert isinstance(bad, Blocked) and "neither a CDI device name" in bad.reason
    absent = offer(inv, DeviceFiles(), {"vulkan"}, requested=["/dev/dri/renderD199"])
    assert isinstance(absent, Blocked) and "no device /dev/dri/renderD199" in absent.reason
    path = offer(inv, DeviceFiles(), {"vulkan"}, requested=["/dev/null"])
    assert isinstance(path, Passthrough) and path.backend == "vulkan"


GPU = Passthrough(devices=["nvidia.com/gpu=all"], backend="cuda", what="NVIDIA GPU (CDI nvidia.com/gpu=all)")
NO_GPU = Blocked(reason="no GPU device on this host")
NEEDS_CDI = Blocked(reason="an NVIDIA GPU is present but ...", hint="sudo nvidia-ctk cdi generate")
READY = {"ready": True}
NOT_READY = {"ready": False, "why": "the RPC backend is not running", "step": "apirctl machine restart --remoting"}
UNREACHABLE = {"ready": True, "unreachable": "no container network reaches it", "unreachable_hint": "install passt"}
ON_CPU = {"ready": True, "device": "CPU: AMD EPYC (24105 MiB, 24105 MiB free)"}
ON_GPU = {"ready": True, "device": "CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80514 MiB free)"}


@pytest.mark.parametrize(
    ("platform", "offer_", "remoting", "transport", "words"),
    [
        # every combination on Linux: passthrough x remoting state
        *[("linux", GPU, r, "gpu", ["GPU passthrough", "nvidia.com/gpu=all"]) for r in (READY, NOT_READY, UNREACHABLE)],
        ("linux", NO_GPU, READY, "rpc", ["rpc remoting", "no passthrough: no GPU device"]),
        ("linux", NEEDS_CDI, READY, "rpc", ["rpc remoting", "NVIDIA GPU is present"]),
        ("linux", NO_GPU, NOT_READY, "none", ["container's CPU", "not ready (the RPC backend is not running)",
                                               "apirctl machine restart --remoting"]),
        ("linux", NEEDS_CDI, NOT_READY, "none", ["container's CPU", "nvidia-ctk cdi generate or apirctl machine"]),
        ("linux", NO_GPU, UNREACHABLE, "none", ["container's CPU", "backend is ready, but no container network",
                                                 "install passt"]),
        # a backend on the CPU is the container's own cores plus a transport: never chosen
        ("linux", NO_GPU, ON_CPU, "none", ["container's CPU", "computes on the CPU too (CPU: AMD EPYC)",
                                            "`--transport rpc` uses it anyway"]),
        ("linux", GPU, ON_CPU, "gpu", ["GPU passthrough"]),
        ("linux", NO_GPU, ON_GPU, "rpc", ["rpc remoting"]),
        # macOS: never passthrough (the VM), virtgpu when ready
        ("darwin", GPU, READY, "virtgpu", ["virtgpu remoting", "podman machine's VM"]),
        ("darwin", NO_GPU, NOT_READY, "none", ["container's CPU", "podman machine's VM"]),
    ],
)
def test_decision_table(platform: str, offer_: Passthrough | Blocked, remoting: dict[str, object], transport: str,
                        words: list[str]) -> None:
    kind = "virtgpu" if platform == "darwin" else "rpc"
    choice = decide(platform, offer_, Remoting(kind=kind, **remoting))  # type: ignore[arg-type]
    assert choice.transport == transport
    assert "\n" not in choice.reason
    for word in words:
        assert word in choice.reason


def test_every_combination_yields_one_line_and_the_fastest_path() -> None:
    order = {"gpu": 0, "rpc": 1, "none": 2}
    for offer_, remoting in itertools.product((GPU, NO_GPU, NEEDS_CDI),
                                              (READY, NOT_READY, UNREACHABLE, ON_CPU, ON_GPU)):
        choice = decide("linux", offer_, Remoting(kind="rpc", **remoting))  # type: ignore[arg-type]
        possible = ["none"]
        if remoting is READY or remoting is ON_GPU:
            possible.append("rpc")
        if isinstance(offer_, Passthrough):
            possible.append("gpu")
        assert choice.transport == min(possible, key=order.__getitem__), (offer_, remoting)
        assert choice.reason and "\n" not in choice.reason


@pytest.mark.parametrize(
    ("device", "on_cpu"),
    [
        ("CPU: AMD EPYC (24105 MiB, 24105 MiB free)", True),
        ("CPU: a, CPU1: b", True),
        ("CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80514 MiB free)", False),
        ("CPU: AMD EPYC (1 MiB), Vulkan0: AMD Radeon (2 MiB)", False),  # a GPU among them: remoting can use it
        ("", False),  # not known (a backend that has not logged its devices): remoting keeps its chance
        ("server default", False),
    ],
)
def test_a_backend_is_on_the_cpu_only_when_every_device_is_a_cpu(device: str, on_cpu: bool) -> None:
    assert backend_on_cpu(device) is on_cpu
    assert "MiB" not in device_names(device)
    assert Remoting(kind="rpc", ready=True, device=device).on_cpu is on_cpu
