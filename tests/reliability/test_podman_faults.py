"""The Podman service going away under a command, with real podman, the image and the demo model.

apirctl's own service (started when nothing else answers) is started again and the command goes
on: containers run without the service. A service the user named (CONTAINER_HOST) is theirs: the
command fails in one line with a hint, and a container it made is removed with the podman command,
which needs no service, so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.test_serve_faults import healthy, port_is_free
from tests.support.ports import free_port
from tests.support.sweep import REPO, Outcome, sweep

pytestmark = pytest.mark.integration


def container_exists(name: str) -> bool:
    """By the podman command on this host's storage (the service the case used may be gone; with
    CONTAINER_HOST set the command would be its client)."""
    from apirctl.podman import engine

    env = {k: v for k, v in engine.podman_env().items() if k != "CONTAINER_HOST"}
    done = subprocess.run(engine.podman_cli("container", "exists", name), env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0


def serve_killing(model: str, name: str, port: int, phase: str, pid: int) -> Outcome:
    """`apirctl serve` that loses its Podman service (`pid`, SIGKILLed) when it prints `phase`."""
    proc = subprocess.Popen([sys.executable, "-m", "apirctl", "serve", model, "--transport", "none", "--port",
                             str(port), "--name", name], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.strip() == f"{phase}...":
            os.kill(pid, signal.SIGKILL)
            break
    out, rest = proc.communicate(timeout=300)
    return Outcome(("serve",), proc.returncode, out, "".join(seen) + rest)


@pytest.fixture
def named_service(llama_image: str, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[bytes]]:
    """A `podman system service` of the test's own (with the containers.conf apirctl's would use),
    named by CONTAINER_HOST; killed afterwards if still running."""
    from apirctl.podman import engine

    sock = tmp_path / "podman.sock"
    service = subprocess.Popen(engine.podman_cli("system", "service", "--time=0", f"unix://{sock}"),
                               env=engine.podman_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"unix://{sock}"
    deadline = time.monotonic() + 30
    while not engine.answers(url):
        assert time.monotonic() < deadline and service.poll() is None, "the test's podman service did not start"
        time.sleep(0.1)
    monkeypatch.setenv("CONTAINER_HOST", url)
    yield service
    service.kill()
    service.wait()


@pytest.fixture
def own_service(llama_image: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """apirctl's own Podman service, in the test's home (stopped by the suite after the test); its pid."""
    from apirctl.podman import engine

    monkeypatch.delenv("CONTAINER_HOST", raising=False)
    sweep("ps").succeeds()  # finds nothing else to talk to, and starts it
    record = engine.service_record()
    if record is None:
        pytest.skip("a Podman service of the system answers here: apirctl starts none of its own")
    return record.pid


@pytest.mark.parametrize("phase", ["container", "loading model"])
def test_own_service_killed_mid_serve_is_started_again(own_service: int, demo_model: Path, phase: str) -> None:
    from apirctl.podman import engine

    name, port = f"rel-svc-{uuid.uuid4().hex[:6]}", free_port()
    out = serve_killing(str(demo_model), name, port, phase, own_service)
    listed = json.loads(sweep("ps", "--json").succeeds().stdout)
    record = engine.service_record()
    assert record is not None and record.pid != own_service  # a new one (serve's, or at the latest ps's)
    if out.code:  # killed in the middle of a change (the create): its outcome is unknown, so serve
        out.fails_cleanly(code=1, says="went away during the call")  # fails, and removes what it made
        assert out.error_lines[-1].startswith("hint: the Podman service stopped"), out.stderr
        assert phase == "container" and not container_exists(name) and port_is_free(port)
        return
    assert "Traceback" not in out.stderr and healthy(f"http://127.0.0.1:{port}/v1")
    assert [s["health"] for s in listed if s["name"] == name] == ["ok"]
    sweep("stop", name).succeeds()
    assert not container_exists(name) and port_is_free(port)


def test_a_named_service_stopped_mid_serve_fails_cleanly_and_leaves_nothing(
    named_service: subprocess.Popen[bytes], demo_model: Path
) -> None:
    name, port = f"rel-svc-{uuid.uuid4().hex[:6]}", free_port()
    out = serve_killing(str(demo_model), name, port, "loading model", named_service.pid)
    out.fails_cleanly(code=1, says=f"the Podman API at {os.environ['CONTAINER_HOST']} ")
    assert "is gone" in out.stderr or "went away during the call" in out.stderr  # (between calls, or in one)
    assert out.error_lines[-1].startswith("hint: the Podman service stopped"), out.stderr
    named_service.wait()
    assert not container_exists(name) and port_is_free(port)
    # the commands after it: one line, the same hint
    for command in (["ps"], ["stop", name]):
        sweep(*command).fails_cleanly(code=1, says=os.environ["CONTAINER_HOST"])


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_ps_after_the_named_service_went_away(named_service: subprocess.Popen[bytes], how: int) -> None:
    """A killed service leaves its socket file (connection refused); a stopped one removes it (no such file)."""
    sweep("ps", "--json").succeeds()
    named_service.send_signal(how)
    named_service.wait()
    out = sweep("ps", "--json").fails_cleanly(code=1, says="does not answer")
    assert out.error_lines[1].startswith("hint:") and not out.stdout
