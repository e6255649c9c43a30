"""The resident process: off unless turned on, and where on, a stalled, stopped or vanished peer on
either side of its socket never blocks a command, runs one twice, or leaves one running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl import resident
from tests.support.openai_fake import FakeChatServer
from tests.support.peers import Peer
from tests.support.sweep import Outcome, sweep
from tests.support.waiting import wait_for


@pytest.fixture
def run_dir(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A resident directory of the test's own (so the suite's resident process is never involved);
    whatever resident process the test started is stopped afterwards."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("APIRCTL_RESIDENT_DIR", str(directory))
    yield directory
    for sock in directory.glob("*.sock"):
        resident.stop(str(sock))


def state() -> dict[str, object]:
    return dict(json.loads(sweep("resident", "status", "--json").stdout))


#: Deadlines for what a loaded machine makes slow (a fork, a child's exit): waits end at the condition.
SLOW = 120
#: The caller's wait for the resident process to take a command, for tests that need it to run there:
#: under load the default (2 s) passes and the caller runs the command itself.
PATIENT = {"APIRCTL_RESIDENT_ANSWER_SECONDS": str(SLOW)}


def started(env: dict[str, str] | None = None) -> dict[str, object]:
    sweep("--version", env=env).succeeds()
    wait_for("the resident process", lambda: state()["running"], SLOW)
    return state()


def spawned(directory: Path) -> bool:
    """Whether a command asked for a resident process (the client opens its log before starting one)."""
    return any(directory.glob("*.log"))


def command_child(resident_pid: int, cwd: Path) -> str | None:
    """The resident process's child running a command from `cwd` (spares run in '/')."""
    children = subprocess.run(["pgrep", "-P", str(resident_pid)], capture_output=True, text=True).stdout.split()
    for child in children:
        try:
            if os.readlink(f"/proc/{child}/cwd") == str(cwd):
                return child
        except OSError:
            continue
    return None


def test_off_by_default(run_dir: Path) -> None:
    sweep("--version").succeeds()
    out = sweep("resident", "status")
    assert out.code == 1 and "off (turn it on with APIRCTL_RESIDENT=1" in out.stdout
    assert not spawned(run_dir)


def test_config_turns_it_on_and_the_variable_wins(run_dir: Path) -> None:
    sweep("config", "set", "resident", "true").succeeds()
    assert started()["running"]
    sweep("resident", "stop").succeeds()
    for log in run_dir.glob("*.log"):
        log.unlink()
    sweep("--version", env={"APIRCTL_RESIDENT": "0"}).succeeds()
    assert not spawned(run_dir)


def test_resident_stop_with_none_running_starts_none(run_dir: Path) -> None:
    out = sweep("resident", "stop", env={"APIRCTL_RESIDENT": "1"}).succeeds()
    assert "no resident process was running" in out.stdout
    assert sweep("resident", "status", env={"APIRCTL_RESIDENT": "1"}).code == 1
    assert not spawned(run_dir)


def test_a_stalled_connection_blocks_no_command(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_RESIDENT", "1")
    found = started()
    stalled = []
    for _ in range(20):  # more than the listen backlog's worth of callers that send half a request
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(found["socket"]))
        conn.sendall(b"\x00\x00")
        stalled.append(conn)
    sweep("--version").succeeds()
    assert state()["served"] == int(str(found["served"])) + 1  # it ran there, past the stalled callers
    for conn in stalled:  # each is dropped at the request deadline
        conn.settimeout(30)
        assert conn.recv(1) == b""
        conn.close()


def test_a_resident_that_does_not_answer_is_bypassed_and_the_command_runs_once(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIRCTL_RESIDENT", "1")
    found = started()
    pid = int(str(found["pid"]))
    server = FakeChatServer("four").start()
    os.kill(pid, signal.SIGSTOP)  # a resident process that hangs
    try:
        out = sweep("chat", "--url", server.url, "--prompt", "2+2?", cwd=tmp_path).succeeds()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "four" in out.stdout
    # Resumed, it takes the abandoned request; its child finds the caller gone and never runs it.
    wait_for("the late request", lambda: state()["served"] == int(str(found["served"])) + 1, SLOW)
    wait_for("the abandoned child's exit", lambda: command_child(pid, tmp_path) is None, SLOW)
    assert len(server.requests) == 1
    server.stop()


def test_a_sigkilled_client_stops_its_command(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_RESIDENT", "1")
    for key, value in PATIENT.items():  # the chat must run in the resident process, however slow it is
        monkeypatch.setenv(key, value)
    found = started()
    peer = Peer("endless").start()
    client = subprocess.Popen([sys.executable, "-m", "apirctl", "chat", "--url", peer.url, "--prompt", "go on"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    wait_for("the chat request", lambda: peer.requests == 1, SLOW)
    child = command_child(int(str(found["pid"])), tmp_path)
    assert child is not None, "the chat did not run in the resident process"
    client.kill()
    client.wait()
    assert peer.hung_up.wait(SLOW), "the command went on streaming after its client was killed"
    wait_for("the command's exit", lambda: not os.path.exists(f"/proc/{child}"), SLOW)
    peer.stop()


@pytest.mark.parametrize("option", ["--show-completion", "--install-completion"])
def test_completion_works_with_the_resident_process_on(run_dir: Path, tmp_path: Path, option: str) -> None:
    """Completion finds the shell from apirctl's parent process: a shell here, as a user's is."""
    env = {**os.environ, "APIRCTL_RESIDENT": "1", "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    sweep("--version", env=env).succeeds()
    wait_for("the resident process", lambda: state()["running"], 60)
    line = " ".join([sys.executable, "-m", "apirctl", option])
    done = subprocess.run(["bash", "-c", f"{line}; exit $?"], capture_output=True, text=True, env=env, timeout=60)
    out = Outcome((option,), done.returncode, done.stdout, done.stderr).succeeds()
    assert "not supported" not in out.stdout + out.stderr
    if option == "--show-completion":
        assert "complete" in out.stdout and "_APIRCTL_COMPLETE" in out.stdout
    else:
        assert "apirctl" in (tmp_path / ".bashrc").read_text()


def test_bash_completion_script_completes_with_the_resident_process_on(run_dir: Path, tmp_path: Path) -> None:
    """`apirctl --show-completion bash` as a user types it, the resident on: the real script, and bash,
    having loaded it, completes commands and options through apirctl."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "APIRCTL_RESIDENT": "1", "HOME": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    assert started(env)["running"]
    shown = subprocess.run(["apirctl", "--show-completion", "bash"], capture_output=True, text=True, env=env,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "complete -o default -F _apirctl_completion apirctl" in shown.stdout
    assert "_APIRCTL_COMPLETE=complete_bash" in shown.stdout and "not supported" not in shown.stderr
    script = shown.stdout + (
        '\nCOMP_WORDS=(apirctl se); COMP_CWORD=1; _apirctl_completion apirctl; echo "${COMPREPLY[*]}"'
        '\nCOMP_WORDS=(apirctl chat --p); COMP_CWORD=2; _apirctl_completion apirctl; echo "${COMPREPLY[*]}"\n'
    )
    completed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert completed.returncode == 0, completed.stderr
    commands, options = completed.stdout.splitlines()
    assert commands.split() == ["serve", "setup"]
    assert {"--port", "--prompt", "--plain"} <= set(options.split())
    assert state()["running"], "the resident process is still there"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_gets_nothing_from_the_socket(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_RESIDENT", "1")
    found = started()
    child = os.fork()
    if child == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(str(found["socket"]))
            except PermissionError:
                os._exit(7)
            os._exit(0)
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 7
    assert state()["served"] == found["served"]
