"""The serve path's shape: from the options to the container spec, control enters serve/starting.py a
few times only (provisioning is one step elsewhere, the spec is built in one place), and a failed start
releases what provisioning made.

The call is followed with `sys.setprofile` through the real code, with a Podman double that records
the spec it is asked to create and refuses it (the path ends there).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from apirctl import serve
from apirctl.errors import ApirctlError
from apirctl.podman import containers
from apirctl.remoting import backends, rpc_server, transport
from apirctl.serve import inputs, provision, starting
from tests.support.podman_double import MemoryPodman

PACKAGE = Path(serve.__file__).resolve().parent.parent
STARTING = Path(starting.__file__).resolve()


class _Refusing(MemoryPodman):
    def __init__(self) -> None:
        super().__init__(images=("img",))
        self.specs: list[containers.ContainerSpec] = []

    def create(self, spec: containers.ContainerSpec) -> str:
        self.specs.append(spec)
        raise ApirctlError("podman refused to create the container: test")


def _own_file(frame: FrameType | None) -> Path | None:
    """The innermost apirctl source file on the stack (library frames in between do not count)."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            return path
        frame = frame.f_back
    return None


def _entries_into_starting(run: Any, api: _Refusing) -> int:
    """How often control comes into serve/starting.py from another apirctl module (or from outside, the
    first time) until the spec reaches Podman."""
    entries = 0
    where: list[Path | None] = [None]

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        nonlocal entries
        if api.specs or event not in ("call", "return"):
            return
        now = _own_file(frame if event == "call" else frame.f_back)
        if now == STARTING and where[0] != STARTING:
            entries += 1
        where[0] = now

    sys.setprofile(profile)
    try:
        run()
    except ApirctlError:
        pass
    finally:
        sys.setprofile(None)
    return entries


@pytest.fixture
def rpc_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[object], list[object]]:
    """A model file, the rpc plan of a backend of the container's own; (started, stopped) backends."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(provision, "resolve_model",
                        lambda _ref: inputs.ModelFile(path=model, filename="m.gguf", name="m"))
    monkeypatch.setattr(transport, "plan", lambda *_a, **_k: transport.local_rpc_plan(99))
    instance = backends.Instance(id="0123abcd", pid=0, directory=str(tmp_path / "rpc-0123abcd"),
                                 log=str(tmp_path / "log"), started_at=0.0)
    started: list[object] = []
    stopped: list[object] = []
    monkeypatch.setattr(rpc_server, "start_own_backend",
                        lambda name, memory_limit=None, region=None: started.append(name) or instance)
    monkeypatch.setattr(backends, "stop", stopped.append)
    return started, stopped


def test_the_options_reach_the_container_spec_entering_starting_at_most_four_times(
        rpc_start: tuple[list[object], list[object]]) -> None:
    api = _Refusing()
    opts = serve.options("m", transport="rpc", name="apirctl-path", image="img")
    with containers.use(api):
        entries = _entries_into_starting(lambda: starting.start(opts), api)
    [spec] = api.specs
    assert backends.CONTAINER_ENDPOINT in spec.command and spec.name == "apirctl-path"
    assert 1 <= entries <= 4, entries
    started, stopped = rpc_start
    assert started == ["apirctl-path"] and len(stopped) == 1  # the refused start released its backend


def test_provision_releases_what_it_made_when_the_block_fails(rpc_start: tuple[list[object], list[object]]) -> None:
    started, stopped = rpc_start
    opts = serve.options("m", transport="rpc", name="apirctl-cm", image="img")
    with containers.use(MemoryPodman(images=("img",))):
        with provision.provision(opts) as ready:  # a block that succeeds keeps them
            assert ready.instance is not None and ready.spec.labels["apirctl.serve-inputs"]
        assert started == ["apirctl-cm"] and stopped == []
        with pytest.raises(KeyboardInterrupt), provision.provision(opts):
            raise KeyboardInterrupt
    assert len(stopped) == 1
