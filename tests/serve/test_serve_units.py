"""serve's pure parts: URLs, ports, labels, the llama-server command line, options from settings."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from apirctl import serve
from apirctl.cli.serve import _uptime
from apirctl.errors import ApirctlError
from apirctl.remoting import transport
from apirctl.serve import inputs, spec, starting
from tests.support.podman_double import MemoryPodman
from tests.support.ports import free_port


@pytest.mark.parametrize(("host_ip", "url"), [
    ("127.0.0.1", "http://127.0.0.1:1234/v1"),
    ("0.0.0.0", "http://127.0.0.1:1234/v1"),  # published everywhere, reached on loopback
    ("::", "http://[::1]:1234/v1"),
    ("192.168.1.5", "http://192.168.1.5:1234/v1"),
])
def test_openai_base_url(host_ip: str, url: str) -> None:
    assert inputs.server_url(host_ip, 1234) == url


@pytest.mark.parametrize("port", [0, 80, 1024, 65536])
def test_privileged_or_impossible_ports_are_refused(port: int) -> None:
    with pytest.raises(ApirctlError, match=f"port {port} is not allowed"):
        serve.check_port("127.0.0.1", port)


def test_host_ip_must_be_an_address() -> None:
    with pytest.raises(ApirctlError, match="not an IP address"):
        serve.check_port("localhost", 5000)


def test_free_port_passes() -> None:
    port = free_port()
    serve.check_port("127.0.0.1", port)


def test_labels_for_podman_ai_lab_and_ours(tmp_path: Path) -> None:
    opts = serve.ServeOptions(model="m", port=4321)
    labels = spec.labels_for(opts, transport.plan("none"), tmp_path / "m.gguf", "demo")
    assert labels["api"] == "http://127.0.0.1:4321/v1"
    assert json.loads(labels["ai-lab-inference-server"]) == [str(tmp_path)]
    assert (labels["apirctl.model"], labels["apirctl.transport"], labels["llama-cpp.apir"]) == ("demo", "none", "false")
    again = spec.labels_for(opts, transport.plan("none"), tmp_path / "m.gguf", "demo")
    assert labels["trackingId"] != again["trackingId"]  # one per server, as the extension makes them
    virtgpu = spec.labels_for(opts, transport.virtgpu_plan(999), tmp_path / "m.gguf", "demo")
    assert virtgpu["llama-cpp.apir"] == "true" and virtgpu["gpu"] == "llama.cpp API Remoting"
    assert labels["apirctl.model-kind"] == "chat"
    embedding = spec.labels_for(opts, transport.plan("none"), tmp_path / "m.gguf", "demo", "embedding")
    assert embedding["apirctl.model-kind"] == "embedding"


def test_llama_server_command_line() -> None:
    opts = serve.ServeOptions(model="m", ctx_size=2048, threads=3, api_key="k")
    command = spec._llama_command(opts, "file.gguf", "demo")
    assert command[:4] == ["--model", "/models/file.gguf", "--host", "0.0.0.0"]
    assert command[command.index("--port") + 1] == "8000" and command[command.index("--ctx-size") + 1] == "2048"
    assert command[-5:] == ["--threads", "3", "--api-key", "k", "--metrics"]
    assert "--metrics" not in spec._llama_command(opts.model_copy(update={"metrics": False}), "file.gguf", "demo")


def test_options_take_settings_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_PORT", "2345")
    monkeypatch.setenv("APIRCTL_HEALTH_TIMEOUT", "12")
    opts = serve.options("m", ctx_size=None, name="x", keep=True)
    assert (opts.port, opts.timeout, opts.name, opts.keep, opts.ctx_size) == (2345, 12.0, "x", True, 4096)
    assert serve.options("m", port=3456).port == 3456
    with pytest.raises(ApirctlError, match="port"):
        serve.options("m", port=80)


def test_uptime_reads_like_podman() -> None:
    now = datetime.now(timezone.utc)
    assert _uptime(now - timedelta(seconds=12), "running") == "12s"
    assert _uptime(now - timedelta(minutes=5, seconds=3), "running") == "5m3s"
    assert _uptime(now - timedelta(hours=2, minutes=13), "running") == "2h13m"
    assert _uptime(now - timedelta(days=3, hours=1), "running") == "3d1h"
    assert _uptime(now, "exited") == "-"


class _BusyPodman(MemoryPodman):
    """Podman 4.3 under load: a removal is refused while the container is still being stopped."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    def remove(self, container_id: str, timeout: int = 10) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise ApirctlError("container is being stopped: cannot remove")
        super().remove(container_id, timeout)


def test_a_failed_container_is_removed_after_podman_refused_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starting.time, "sleep", lambda _s: None)
    api = _BusyPodman(refusals=6)  # 4 tries were given up on before; it took longer than that in CI
    cid = api.add("busy", {}, state="stopping")
    starting._remove_failed(api, cid)
    assert not api.exists("containers", cid)


def test_removal_gives_up_when_podman_keeps_refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(starting.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(starting.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    api = _BusyPodman(refusals=10**6)
    cid = api.add("stuck", {}, state="stopping")
    starting._remove_failed(api, cid, patience=5.0)  # returns: the serve error matters more
    assert api.exists("containers", cid) and clock[0] <= 5.0
