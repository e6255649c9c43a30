"""The resident apirctl process (apirctl.resident), with real processes: commands run in forks of a
warm interpreter with the caller's arguments, environment, directory, stdio, signals and exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apirctl as apirctl_package
from apirctl import resident
from tests.support.waiting import wait_for

PACKAGE = Path(apirctl_package.__file__).resolve().parent
CHECKOUT = PACKAGE.parent  # this checkout's apirctl, as `python -m` finds it


def apirctl(*args: str, env: dict[str, str] | None = None, **kwargs: object) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("cwd", CHECKOUT)
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=120, **kwargs)  # type: ignore[call-overload]


def wait_running(env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 180) -> dict[str, object]:
    """Start the resident process (any command spawns it) and wait until it answers."""
    deadline = time.monotonic() + timeout
    where = {"cwd": cwd} if cwd else {}
    apirctl("--version", env=env, **where)
    while time.monotonic() < deadline:
        proc = apirctl("resident", "status", "--json", env=env, **where)
        found = json.loads(proc.stdout)
        if found["running"]:
            return dict(found)
        time.sleep(0.2)
    raise AssertionError("the resident process did not start")


@pytest.fixture(autouse=True)
def resident_on(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resident process is off by default: these tests turn it on, as a user does. They check what
    happens in its fork, so the caller waits as long as the fork takes on a loaded machine (by default it
    gives up after 2 s and runs the command itself)."""
    monkeypatch.setenv("APIRCTL_RESIDENT", "1")
    monkeypatch.setenv("APIRCTL_RESIDENT_ANSWER_SECONDS", "120")


@pytest.fixture
def running(resident_dir: Path) -> dict[str, object]:
    return wait_running()


def served(env: dict[str, str] | None = None) -> int:
    return int(json.loads(apirctl("resident", "status", "--json", env=env).stdout)["served"])


def test_commands_run_in_the_resident_process_with_the_callers_environment(running: dict[str, object]) -> None:
    before = served()
    env = {**os.environ, "APIRCTL_THREADS": "3"}
    proc = apirctl("config", "show", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["settings"]["threads"] == {"value": 3, "source": "environment"}
    # One fork for `config show` (`resident status` runs in its own process).
    assert served() == before + 1
    # The environment of one command does not leak into the next.
    again = json.loads(apirctl("config", "show", "--json").stdout)
    assert again["settings"]["threads"]["value"] is None


def test_exit_status_stderr_and_working_directory_are_the_callers(running: dict[str, object], tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_text("not a model")
    through = apirctl("models", "inspect", "bad.gguf", cwd=tmp_path)  # a relative path: resolved in the caller's cwd
    direct = apirctl("models", "inspect", "bad.gguf", cwd=tmp_path, env={**os.environ, "APIRCTL_RESIDENT": "0"})
    assert through.returncode == direct.returncode != 0
    assert through.stderr == direct.stderr
    assert "bad.gguf" in through.stderr and "Traceback" not in through.stderr


def test_stdin_is_the_callers(running: dict[str, object]) -> None:
    """`chat` with a pipe reads its prompt from stdin, then fails to reach the (closed) port: the same
    outcome as without the resident process, so the prompt was read from the caller's pipe."""
    args = ("chat", "--url", "http://127.0.0.1:9/v1")
    proc = apirctl(*args, input="hello")
    direct = apirctl(*args, input="hello", env={**os.environ, "APIRCTL_RESIDENT": "0"})
    assert proc.returncode == direct.returncode != 0
    assert proc.stderr == direct.stderr and "127.0.0.1:9" in proc.stderr
    empty = apirctl(*args, input="")
    assert empty.stderr != proc.stderr  # the prompt made a difference


def test_sigterm_reaches_the_command_and_it_cleans_up(running: dict[str, object], tmp_path: Path) -> None:
    """`kill` of the apirctl process stops the command running in the fork (exit 130), not just the client."""
    pid = int(str(running["pid"]))
    # `chat` with stdin on a pipe reads the whole prompt first: it blocks until the signal.
    proc = subprocess.Popen([sys.executable, "-m", "apirctl", "chat", "--url", "http://127.0.0.1:9/v1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)

    def command_process() -> str | None:
        """The resident process's child that took the caller's working directory (spares have '/')."""
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        for child in found:
            try:
                if os.readlink(f"/proc/{child}/cwd") == str(tmp_path):
                    return child
            except OSError:
                continue
        return None

    command = wait_for("the command in a fork of the resident process", command_process, 120, interval=0.05)
    proc.send_signal(signal.SIGTERM)
    # stdin stays open until the client has exited: closed first (as communicate() does), the command
    # reads the end of its prompt and may exit on its own before the signal reaches it
    proc.wait(timeout=120)
    assert proc.stdin is not None and proc.stderr is not None
    err = proc.stderr.read()
    proc.stdin.close()
    assert proc.returncode == 130, err  # as without the resident process: typer's status for an interrupt
    wait_for("the command's exit", lambda: not os.path.exists(f"/proc/{command}"), 120, interval=0.05)


def test_the_entry_point_imports_no_cli_framework() -> None:
    code = "import apirctl.cli, sys; print(','.join(m for m in ('typer', 'pydantic', 'rich') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_changed_code_is_never_served_stale(tmp_path: Path) -> None:
    """A copy of apirctl gets its own resident process; editing one of its files retires it."""
    copy = tmp_path / "site"
    shutil.copytree(PACKAGE, copy / "apirctl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(copy), "APIRCTL_RESIDENT_DIR": str(tmp_path / "run")}
    first = wait_running(env, cwd=tmp_path)
    marker = copy / "apirctl" / "errors.py"
    marker.write_text(marker.read_text() + "\n# edited\n")
    apirctl("--version", env=env, cwd=tmp_path)  # finds the resident stale: it exits, the command runs by itself
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{first['pid']}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{first['pid']}")
    second = wait_running(env, cwd=tmp_path)
    assert second["pid"] != first["pid"]
    apirctl("resident", "stop", env=env, cwd=tmp_path)


def test_off_switch(resident_dir: Path) -> None:
    env = {**os.environ, "APIRCTL_RESIDENT": "0"}
    apirctl("resident", "stop")
    apirctl("--version", env=env)
    time.sleep(1)
    proc = apirctl("resident", "status", "--json", env=env)
    assert proc.returncode == 1
    assert json.loads(proc.stdout) | {"socket": ""} == {"running": False, "socket": "", "enabled": False}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_run_commands(running: dict[str, object]) -> None:
    before = served()
    child = os.fork()
    if child == 0:  # another user, same machine: the private directory keeps it out
        try:
            os.setgid(65534)
            os.setuid(65534)
            os._exit(7 if resident.run(["--version"]) is None else 0)
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 7
    assert served() == before  # nothing ran for the other user


def test_interpreter_options_keep_the_command_in_its_own_process(running: dict[str, object]) -> None:
    """`python -X importtime -m apirctl` must measure this process's imports, not a warm one's."""
    before = served()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "apirctl", "--version"], capture_output=True,
                          text=True, cwd=CHECKOUT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "import time:" in proc.stderr and "typer" in proc.stderr
    assert served() == before  # the command ran in its own process


def test_python_variables_choose_their_own_resident_process(running: dict[str, object]) -> None:
    """Variables the interpreter reads at start-up (PYTHON*, the locale) are part of what a resident
    process shares with its callers: another value is another process."""
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other = wait_running(env)
    assert other["pid"] != running["pid"] and other["socket"] != running["socket"]
    apirctl("resident", "stop", env=env)
