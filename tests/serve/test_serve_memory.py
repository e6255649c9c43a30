"""`apirctl serve --memory SIZE`: Podman's sizes read once (serve's options), refused in one line with a
hint, and the limit carried to the container's spec (podman-py's `mem_limit`, libpod's resource limits),
to the quadlet unit and the Pod, and to the container's own RPC backend (its shared-memory cap)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apirctl import serve
from apirctl.errors import ApirctlError
from apirctl.podman import containers, libpod
from apirctl.podman.servers import L_INPUTS
from apirctl.remoting import backends, rpc_server, transport
from apirctl.serve import inputs, provision, spec, starting, units
from tests.support.podman_double import MemoryPodman

GIB = 1024**3
UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": GIB, "t": 1024**4}


@given(number=st.integers(min_value=1, max_value=10**6), unit=st.sampled_from(sorted(UNITS)),
       suffix=st.sampled_from(["", "b", "B", "ib", "iB"]), upper=st.booleans())
def test_a_size_is_its_number_times_its_binary_unit(number: int, unit: str, suffix: str, upper: bool) -> None:
    if not unit and suffix.lower() == "ib":
        suffix = suffix[-1:]  # "8ib" is no size: "i" belongs to a unit
    text = f"{number}{unit.upper() if upper else unit}{suffix}"
    expected = number * UNITS[unit]
    if expected < inputs.MIN_MEMORY:
        with pytest.raises(ApirctlError, match="below the smallest limit"):
            inputs.memory_limit(text)
    else:
        assert inputs.memory_limit(text) == expected


@given(st.text(max_size=40))
def test_any_text_is_a_limit_of_at_least_6_mib_or_a_one_line_error(text: str) -> None:
    try:
        value = inputs.memory_limit(text)
    except ApirctlError as exc:
        assert "\n" not in exc.message and exc.message.startswith("--memory ") and exc.hint
    else:
        assert inputs.MIN_MEMORY <= value <= inputs.MAX_MEMORY


@pytest.mark.parametrize(("text", "value"), [
    ("8g", 8 * GIB), ("512m", 512 * 1024**2), ("1073741824", GIB), ("1.5G", GIB + GIB // 2), ("8GiB", 8 * GIB),
    ("8 gb", 8 * GIB), ("6m", 6 * 1024**2), ("6291456", 6 * 1024**2), ("0.5t", 512 * GIB), (" 2g ", 2 * GIB),
])
def test_podmans_forms(text: str, value: int) -> None:
    assert inputs.memory_limit(text) == value


@pytest.mark.parametrize(("text", "why"), [
    ("lots", "is not a memory size"), ("-1g", "is not a memory size"), ("", "is not a memory size"),
    ("1e9", "is not a memory size"), ("8x", "is not a memory size"), ("g", "is not a memory size"),
    ("0", "below the smallest limit Podman accepts (6 MiB)"), ("5m", "below the smallest limit"),
    ("6291455", "below the smallest limit"), ("9000000p", "is more than a memory limit can be"),
])
def test_bad_sizes_are_refused(text: str, why: str) -> None:
    with pytest.raises(ApirctlError) as caught:
        inputs.memory_limit(text)
    assert caught.value.message.startswith(f"--memory {text!r} ") and why in caught.value.message
    assert caught.value.hint is not None and "--memory 8g" in caught.value.hint


def test_options_read_the_flag_once() -> None:
    assert serve.options("m", memory="2g").memory == 2 * GIB
    assert serve.options("m").memory is None
    with pytest.raises(ApirctlError, match="--memory 'lots' is not a memory size"):
        serve.options("m", memory="lots")


@pytest.mark.parametrize("bad", ["lots", "-1g", "0"])
def test_the_cli_says_it_in_one_line_and_a_hint_before_anything_starts(bad: str) -> None:
    done = subprocess.run([sys.executable, "-m", "apirctl", "serve", "no-such-model", f"--memory={bad}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CONTAINER_HOST": "unix:///nowhere"})
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith(f"apirctl: error: --memory '{bad}' ")
    assert lines[1].startswith("hint: a size of at least 6m")


def test_the_cli_takes_a_dash_value_as_the_size_not_as_a_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "apirctl", "serve", "no-such-model", "--memory", "-1g"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CONTAINER_HOST": "unix:///nowhere"})
    assert done.returncode == 1 and "--memory '-1g' is not a memory size" in done.stderr, done.stderr


def _spec(**extra: Any) -> containers.ContainerSpec:
    return containers.ContainerSpec(image="localhost/apirctl/llama-server:test", name="apirctl-x",
                                    command=["--port", "8000"], ports={8000: ("127.0.0.1", 1234)}, **extra)


def test_the_spec_asks_podman_for_the_limit() -> None:
    made = _spec(mem_limit=8 * GIB)
    assert made.create_kwargs()["mem_limit"] == 8 * GIB
    assert libpod.create_body(made)["resource_limits"] == {"memory": {"limit": 8 * GIB}}
    assert "mem_limit" not in _spec().create_kwargs() and "resource_limits" not in libpod.create_body(_spec())


def test_quadlet_and_kube_carry_the_limit() -> None:
    unit = units.quadlet(_spec(mem_limit=8 * GIB))
    assert f"PodmanArgs=--memory {8 * GIB}" in unit.splitlines()
    assert unit.index("PodmanArgs=--memory") < unit.index("[Service]")  # in [Container]
    assert "--memory" not in units.quadlet(_spec())
    pod = units.kube(_spec(mem_limit=8 * GIB))
    assert f'      resources:\n        limits:\n          memory: "{8 * GIB}"' in pod  # the container's
    assert "resources:" not in units.kube(_spec())


def test_a_rewired_container_keeps_its_limit(tmp_path: Path) -> None:
    """`restart` builds a moved server's spec again from the inputs its label records, the one way."""
    model = inputs.ModelFile(path=tmp_path / "m.gguf", filename="m.gguf", name="m")
    for size, limit in (("3g", 3 * GIB), (None, None)):
        opts = serve.options("m", memory=size, port=4567)
        labels = {L_INPUTS: spec.record(opts, model, "localhost/apirctl/llama-server:test")}
        found = spec.recorded(labels, "apirctl-x")
        plan = transport.local_rpc_plan(99)
        remade = spec.container_spec(found.options, plan, found.served, "apirctl-x", found.image)
        assert remade.mem_limit == limit and remade.ports == {8000: ("127.0.0.1", 4567)}
        assert remade.image == "localhost/apirctl/llama-server:test" and "/models/m.gguf" in remade.command
    with pytest.raises(ApirctlError, match="started by an older apirctl"):
        spec.recorded({}, "apirctl-x")


class _Refusing(MemoryPodman):
    """Podman that records the spec it is asked to create, then refuses it (serve stops there)."""

    def __init__(self) -> None:
        super().__init__(images=("img",))
        self.specs: list[containers.ContainerSpec] = []

    def create(self, spec: containers.ContainerSpec) -> str:
        self.specs.append(spec)
        raise ApirctlError("podman refused to create the container: test")


def test_serve_gives_the_limit_to_the_container_and_to_its_own_backend(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(provision, "resolve_model", lambda _ref: inputs.ModelFile(path=model, filename="m.gguf",
                                                                                name="m"))
    monkeypatch.setattr(transport, "plan", lambda *_a, **_k: transport.local_rpc_plan(99))
    instance = backends.Instance(id="0123abcd", pid=0, directory=str(tmp_path / "rpc-0123abcd"),
                                 log=str(tmp_path / "log"), started_at=0.0)
    started: list[tuple[str, int | None]] = []
    stopped: list[object] = []
    monkeypatch.setattr(rpc_server, "start_own_backend",
                        lambda name, memory_limit=None, region=None: started.append((name, memory_limit)) or instance)
    monkeypatch.setattr(backends, "stop", stopped.append)
    api = _Refusing()
    opts = serve.options("m", transport="rpc", name="apirctl-mem", image="img", memory="768m")
    with containers.use(api), pytest.raises(ApirctlError, match="refused"):
        starting.start(opts)
    assert started == [("apirctl-mem", 768 * 1024**2)]
    [made] = api.specs
    assert made.mem_limit == 768 * 1024**2 and made.create_kwargs()["mem_limit"] == 768 * 1024**2
    assert backends.CONTAINER_ENDPOINT in made.command  # the container dials the backend that got the cap
    assert stopped == [instance]  # and the failed start stopped it


def test_without_the_flag_neither_gets_a_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(provision, "resolve_model", lambda _ref: inputs.ModelFile(path=model, filename="m.gguf",
                                                                                name="m"))
    monkeypatch.setattr(transport, "plan", lambda *_a, **_k: transport.local_rpc_plan(99))
    started: list[int | None] = []
    instance = backends.Instance(id="0123abcd", pid=0, directory=str(tmp_path / "d"), log=str(tmp_path / "l"),
                                 started_at=0.0)
    monkeypatch.setattr(rpc_server, "start_own_backend",
                        lambda name, memory_limit=None, region=None: started.append(memory_limit) or instance)
    monkeypatch.setattr(backends, "stop", lambda _i: None)
    api = _Refusing()
    with containers.use(api), pytest.raises(ApirctlError):
        starting.start(serve.options("m", transport="rpc", name="apirctl-nomem", image="img"))
    assert started == [None] and api.specs[0].mem_limit is None and "mem_limit" not in api.specs[0].create_kwargs()
