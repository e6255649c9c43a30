"""What users of `ollama run` and `ramalama serve` reach for, typed as they type it, with real Podman and
the demo model: `apirctl run`, a default port that moves off a busy one, sampling flags, embedding and
reranking models (served with --embeddings / --reranking, refused by chat), split models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from apirctl.serve import inputs, spec
from tests.serve.conftest import apirctl, container_exists
from tests.support.model_sources import write_bert_gguf

pytestmark = pytest.mark.integration


def serve_json(*args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "apirctl", "serve", *args, "--json"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout)) | {"stderr": done.stderr}


def test_run_answers_once_and_stops_the_server(podman: str, llama_image: str, demo_model: Path, name: str,
                                               port: int) -> None:
    """`ramalama run MODEL PROMPT`, typed with apirctl's short flags (-c context, -p port, -n name)."""
    done = apirctl("run", str(demo_model), "Say", "hello.", "--max-tokens", "8", "--temp", "0", "--seed", "3",
                   "-c", "1024", "-p", str(port), "-n", name, "--transport", "none")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert not container_exists(name)


def test_run_keep_leaves_the_server(podman: str, llama_image: str, demo_model: Path, name: str, port: int) -> None:
    """--prompt still works; -t is the server's threads and what follows `--` goes to llama-server."""
    done = apirctl("run", str(demo_model), "--keep", "--prompt", "Hi", "--max-tokens", "4", "--port", str(port),
                   "--name", name, "--transport", "none", "-t", "1", "-c", "2048", "--", "--top-k", "7")
    assert done.returncode == 0, done.stderr
    assert f"apirctl stop {name}" in done.stderr
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "ok"
    command = podman_command(name)
    assert command[command.index("--threads"):][:2] == ["--threads", "1"]
    assert command[command.index("--ctx-size"):][:2] == ["--ctx-size", "2048"]
    assert command[-2:] == ["--top-k", "7"] and "Hi" not in command
    chat = apirctl("chat", "-p", str(port), "-c", "2048", "Say hi.", "--max-tokens", "4")
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
    too_big = apirctl("chat", "-p", str(port), "-c", "4096", "Say hi.")
    assert too_big.returncode == 1 and "has a context of 2048 tokens, fewer than --ctx-size 4096" in too_big.stderr
    assert "serve MODEL --ctx-size 4096" in too_big.stderr and too_big.stdout == ""
    assert apirctl("stop", name).returncode == 0


def test_a_busy_default_port_moves_an_explicit_one_fails(podman: str, llama_image: str, demo_model: Path,
                                                          name: str, port: int) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        server = serve_json(str(demo_model), "--name", name, "--transport", "none", "--temp", "0.1",
                            "--seed", "5", "--max-tokens", "16", env={"APIRCTL_PORT": str(port)})
        assert server["port"] != port and f"port {port} is in use" in str(server["stderr"])
        command = podman_command(name)
        assert command[command.index("--temp"):][:2] == ["--temp", "0.1"]
        assert command[command.index("--seed"):][:2] == ["--seed", "5"]
        assert command[command.index("--n-predict"):][:2] == ["--n-predict", "16"]
        refused = apirctl("serve", str(demo_model), "--port", str(port), "--transport", "none", "--name",
                          name + "-2")
        assert refused.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in refused.stderr
    assert apirctl("stop", name).returncode == 0


def podman_command(name: str) -> list[str]:
    done = subprocess.run(["podman", "inspect", name, "--format", "{{json .Config.Cmd}}"], capture_output=True,
                          text=True, timeout=60, check=True)
    return list(json.loads(done.stdout))


@pytest.mark.parametrize("reranking", [False, True])
def test_embedding_and_reranking_models(podman: str, llama_image: str, tmp_path: Path, name: str, port: int,
                                        reranking: bool) -> None:
    model = write_bert_gguf(tmp_path / ("rerank.gguf" if reranking else "embed.gguf"), reranking=reranking)
    server = serve_json(str(model), "--port", str(port), "--name", name, "--transport", "none")
    kind = "reranking" if reranking else "embedding"
    assert server["kind"] == kind and f"--{'reranking' if reranking else 'embeddings'}" in podman_command(name)
    base = f"http://127.0.0.1:{port}/v1"
    if reranking:
        answer = httpx.post(f"{base}/rerank", json={"query": "the cat", "documents": ["the dog", "hello"]},
                            timeout=60).json()
        assert len(answer["results"]) == 2
    else:
        answer = httpx.post(f"{base}/embeddings", json={"input": "hello world"}, timeout=60).json()
        assert len(answer["data"][0]["embedding"]) == 32
    chat = apirctl("chat", "--name", name, "hi")
    assert chat.returncode == 1 and "does not chat" in chat.stderr and "Traceback" not in chat.stderr
    direct = apirctl("chat", "--url", base, "hi")  # any server: llama-server's refusal, said plainly
    assert direct.returncode == 1 and "does not chat" in direct.stderr
    assert apirctl("stop", name).returncode == 0
    run = apirctl("run", str(model), "--prompt", "hi", "--port", str(port), "--name", name, "--transport", "none")
    assert run.returncode == 1 and "does not chat" in run.stderr
    assert not container_exists(name)


def test_split_model_is_served_from_its_first_part(podman: str, llama_image: str, llama_build,  # type: ignore[no-untyped-def]
                                                   demo_model: Path, tmp_path: Path, name: str, port: int) -> None:
    done = subprocess.run([str(llama_build.binary("llama-gguf-split")), "--split", "--split-max-tensors", "100",
                           str(demo_model), str(tmp_path / "smol")], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted(tmp_path.glob("smol-*-of-*.gguf"))
    assert len(parts) >= 2
    server = serve_json(str(parts[0]), "--port", str(port), "--name", name, "--transport", "none")
    assert server["health"] == "ok"
    answer = apirctl("chat", "--name", name, "Say hi.", "--max-tokens", "4")
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
    assert apirctl("stop", name).returncode == 0


def test_model_args_from_kind_projector_and_ollama_params() -> None:
    opts = inputs.ServeOptions(model="m", temperature=0.3)
    model = inputs.ModelFile(path=Path("/m.gguf"), filename="m.gguf", name="m", mmproj="mmproj-m.gguf",
                              params={"temperature": 0.9, "top_k": 20, "stop": ["x"], "seed": True})
    assert spec._model_args(opts, model) == ["--mmproj", "/models/mmproj-m.gguf", "--temp", "0.3",
                                                "--top-k", "20"]


def podman_remote(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The podman client against the session's service (its containers.conf suits this host)."""
    return subprocess.run(["podman", "--remote", "--url", url, *args], capture_output=True, text=True,
                          timeout=300, check=False)


def wait_health(port: int, timeout: float = 300) -> str:
    import time

    deadline = time.monotonic() + timeout
    status = "unreachable"
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("status", "?")
        except (httpx.HTTPError, ValueError):
            status = "unreachable"
        if status == "ok":
            return status
        time.sleep(0.5)
    return status


def test_generate_kube_runs_with_podman_kube_play(podman: str, llama_image: str, demo_model: Path, name: str,
                                                  port: int, tmp_path: Path) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--restart", "on-failure", "--generate", "kube")
    assert done.returncode == 0, done.stderr
    assert not container_exists(name)  # written down, not started
    assert f'"hostPort": {port}' not in done.stdout and f"hostPort: {port}" in done.stdout
    assert '"/app/bin/apirctl-health"' in done.stdout and "livenessProbe:" in done.stdout
    yaml_file = tmp_path / "server.yaml"
    yaml_file.write_text(done.stdout)
    played = podman_remote(podman, "kube", "play", str(yaml_file))
    try:
        assert played.returncode == 0, played.stderr
        assert wait_health(port) == "ok"
        answer = apirctl("chat", "--url", f"http://127.0.0.1:{port}/v1", "Hi", "--max-tokens", "4")
        assert answer.returncode == 0, answer.stderr
        # the pod carries the scrape annotations, and the port they name serves the metrics
        pod = yaml.safe_load(done.stdout)
        annotations = pod["metadata"]["annotations"]
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/path"]) == ("true", "/metrics")
        ports = {p["containerPort"]: p["hostPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        metrics = httpx.get(f"http://127.0.0.1:{ports[int(annotations['prometheus.io/port'])]}/metrics", timeout=10)
        assert metrics.status_code == 200 and "llamacpp:tokens_predicted_total" in metrics.text
        # the probe became the container's Podman health check, and it passes (kube play runs it in a shell)
        container = f"{name}-llama-server"
        config = json.loads(podman_remote(podman, "inspect", container, "--format",
                                          "{{json .Config.Healthcheck}}").stdout)
        assert "/app/bin/apirctl-health --live 8000" in " ".join(config["Test"])
        check = podman_remote(podman, "healthcheck", "run", container)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        podman_remote(podman, "kube", "down", str(yaml_file))


#: quadlet's health keys and the `podman run` options it writes for them (Podman's quadlet documentation)
QUADLET_HEALTH = {"HealthCmd": "--health-cmd", "HealthInterval": "--health-interval",
                  "HealthTimeout": "--health-timeout", "HealthRetries": "--health-retries",
                  "HealthStartPeriod": "--health-start-period"}


def test_generate_quadlet(podman: str, llama_image: str, demo_model: Path, name: str, port: int,
                          tmp_path: Path) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--restart", "always", "--generate", "quadlet")
    assert done.returncode == 0, done.stderr
    unit = done.stdout
    assert f"Image={llama_image}" in unit and f"ContainerName={name}" in unit
    assert f"PublishPort=127.0.0.1:{port}:8000" in unit and f"Volume={demo_model}:/models/" in unit
    assert "Restart=always" in unit and "Exec=--model /models/" in unit
    assert "Label=prometheus.io/scrape=true" in unit and " --metrics" in unit
    health = dict(line.split("=", 1) for line in unit.splitlines() if line.startswith("Health"))
    assert health == {"HealthCmd": "CMD /app/bin/apirctl-health 8000", "HealthInterval": "30s",
                      "HealthTimeout": "10s", "HealthRetries": "3", "HealthStartPeriod": "300s"}
    assert not container_exists(name)
    # what quadlet hands to `podman run` (--health-cmd and the rest) is accepted by Podman and makes the
    # check a command run directly (CMD), not through a shell
    flags = [f"{QUADLET_HEALTH[key]}={value}" for key, value in health.items()]
    made = podman_remote(podman, "create", "--name", name, *flags, llama_image)
    assert made.returncode == 0, made.stderr
    config = json.loads(podman_remote(podman, "inspect", name, "--format", "{{json .Config.Healthcheck}}").stdout)
    assert config["Test"] == ["CMD", "/app/bin/apirctl-health", "8000"] and config["StartPeriod"] == 300 * 10**9
    podman_remote(podman, "rm", "-f", name)
    generator = next((p for p in (Path("/usr/libexec/podman/quadlet"), Path("/usr/lib/podman/quadlet"))
                      if p.exists()), None)
    if generator is None:
        pytest.skip("Podman's quadlet generator is not installed here (Podman 4.4 and later ship it)")
    units = tmp_path / "units"
    units.mkdir()
    (units / f"{name}.container").write_text(unit)
    out = tmp_path / "out"
    out.mkdir()
    parsed = subprocess.run([str(generator), "-user", "-dryrun"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "QUADLET_UNIT_DIRS": str(units)}, check=False)
    assert parsed.returncode == 0 and "podman run" in parsed.stdout, parsed.stderr
    assert "--health-cmd" in parsed.stdout


def test_served_container_has_a_podman_health_check(podman: str, llama_image: str, demo_model: Path, name: str,
                                                     port: int) -> None:
    """`podman healthcheck run` passes on a served container, whose image has no HTTP client of its own;
    the same check fails where nothing answers."""
    serve_json(str(demo_model), "--transport", "none", "-p", str(port), "-n", name, "--timeout", "120")
    config = json.loads(podman_remote(podman, "inspect", name, "--format", "{{json .Config.Healthcheck}}").stdout)
    assert config["Test"] == ["CMD", "/app/bin/apirctl-health", "8000"]
    assert config["StartPeriod"] == 120 * 10**9 and config["Retries"] == 3
    check = podman_remote(podman, "healthcheck", "run", name)
    assert check.returncode == 0, check.stdout + check.stderr
    health = json.loads(podman_remote(podman, "inspect", name, "--format", "{{json .State.Health}}").stdout)
    assert health["Status"] == "healthy" and 'HTTP 200 {"status":"ok"}' in health["Log"][-1]["Output"]
    elsewhere = podman_remote(podman, "exec", name, "/app/bin/apirctl-health", "8001")
    assert elsewhere.returncode == 1 and "cannot connect to 127.0.0.1:8001" in elsewhere.stdout
    assert apirctl("stop", name).returncode == 0


def test_restart_policy(podman: str, llama_image: str, demo_model: Path, name: str, port: int) -> None:
    bad = apirctl("serve", str(demo_model), "--restart", "sometimes", "--port", str(port), "--name", name)
    assert bad.returncode == 1 and "not a Podman restart policy" in bad.stderr and not container_exists(name)
    serve_json(str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
               "--restart", "on-failure:2")
    policy = podman_remote(podman, "inspect", name, "--format", "{{json .HostConfig.RestartPolicy}}")
    assert json.loads(policy.stdout) == {"Name": "on-failure", "MaximumRetryCount": 2}
    assert apirctl("stop", name).returncode == 0


def test_run_opens_a_session_and_exit_stops_the_server(podman: str, llama_image: str, demo_model: Path, name: str,
                                                       port: int) -> None:
    import pexpect

    from tests.support.chat_helpers import apirctl_command

    command = apirctl_command()
    child = pexpect.spawn(command[0], [*command[1:], "run", str(demo_model), "--port", str(port), "--name", name,
                                       "--transport", "none", "--temp", "0", "--max-tokens", "6"],
                          env=dict(os.environ, TERM="xterm", NO_COLOR="1", COLUMNS="120"), encoding="utf-8",
                          timeout=300, dimensions=(40, 120))
    try:
        child.expect_exact(">>> ")
        assert container_exists(name)
        child.sendline("Say hi.")
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert not container_exists(name)
