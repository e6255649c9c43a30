"""`serve --gpu-device`: it implies the gpu transport and refuses to be mixed with another one."""

from __future__ import annotations

import pytest

from apirctl import serve
from apirctl.errors import ApirctlError


def test_gpu_device_implies_the_gpu_transport() -> None:
    opts = serve.options("smollm2", gpu_devices=["nvidia.com/gpu=0"])
    assert opts.transport == "gpu" and opts.gpu_devices == ["nvidia.com/gpu=0"]
    assert serve.options("smollm2", gpu_devices=["/dev/dri/renderD128"], transport="gpu").transport == "gpu"


@pytest.mark.parametrize(("flags", "message"), [
    ({"gpu_devices": ["nvidia.com/gpu=0"], "transport": "rpc"}, "--gpu-device uses the gpu transport"),
    ({"gpu_devices": ["nvidia.com/gpu=0"], "rpc_backends": ["127.0.0.1:50052"]}, "two different transports"),
])
def test_gpu_device_with_another_transport_is_refused(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ApirctlError, match=message) as err:
        serve.options("smollm2", **flags)
    assert err.value.hint or "--gpu-device uses" in err.value.message


def test_rpc_backend_options_are_unchanged() -> None:
    opts = serve.options("smollm2", rpc_backends=["10.0.0.2:50052"], via_ssh="me@gpu-host")
    assert opts.transport == "rpc" and opts.via_ssh == "me@gpu-host" and not opts.gpu_devices
