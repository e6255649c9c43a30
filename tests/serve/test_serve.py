"""serve, ps, logs, stop for real: podman, the local llama.cpp image and the demo model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from apirctl.remoting import apir_hosts
from tests.serve.conftest import apirctl, container_exists
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

OUR_LABELS = ("apirctl.version", "apirctl.model", "apirctl.transport")
UPSTREAM_LABELS = ("llama-cpp.apir", "api", "ai-lab-inference-server", "gpu", "trackingId", "docs")


def _one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("apirctl: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_serve_answers_and_ps_logs_stop(served: dict[str, object], name: str, port: int) -> None:
    from apirctl.podman import engine

    url = f"http://127.0.0.1:{port}/v1"
    assert served["name"] == name and served["url"] == url and served["health"] == "ok"
    assert [p["name"] for p in served["phases"]] == ["model", "image", "container", "loading model"]  # type: ignore[index, union-attr]
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok"
    answer = httpx.post(f"{url}/chat/completions", timeout=120,
                        json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"].strip()

    ps = apirctl("ps", "--json")
    assert ps.returncode == 0, ps.stderr
    row = next(s for s in json.loads(ps.stdout) if s["name"] == name)
    assert (row["url"], row["transport"], row["state"]) == (url, "none", "running")
    assert (row["health"], row["port"], row["managed"]) == ("ok", port, True)
    plain = apirctl("ps")
    assert name in plain.stdout and url in plain.stdout

    container = engine.client().containers.get(name)
    labels = container.labels
    for key in OUR_LABELS + UPSTREAM_LABELS:
        assert key in labels, key
    assert labels["api"] == url and labels["apirctl.transport"] == "none"
    assert labels["llama-cpp.apir"] == "false"  # only a virtgpu server is an API-remoting one
    assert json.loads(labels["ai-lab-inference-server"])
    bindings = container.attrs["HostConfig"]["PortBindings"]["8000/tcp"]
    assert bindings == [{"HostIp": "127.0.0.1", "HostPort": str(port)}]  # loopback only

    logs = apirctl("logs", name, "--tail", "5")
    assert logs.returncode == 0 and 0 < len(logs.stdout.splitlines()) <= 5

    stop = apirctl("stop", name, "--json")
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout) == {"stopped": [name]}
    assert not container_exists(name)


def test_second_serve_on_the_same_port_fails_cleanly(served: dict[str, object], demo_model: Path, port: int) -> None:
    other = f"{served['name']}-2"
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", other)
    assert done.returncode != 0
    line = _one_line_error(done.stderr)
    assert f"port {port}" in line and "in use" in line and str(served["name"]) in line
    assert not container_exists(other)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200  # the first one lives on


def test_bad_llama_server_flag_shows_log_tail_and_cleans_up(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--", "--no-such-flag")
    assert done.returncode == 1
    assert "--no-such-flag" in done.stderr.split("apirctl: error:")[0]  # llama-server's own words, first
    assert "exited" in _one_line_error(done.stderr)
    assert not container_exists(name)


def test_corrupt_gguf_is_refused_before_any_container(podman: str, llama_image: str, tmp_path: Path, name: str,
                                                      port: int) -> None:
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF" + os.urandom(4096))  # right magic, garbage after it: the header check refuses
    done = apirctl("serve", str(model), "--transport", "none", "--port", str(port), "--name", name)
    assert done.returncode == 1
    assert "GGUF" in _one_line_error(done.stderr)
    assert not container_exists(name)


def test_non_gguf_file_is_refused_before_any_container(podman: str, tmp_path: Path, name: str, port: int) -> None:
    model = tmp_path / "notes.gguf"
    model.write_text("this is not a model\n")
    done = apirctl("serve", str(model), "--transport", "none", "--port", str(port), "--name", name)
    assert done.returncode != 0
    assert "not a GGUF file" in _one_line_error(done.stderr)
    assert not container_exists(name)


@pytest.mark.parametrize("bad_port", ["80", "70000"])
def test_bad_port_is_refused(podman: str, demo_model: Path, name: str, bad_port: str) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", bad_port, "--name", name)
    assert done.returncode != 0
    assert "port" in _one_line_error(done.stderr)
    assert not container_exists(name)


def test_missing_model_is_refused(podman: str, tmp_path: Path, name: str) -> None:
    done = apirctl("serve", str(tmp_path / "absent.gguf"), "--transport", "none", "--port", str(free_port()),
                   "--name", name)
    assert done.returncode != 0
    assert "absent.gguf" in _one_line_error(done.stderr)


def test_virtgpu_on_linux_serves_through_an_apir_host_of_its_own(podman: str, llama_image: str, demo_model: Path,
                                                                  name: str, port: int) -> None:
    """APIR without a VM (tests/remoting/test_apir_transport.py has the rest); `stop` leaves nothing."""
    done = apirctl("serve", str(demo_model), "--transport", "virtgpu", "--port", str(port), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    served = json.loads(done.stdout)
    assert served["transport"] == "virtgpu" and served["apir_host"]
    assert apirctl("stop", name).returncode == 0
    assert not container_exists(name)
    assert apir_hosts.hosts() == [], "its host went with it"


def test_keep_leaves_the_failed_container_for_inspection(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--keep", "--", "--no-such-flag")
    assert done.returncode == 1
    ps = json.loads(apirctl("ps", "--all", "--json").stdout)
    row = next(s for s in ps if s["name"] == name)
    assert row["state"] == "exited" and row["health"] == "-" and row["why"] == "exited (code 1)"
    assert name not in [s["name"] for s in json.loads(apirctl("ps", "--json").stdout)]
    logs = apirctl("logs", name)
    assert "--no-such-flag" in logs.stdout
    assert apirctl("stop", name).returncode == 0
    assert not container_exists(name)


def test_stop_unknown_name_fails(podman: str) -> None:
    done = apirctl("stop", "no-such-server-here")
    assert done.returncode == 1
    assert "no-such-server-here" in _one_line_error(done.stderr)


def test_foreground_ctrl_c_stops_and_removes(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    import sys

    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "apirctl", "serve", str(demo_model), "--transport", "none",
                                           "--port", str(port), "--name", name, "--foreground"],
                          env=dict(os.environ), timeout=180, encoding="utf-8")
    child.expect("following the server's log")
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
               json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    child.expect("eval time")  # the request's timings show up in the followed log
    child.sendintr()
    child.expect(f"stopped {name}")
    child.expect(pexpect.EOF)
    assert not container_exists(name)


def test_auto_transport_says_what_it_chose(podman: str, llama_image: str, demo_model: Path, name: str,
                                           port: int) -> None:
    from apirctl.remoting import transport

    expected = transport.plan("auto")
    done = apirctl("serve", str(demo_model), "--port", str(port), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["transport"] == expected.transport
    assert printed["notice"] == expected.notice  # --json carries the line
    assert f"notice: {expected.notice}" in done.stderr  # auto always says what it chose and why
    if expected.transport == "none":
        assert any(why in done.stderr for why in ("remoting is not ready", "backend is ready, but",
                                                  "computes on the CPU too"))
    assert apirctl("stop", name).returncode == 0


def test_upstream_extension_server_is_listed_and_blocks_a_second_virtgpu(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    """A container labelled the way the Podman Desktop extension labels its API-remoting server."""
    from apirctl import serve
    from apirctl.errors import ApirctlError
    from apirctl.podman import containers
    from apirctl.remoting import transport
    from apirctl.serve import provision

    url = f"http://127.0.0.1:{port}/v1"
    api = containers.connect()
    container_id = api.create(containers.ContainerSpec(
        image=llama_image, name=name,
        command=["--model", "/models/m.gguf", "--host", "0.0.0.0", "--port", "8000"],
        mounts=[containers.BindMount(source=demo_model, target="/models/m.gguf")],
        ports={8000: ("127.0.0.1", port)},
        labels={"llama-cpp.apir": "true", "api": url, "ai-lab-inference-server": json.dumps([str(demo_model.parent)]),
                "gpu": "llama.cpp API Remoting", "trackingId": "t"},
    ))
    api.start(container_id, name)
    listed = next(s for s in serve.list_servers() if s.name == name)
    assert (listed.managed, listed.transport, listed.url, listed.port) == (False, "virtgpu", url, port)
    assert serve.find_server(name).id == container_id
    with pytest.raises(ApirctlError, match=f"already running: {name}") as err:
        provision._one_virtgpu_at_a_time(transport.virtgpu_plan(999))
    assert err.value.hint and f"apirctl stop {name}" in err.value.hint
    provision._one_virtgpu_at_a_time(transport.Plan(transport="none", requested="none"))  # other transports may run


def test_api_key_protects_the_api_but_not_health(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--api-key", "s3cret", "--ctx-size", "1024", "--json")
    assert done.returncode == 0, done.stderr
    models = f"http://127.0.0.1:{port}/v1/models"
    assert httpx.get(models, timeout=10).status_code == 401
    assert httpx.get(models, timeout=10, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    row = next(s for s in json.loads(apirctl("ps", "--json").stdout) if s["name"] == name)
    assert row["health"] == "ok"  # /health stays public, so ps can still tell


def test_every_interface_is_reachable_on_loopback_too(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    """`--host-ip 0.0.0.0` publishes on every interface, loopback included (with Podman 4's netavark
    an explicit 0.0.0.0 used to publish on no address at all)."""
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--host-ip", "0.0.0.0", "--ctx-size", "1024", "--json", "--timeout", "120")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["url"] == f"http://127.0.0.1:{port}/v1"
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    row = next(s for s in json.loads(apirctl("ps", "--json").stdout) if s["name"] == name)
    assert row["health"] == "ok"


def test_the_port_of_a_stopped_server_is_free_at_once(
    podman: str, llama_image: str, demo_model: Path, name: str, port: int
) -> None:
    """A server that just stopped leaves connections in TIME_WAIT on its port for a minute (with
    slirp4netns' forwarder, every health poll answered before llama-server listened does): they must
    not make the next serve on that port fail. A listening server still does (see the test above)."""
    import socket

    with socket.socket() as listener:  # a server side that closes first: its end stays in TIME_WAIT
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()
            client.recv(1)
    with socket.socket() as probe, pytest.raises(OSError):  # the condition: a plain bind fails
        probe.bind(("127.0.0.1", port))
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--ctx-size", "1024", "--json")
    assert done.returncode == 0, done.stderr
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
