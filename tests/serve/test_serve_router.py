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
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from apirctl.errors import ApirctlError
from apirctl.remoting.transport import Plan
from apirctl.serve import ModelFile, ModelSet, inputs, spec
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
    mounts = spec.router_mounts(ModelSet(models=[single, vision, split]))
    assert {m.target: Path(m.source).name for m in mounts} == {
        "/models/a/model.gguf": "a.gguf",  # a name with "mmproj" in it would be taken for a projector
        "/models/b/model.gguf": "b", "/models/b/mmproj-sha256-p": "p",
        "/models/c/c-00001-of-00002.gguf": "c1", "/models/c/c-00002-of-00002.gguf": "c2",
    }
    assert all(m.read_only for m in mounts)
    whole = spec.router_mounts(ModelSet(directory=tmp_path))
    assert [(m.source, m.target) for m in whole] == [(tmp_path, "/models")]


def test_router_command_and_the_transports_that_hold_one_model(tmp_path: Path) -> None:
    opts = inputs.ServeOptions(model="a", models=["a", "b"], models_max=3, idle_unload=300, temperature=0.5)
    command = spec.router_command(opts, Plan(transport="none", requested="none"))
    assert "--model" not in command and "--alias" not in command
    assert command[command.index("--models-dir"):][:2] == ["--models-dir", "/models"]
    assert command[command.index("--models-max"):][:2] == ["--models-max", "3"]
    assert command[command.index("--sleep-idle-seconds"):][:2] == ["--sleep-idle-seconds", "300"]
    assert command[command.index("--temp"):][:2] == ["--temp", "0.5"]
    rpc = Plan(transport="rpc", requested="rpc")
    with pytest.raises(ApirctlError, match="keeps one model loaded at a time"):
        spec.router_command(opts, rpc)
    limit, notice = spec.models_max(opts.model_copy(update={"models_max": None}), rpc)
    assert limit == 1 and notice and "serves one client" in notice
    assert spec.models_max(opts.model_copy(update={"models_max": None}), Plan(transport="gpu", requested="gpu")) \
        == (None, None)


def test_a_router_with_a_default_model_starts_behind_the_front(tmp_path: Path) -> None:
    from apirctl.build import image

    opts = inputs.ServeOptions(model="a", models=["a", "b"], port=4321)
    served = ModelSet(models=[ModelFile(path=tmp_path / "a.gguf", filename="a.gguf", name="a"),
                              ModelFile(path=tmp_path / "b.gguf", filename="b.gguf", name="b")], default="b")
    plan = Plan(transport="none", requested="none")
    built = spec.container_spec(opts, plan, served, "r", f"{image.IMAGE_REPO}:tag")
    assert built.entrypoint == [image.FRONT, "--listen", "8000", "--upstream", "8001", "--model", "b", "--",
                               "llama-server"]
    assert built.command[built.command.index("--port"):][:2] == ["--port", "8001"]
    assert built.command[built.command.index("--host"):][:2] == ["--host", "127.0.0.1"]
    assert built.labels["apirctl.default-model"] == "b" and built.ports == {8000: ("127.0.0.1", 4321)}
    # another image has no front: the router answers on the container's port, and has no default
    other = spec.container_spec(opts, plan, served, "r", "quay.io/x/llama:1")
    assert other.entrypoint == ["llama-server"] and "apirctl.default-model" not in other.labels
    assert other.command[other.command.index("--port"):][:2] == ["--port", "8000"]
    with pytest.raises(ApirctlError, match="--default-model needs apirctl's image"):
        spec.container_spec(opts.model_copy(update={"router_default": "b"}), plan, served, "r", "quay.io/x/llama:1")


def test_the_default_model_is_the_first_named_or_the_one_chosen(demo_model: Path, tmp_path: Path) -> None:
    paths = [str(named_copy(demo_model, tmp_path / f"{model}.gguf")) for model in ("one", "two")]
    assert inputs.resolve_models(inputs.ServeOptions(model=paths[0], models=paths)).default == "one"
    for chosen in ("two", paths[1]):  # by its name or as it was named on the command line
        opts = inputs.ServeOptions(model=paths[0], models=paths, router_default=chosen)
        assert inputs.resolve_models(opts).default == "two"
    with pytest.raises(ApirctlError, match="--default-model three is not one of the models served"):
        inputs.resolve_models(inputs.ServeOptions(model=paths[0], models=paths, router_default="three"))


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
    (("a", "--default-model", "a"), "--default-model picks one of the models of a server of several"),
    (("--models-dir", ".", "--default-model", "a b"), "--default-model 'a b' is not a model's name"),
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
    assert f"{first} (loaded, default)" in row and "third-model (loaded)" in row
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


# --- ps --stats of a router: each running model's figures, asked through the router --------------


def router_stats(name: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """`ps --stats --json` of one server: its stats, and its models' stats by name."""
    done = apirctl("ps", "--stats", "--json")
    assert done.returncode == 0, done.stderr
    shown = next(s["stats"] for s in json.loads(done.stdout) if s["name"] == name)
    return shown, {m["name"]: m for m in shown["models"]}


def model_metrics(port: int, model: str) -> dict[str, float]:
    from apirctl.serve import stats

    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", params={"model": model, "autoload": "false"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return stats.parse_metrics(reply.text)


def _long_completion(port: int, model: str, results: list[Any]) -> threading.Thread:
    def run() -> None:
        results.append(httpx.post(f"http://127.0.0.1:{port}/completion", timeout=300,
                                  json={"model": model, "prompt": "Once upon a time", "n_predict": 200,
                                        "ignore_eos": True, "temperature": 0}))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
def test_a_request_that_names_no_model_goes_to_the_default_model(
        podman: str, llama_image: str, demo_model: Path, tmp_path: Path, name: str, port: int) -> None:
    """A client written for a one-model server sends no `model`: the router's front gives it the default
    (here chosen with --default-model), answered and streamed as a named request is; `ps` names it."""
    first, second = "first-model", "second-model"
    paths = [named_copy(demo_model, tmp_path / f"{model}.gguf") for model in (first, second)]
    done = apirctl("serve", *map(str, paths), "--default-model", second, "--transport", "none", "-p", str(port),
                   "-n", name, "-c", "1024", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["default_model"] == second
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    with httpx.Client(timeout=120) as client:  # keep-alive, as such clients do: each request is answered
        for _ in range(2):
            answer = client.post(url, json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == second and answer.json()["choices"][0]["message"]["content"]
        with client.stream("POST", url, json={**body, "stream": True}) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and events[-1] == "data: [DONE]" and len(events) > 2
        named = client.post(url, json={**body, "model": first})  # a named model is still the one named
        assert named.status_code == 200 and named.json()["model"] == first
        assert client.post(url, json={**body, "model": "nope"}).status_code == 400
    assert states(port) == {first: "loaded", second: "loaded"}

    shown = next(s for s in json.loads(apirctl("ps", "--json").stdout) if s["name"] == name)
    assert shown["default_model"] == second
    row = next(line for line in apirctl("ps").stdout.splitlines() if line.startswith(name))
    assert f"{second} (loaded, default)" in row and f"{first} (loaded)" in row
    assert apirctl("stop", name).returncode == 0


@pytest.mark.integration
def test_ps_stats_shows_each_running_model_of_a_router(
        podman: str, llama_image: str, demo_model: Path, tmp_path: Path, name: str, port: int) -> None:
    first, second = "first-model", "second-model"
    done = apirctl("serve", str(named_copy(demo_model, tmp_path / f"{first}.gguf")),
                   str(named_copy(demo_model, tmp_path / f"{second}.gguf")), "--transport", "none", "-p", str(port),
                   "-n", name, "--idle-unload", "20s", "-c", "1024", "--json")  # room for a loaded machine
    assert done.returncode == 0, done.stderr
    shown, per_model = router_stats(name)
    assert shown["problem"] == "no model loaded" and per_model == {}

    ask(name, first)
    shown, per_model = router_stats(name)
    assert set(per_model) == {first}  # the unloaded one has no figures (and asking did not load it)
    assert states(port)[second] == "unloaded"
    one = per_model[first]
    assert one["state"] == "loaded" and one["problem"] is None
    assert one["tokens_generated"] == int(model_metrics(port, first)["tokens_predicted_total"]) > 0
    assert one["generation_tps"] > 0 and one["busy_slots"] == 0 and 0 < one["kv_tokens"] <= one["kv_size"]
    assert shown["problem"] is None and shown["tokens_generated"] == one["tokens_generated"]

    # during a long answer of the second model: its slot is busy, and the router's row counts it
    results: list[Any] = []
    thread = _long_completion(port, second, results)

    def busy() -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
        found = router_stats(name)
        return found if (found[1].get(second) or {}).get("busy_slots") == 1 else None

    during, during_models = wait_for("the second model's slot to be busy", busy, timeout=240, interval=0.2)
    # (the router may still list it `loading` while its first request runs)
    assert during["busy_slots"] >= 1 and during_models[second]["state"] in ("loading", "loaded")
    thread.join(300)
    assert results and results[0].status_code == 200, results
    shown, per_model = router_stats(name)
    assert per_model[second]["tokens_generated"] >= 200 and per_model[second]["busy_slots"] == 0
    assert shown["tokens_generated"] == sum(m["tokens_generated"] for m in per_model.values())
    assert shown["kv_size"] == sum(m["kv_size"] for m in per_model.values() if m["kv_size"] is not None)

    # a model put to sleep keeps its figures (the server's cached metrics), and `ps --stats` does not wake it
    wait_for("the first model to sleep", lambda: states(port)[first] == "sleeping", timeout=90, interval=0.5)
    shown, per_model = router_stats(name)
    assert per_model[first]["state"] == "sleeping" and per_model[first]["tokens_generated"] == one["tokens_generated"]
    assert per_model[first]["kv_tokens"] is None  # its slots are not asked: that would load it again
    assert states(port)[first] == "sleeping"
    table = apirctl("ps", "--stats").stdout.splitlines()
    assert any(line.startswith(name) for line in table)
    rows = {line.split()[0]: line for line in table if line.startswith("  ")}
    assert "(sleeping)" in rows[first] and f"{per_model[second]['tokens_generated']}" in rows[second]
    assert apirctl("stop", name).returncode == 0


# --- --generate kube and quadlet of a router ------------------------------------------------------


@pytest.mark.integration
def test_generate_kube_of_a_router_plays_and_both_models_answer(
        podman: str, llama_image: str, demo_model: Path, tmp_path: Path, name: str, port: int) -> None:
    import yaml

    from apirctl.build import image
    from tests.serve.test_serve_habits import podman_remote, wait_health

    first, second = "first-model", "second-model"
    paths = [named_copy(demo_model, tmp_path / f"{model}.gguf") for model in (first, second)]
    done = apirctl("serve", *map(str, paths), "--transport", "none", "-p", str(port), "-n", name,
                   "--models-max", "1", "-c", "1024", "--generate", "kube")
    assert done.returncode == 0, done.stderr
    assert not container_exists(name)
    pod = yaml.safe_load(done.stdout)
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--models-dir"):][:2] == ["--models-dir", "/models"] and "--model" not in args
    assert args[args.index("--models-max"):][:2] == ["--models-max", "1"] and "--metrics" in args
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"] for v in pod["spec"]["volumes"]}
    assert {mounts[key]: (volumes[key]["path"], volumes[key]["type"]) for key in mounts} == {
        f"/models/{first}/model.gguf": (str(paths[0]), "File"),
        f"/models/{second}/model.gguf": (str(paths[1]), "File"),
    }
    annotations = pod["metadata"]["annotations"]
    assert annotations["apirctl.router"] == "true"
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
            annotations["prometheus.io/path"]) == ("true", "8000", "/metrics")

    yaml_file = tmp_path / "router.yaml"
    yaml_file.write_text(done.stdout)
    played = podman_remote(podman, "kube", "play", str(yaml_file))
    try:
        assert played.returncode == 0, played.stderr
        assert wait_health(port) == "ok"
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert {entry["id"] for entry in listed["data"]} == {first, second}
        for model in (first, second, first):  # each answers; --models-max 1: one loaded at a time
            answer = apirctl("chat", "--url", f"http://127.0.0.1:{port}/v1", "--model", model, *ASK)
            assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
            found = states(port)
            assert found[model] == "loaded" and [m for m, s in found.items() if s == "loaded"] == [model], found
        # the scrape annotations name the port that serves each model's metrics; the router's own path
        # wants the model named (docs/serve.md: a scrape job per model)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", params={"model": first}, timeout=30)
        assert metrics.status_code == 200 and "llamacpp:tokens_predicted_total" in metrics.text
        bare = httpx.get(f"http://127.0.0.1:{port}{annotations['prometheus.io/path']}", timeout=30)
        assert bare.status_code == 400 and "model name is missing" in bare.text
        # a request that names no model goes to the first named, through the Pod's front
        assert annotations["apirctl.default-model"] == first and container["command"][0] == image.FRONT
        unnamed = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                             timeout=120)
        assert unnamed.status_code == 200 and unnamed.json()["model"] == first, unnamed.text
    finally:
        podman_remote(podman, "kube", "down", str(yaml_file))


@pytest.mark.integration
def test_generate_quadlet_of_a_router_carries_every_model(
        podman: str, llama_image: str, demo_model: Path, tmp_path: Path, name: str, port: int) -> None:
    first, second = "first-model", "second-model"
    paths = [named_copy(demo_model, tmp_path / f"{model}.gguf") for model in (first, second)]
    done = apirctl("serve", *map(str, paths), "--transport", "none", "-p", str(port), "-n", name,
                   "--idle-unload", "5m", "--generate", "quadlet")
    assert done.returncode == 0, done.stderr
    unit = done.stdout.splitlines()
    assert not container_exists(name)
    assert f"Description=apirctl llama-server: {first},{second}" in unit
    assert {line for line in unit if line.startswith("Volume=")} == {
        f"Volume={paths[0]}:/models/{first}/model.gguf:ro", f"Volume={paths[1]}:/models/{second}/model.gguf:ro"}
    exec_line = next(line for line in unit if line.startswith("Exec="))
    words = exec_line.removeprefix("Exec=").split()
    assert words[:2] == ["--models-dir", "/models"] and "--model" not in words and "--metrics" in words
    assert words[words.index("--sleep-idle-seconds"):][:2] == ["--sleep-idle-seconds", "300"]
    assert {"Label=prometheus.io/scrape=true", "Label=prometheus.io/port=8000", "Label=prometheus.io/path=/metrics",
            "Label=apirctl.router=true", f"PublishPort=127.0.0.1:{port}:8000"} <= set(unit)
    generator = next((p for p in (Path("/usr/libexec/podman/quadlet"), Path("/usr/lib/podman/quadlet"))
                      if p.exists()), None)
    if generator is None:
        return  # the content is checked; Podman before 4.4 has no quadlet generator to parse it
    units = tmp_path / "units"
    units.mkdir()
    (units / f"{name}.container").write_text(done.stdout)
    parsed = subprocess.run([str(generator), "-user", "-dryrun"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "QUADLET_UNIT_DIRS": str(units)}, check=False)
    assert parsed.returncode == 0 and "podman run" in parsed.stdout, parsed.stderr
    assert f"-v {paths[1]}:/models/{second}/model.gguf:ro" in parsed.stdout


def test_generate_kube_mounts_a_models_dir_as_a_directory(tmp_path: Path) -> None:
    from apirctl.podman.containers import BindMount, ContainerSpec
    from apirctl.serve.units import kube

    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    made = ContainerSpec(image="img", name="n", command=["--models-dir", "/models"],
                         mounts=[*spec.router_mounts(ModelSet(directory=tmp_path)),
                                 BindMount(source=tmp_path / "a.gguf", target="/x/a.gguf")])
    import yaml

    pod = yaml.safe_load(kube(made))
    assert [v["hostPath"] for v in pod["spec"]["volumes"]] == [
        {"path": str(tmp_path), "type": "Directory"}, {"path": str(tmp_path / "a.gguf"), "type": "File"}]
