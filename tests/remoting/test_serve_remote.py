"""`apirctl serve --rpc-backend`: a real CLI, a real backend, a real sshd tunnel, real podman.

The refusal tests need nothing but the CLI: a plain network backend is refused before any model is
fetched, container created or tunnel opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apirctl.remoting import tunnel
from tests.remoting.test_remote_backends import sshd  # noqa: F401 - the real sshd fixture
from tests.support.ports import free_port


def apirctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def ssh_options(args: list[str]) -> list[str]:
    """The sshd fixture's `ssh` arguments (-i KEY, -o K=V) as `--ssh-option K=V` flags."""
    flags: list[str] = []
    pairs = iter(args)
    for flag, value in zip(pairs, pairs, strict=True):
        option = f"IdentityFile={value}" if flag == "-i" else value
        flags += ["--ssh-option", option]
    return flags


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


@pytest.mark.parametrize("backend", ["192.0.2.10:50052", "gpu-box.invalid:50052"])
def test_a_plain_network_backend_is_refused(tmp_path: Path, backend: str) -> None:
    done = apirctl("serve", str(tmp_path / "missing.gguf"), "--rpc-backend", backend, "--port", str(free_port()))
    assert done.returncode != 0
    assert "no authentication" in done.stderr and "Traceback" not in done.stderr
    assert "--via-ssh" in done.stderr  # the hint says what to do instead
    assert not tunnel.tunnels()


def test_rpc_backend_conflicts_with_another_transport(tmp_path: Path) -> None:
    done = apirctl("serve", str(tmp_path / "m.gguf"), "--rpc-backend", "127.0.0.1:50052", "--transport", "none")
    assert done.returncode != 0 and "--rpc-backend uses the rpc transport" in done.stderr
    done = apirctl("serve", str(tmp_path / "m.gguf"), "--via-ssh", "me@gpu-box")
    assert done.returncode != 0 and "only apply with --rpc-backend" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def name(podman: str) -> Iterator[str]:
    from podman.errors import NotFound

    from apirctl.podman import engine

    value = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    yield value
    with contextlib.suppress(NotFound):
        engine.client().containers.get(value).remove(force=True)
    tunnel.close([t.pid for t in tunnel.tunnels()])


@pytest.mark.integration
def test_serve_through_an_ssh_tunnel_answers_and_stop_closes_it(
    backend: int, sshd: tuple[str, list[str]], podman: str, llama_image: str, demo_model: Path,  # noqa: F811
    name: str,
) -> None:
    via, args = sshd
    done = apirctl("serve", str(demo_model), "--rpc-backend", f"127.0.0.1:{backend}", "--via-ssh", via,
                   *ssh_options(args), "--port", str(free_port()), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)
    assert server["transport"] == "rpc" and server["rpc_backends"] == [f"127.0.0.1:{backend}"]
    (opened,) = tunnel.tunnels()
    assert server["tunnels"] == [opened.pid] and opened.target == f"127.0.0.1:{backend}"

    reply = httpx.post(f"{server['url']}/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]

    ps = apirctl("ps", "--json")
    row = next(r for r in json.loads(ps.stdout) if r["name"] == name)
    assert row["health"] == "ok"  # not the local backend's state: this server uses its tunnel

    stopped = apirctl("stop", name)
    assert stopped.returncode == 0, stopped.stderr
    assert not alive(opened.pid) and not tunnel.tunnels()


@pytest.mark.integration
def test_a_failed_serve_closes_its_tunnel(
    backend: int, sshd: tuple[str, list[str]], podman: str, llama_image: str, demo_model: Path,  # noqa: F811
    name: str,
) -> None:
    via, args = sshd
    # a sound model and a flag llama-server refuses: the failure comes after the tunnel is open
    done = apirctl("serve", str(demo_model), "--rpc-backend", f"127.0.0.1:{backend}", "--via-ssh", via,
                   *ssh_options(args), "--port", str(free_port()), "--name", name, "--timeout", "120",
                   "--", "--no-such-flag")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "ssh tunnels" in done.stderr  # the tunnel was opened before the failure
    assert not tunnel.tunnels()


@pytest.mark.integration
def test_ps_says_when_the_tunnel_died(
    backend: int, sshd: tuple[str, list[str]], podman: str, llama_image: str, demo_model: Path,  # noqa: F811
    name: str,
) -> None:
    import signal
    import time

    via, args = sshd
    done = apirctl("serve", str(demo_model), "--rpc-backend", f"127.0.0.1:{backend}", "--via-ssh", via,
                   *ssh_options(args), "--port", str(free_port()), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    (pid,) = json.loads(done.stdout)["tunnels"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pid):  # the tunnel's parent (serve) has exited: init reaps it
        assert time.monotonic() < deadline, "the tunnel did not die"
        time.sleep(0.05)
    row = next(r for r in json.loads(apirctl("ps", "--json").stdout) if r["name"] == name)
    assert row["state"] == "running" and row["health"] == "ssh tunnel down"
    stopped = apirctl("stop", name)
    assert stopped.returncode == 0, stopped.stderr
