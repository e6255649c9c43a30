"""Several models behind one port: `apirctl serve A B C` runs llama-server's router mode in one
container, with real Podman, the real image, the demo model and the tests' tiny vision model (the demo
model with a projector, from an Ollama store, as tests/serve/test_serve_vision.py makes it).

The router lists the models at /v1/models, loads each on its first request, unloads the least
recently used past --models-max, and puts a model to sleep (unloaded) after --idle-unload. The
wiring that needs no container (names, mounts, flags, the one-client transports) is checked first.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from apirctl.errors import ApirctlError
from apirctl.remoting.transport import Plan
from apirctl.serve import ModelFile, ModelSet, inputs, starting
from tests.serve.conftest import apirctl, container_exists
from tests.serve.test_serve_habits import podman_command
from tests.support.model_sources import ollama_store
from tests.support.vision import Projector, text_embedding_length, write_projector
from tests.support.waiting import wait_for

ASK = ("Say hi.", "--max-tokens", "4", "--temp", "0", "--seed", "3")


# --- without a container ------------------------------------------------------------------------


def test_router_mounts_a_directory_per_model_with_names_the_router_reads(tmp_path: Path) -> None:
    from apirctl import models

    single = ModelFile(path=tmp_path / "a.gguf", filename="mmproj-looking-name.gguf", name="a")
    vision = ModelFile(path=tmp_path / "b", filename="sha256-b", name="b", mmproj="sha256-p",
                       files=[models.ModelFile(path=tmp_path / "b", filename="sha256-b"),
                              models.ModelFile(path=tmp_path / "p", filename="sha256-p")])
    split = ModelFile(path=tmp_path / "c1", filename="c-00001-of-00002.gguf", name="c",
                      files=[models.ModelFile(path=tmp_path / "c1", filename="c-00001-of-00002.gguf"),
                             models.ModelFile(path=tmp_path / "c2", filename="c-00002-of-00002.gguf")])
    mounts = starting._router_mounts(ModelSet(models=[single, vision, split]))
    assert {m.target: Path(m.source).name for m in mounts} == {
        "/models/a/model.gguf": "a.gguf",  # a name with "mmproj" in it would be taken for a projector
        "/models/b/model.gguf": "b", "/models/b/mmproj-sha256-p": "p",
        "/models/c/c-00001-of-00002.gguf": "c1", "/models/c/c-00002-of-00002.gguf": "c2",
    }
    assert all(m.read_only for m in mounts)
    whole = starting._router_mounts(ModelSet(directory=tmp_path))
    assert [(m.source, m.target) for m in whole] == [(tmp_path, "/models")]


def test_router_command_and_the_transports_that_hold_one_model(tmp_path: Path) -> None:
    opts = inputs.ServeOptions(model="a", models=["a", "b"], models_max=3, idle_unload=300, temperature=0.5)
    command = starting._router_command(opts, Plan(transport="none", requested="none"))
    assert "--model" not in command and "--alias" not in command
    assert command[command.index("--models-dir"):][:2] == ["--models-dir", "/models"]
    assert command[command.index("--models-max"):][:2] == ["--models-max", "3"]
    assert command[command.index("--sleep-idle-seconds"):][:2] == ["--sleep-idle-seconds", "300"]
    assert command[command.index("--temp"):][:2] == ["--temp", "0.5"]
    rpc = Plan(transport="rpc", requested="rpc")
    with pytest.raises(ApirctlError, match="keeps one model loaded at a time"):
        starting._router_command(opts, rpc)
    limit, notice = starting.models_max(opts.model_copy(update={"models_max": None}), rpc)
    assert limit == 1 and notice and "serves one client" in notice
    assert starting.models_max(opts.model_copy(update={"models_max": None}), Plan(transport="gpu", requested="gpu")) \
        == (None, None)


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30s", 30), ("5m", 300), ("1h30m", 5400), ("1d", 86400),
                                                ("2M", 120), ("off", None), ("0", None), ("0s", None)])
def test_idle_unload_durations(text: str, seconds: int | None) -> None:
    assert inputs.idle_seconds(text) == seconds


@pytest.mark.parametrize("args, message", [
    (("a", "--models-max", "2"), "--models-max limits the models of a server of several"),
    (("a", "b", "--models-max", "-1"), "--models-max -1 is below 0"),
    (("a", "b", "--idle-unload", "5 minutes"), "--idle-unload '5 minutes' is not a length of time"),
    (("a", "--models-dir", "."), "give models or --models-dir, not both"),
    (("--models-dir", "/no/such/dir"), "--models-dir /no/such/dir: no such directory"),
    (("a", "a"), "a model is named twice"),
])
def test_bad_router_input_is_one_line_and_a_hint(args: tuple[str, ...], message: str) -> None:
    done = apirctl("serve", *args)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"apirctl: error: {message}" and lines[1].startswith("hint: ") and len(lines) == 2


# --- with real Podman ---------------------------------------------------------------------------


def states(port: int) -> dict[str, str]:
    """The router's own account of its models: /models loads nothing and wakes no model."""
    answer = httpx.get(f"http://127.0.0.1:{port}/models", timeout=30).json()
    return {entry["id"]: entry["status"]["value"] for entry in answer["data"]}


def ask(name: str, model: str) -> str:
    done = apirctl("chat", "-n", name, "--model", model, *ASK)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    return done.stdout


def named_copy(demo_model: Path, path: Path) -> Path:
    """The demo model under another file name (a hard link where it can be, else a copy): a model of its own
    name to the router (a symbolic link would resolve to the store's blob name)."""
    try:
        os.link(demo_model, path)
    except OSError:
        shutil.copyfile(demo_model, path)
    return path


@pytest.fixture
def vision_model(tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tests' tiny vision model (the demo model and a random projector) in an Ollama store."""
    projector = write_projector(tmp_path / "mmproj.gguf", Projector(text_embd=text_embedding_length(demo_model)))
    ollama_store(tmp_path / "ollama-models", "registry.ollama.ai", "library", "tiny-vision", "1b",
                 {"model": demo_model, "projector": projector})
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))
    return "tiny-vision:1b"


@pytest.mark.integration
def test_several_models_on_one_port_and_the_least_recently_used_unloads(
        podman: str, llama_image: str, demo_model: Path, vision_model: str, tmp_path: Path, name: str,
        port: int) -> None:
    first, vision = "first-model", "tiny-vision-1b"
    done = apirctl("serve", str(named_copy(demo_model, tmp_path / f"{first}.gguf")), vision_model,
                   str(named_copy(demo_model, tmp_path / "third-model.gguf")), "--transport", "none", "-p", str(port),
                   "-n", name, "--models-max", "2", "-c", "1024", "--json")
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)
    assert server["router"] is True and server["model"] == f"{first},{vision},third-model"
    # listed before any is loaded: the set serve named, none loaded
    assert server["models"] == {first: "unloaded", vision: "unloaded", "third-model": "unloaded"}
    listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
    assert {entry["id"] for entry in listed["data"]} == {first, vision, "third-model"}
    command = podman_command(name)
    assert command[command.index("--models-max"):][:2] == ["--models-max", "2"] and "--model" not in command

    ask(name, first)
    ask(name, vision)  # both answer, through one port
    assert states(port) == {first: "loaded", vision: "loaded", "third-model": "unloaded"}
    ask(name, first)  # the first is now the most recently used
    ask(name, "third-model")  # a third past --models-max 2: the least recently used (vision) goes
    assert states(port) == {first: "loaded", vision: "unloaded", "third-model": "loaded"}

    shown = json.loads(apirctl("ps", "--json").stdout)
    assert next(s for s in shown if s["name"] == name)["models"] == states(port)
    row = next(line for line in apirctl("ps").stdout.splitlines() if line.startswith(name))
    assert f"{first} (loaded)" in row and "third-model (loaded)" in row
    assert vision in row and f"{vision} (" not in row  # unloaded: named without a state

    unnamed = apirctl("chat", "-n", name, *ASK)
    assert unnamed.returncode == 1 and f"{name} serves several models" in unnamed.stderr
    assert f"--model {first}" in unnamed.stderr
    unknown = apirctl("chat", "-n", name, "--model", "nope", *ASK)
    assert unknown.returncode == 1 and "serves no model 'nope'" in unknown.stderr
    assert apirctl("stop", name).returncode == 0
    assert not container_exists(name)


@pytest.mark.integration
def test_an_idle_model_is_unloaded_and_the_next_request_loads_it_again(
        podman: str, llama_image: str, demo_model: Path, tmp_path: Path, name: str, port: int) -> None:
    first = "first-model"
    done = apirctl("serve", str(named_copy(demo_model, tmp_path / f"{first}.gguf")),
                   str(named_copy(demo_model, tmp_path / "second-model.gguf")), "--transport", "none", "-p", str(port),
                   "-n", name,
                   "--idle-unload", "3s", "-c", "1024", "--json")
    assert done.returncode == 0, done.stderr
    assert "--sleep-idle-seconds" in podman_command(name)
    ask(name, first)
    assert states(port)[first] == "loaded"
    wait_for("the idle model to be unloaded", lambda: states(port)[first] == "sleeping", timeout=60, interval=0.5)
    assert states(port)["second-model"] == "unloaded"
    ask(name, first)  # the next request wakes it
    assert states(port)[first] == "loaded"
    assert apirctl("stop", name).returncode == 0
