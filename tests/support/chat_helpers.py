"""Helpers of the chat tests: a real llama-server process on the loopback, and the real CLI."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.ports import free_port

CTX_SIZE = 2048
READY_TIMEOUT = 120.0
# A terminal's size comes from the terminal. These may be in this process's C environment without
# being in os.environ: GNU readline, imported in a process without a terminal (the test run imports
# it), sets them to 80x24 there, and child processes inherit them.
UNSET = ("-u", "LINES", "-u", "COLUMNS")
PROMPT_LINE = re.compile(r"^>>>(?: |$)", re.M)  # a prompt, as a screen capture shows it (no trailing spaces)


@dataclass
class LlamaServer:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.origin}/v1"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_llama_server(build: Any, model: Path, log: Path, port: int | None = None,
                       show_prompts: bool = False) -> LlamaServer:
    """Start llama-server bound to 127.0.0.1; the caller waits for it (see `wait_ready`).

    `show_prompts`: `GET /slots` also gives each slot's last prompt, as the server tokenized it
    (`LLAMA_SERVER_SLOTS_DEBUG`), which is how a test sees exactly what a request made of its messages.
    """
    port = port or free_port()
    cmd = [
        str(build.binary("llama-server")),
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(CTX_SIZE),
        "--parallel", "1",
        "--threads", "2",
        "--no-webui",
    ]  # fmt: skip
    handle = log.open("wb")
    env = dict(os.environ, **({"LLAMA_SERVER_SLOTS_DEBUG": "1"} if show_prompts else {}))
    process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    handle.close()
    return LlamaServer(process=process, port=port, log=log)


def wait_ready(server: LlamaServer, timeout: float = READY_TIMEOUT) -> None:
    """Poll /health until it says ok (llama-server answers 503 while the model loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"llama-server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.origin}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"llama-server not ready after {timeout} s:\n{server.log_tail()}")


def last_prompt(server: LlamaServer) -> str:
    """The prompt of the server's last request, as it tokenized it (needs `show_prompts`)."""
    slot = httpx.get(f"{server.origin}/slots", timeout=30).json()[0]
    assert "prompt" in slot, "llama-server was started without show_prompts"
    return str(slot["prompt"])


def templated(server: LlamaServer, messages: list[dict[str, str]]) -> str:
    """The prompt the server makes of `messages` with its model's chat template (`POST /apply-template`)."""
    response = httpx.post(f"{server.origin}/apply-template", json={"messages": messages}, timeout=30)
    response.raise_for_status()
    return str(response.json()["prompt"])


def stop(server: LlamaServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def apirctl_command() -> list[str]:
    """The installed CLI of this checkout, run as users run it."""
    script = Path(sys.executable).parent / "apirctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "apirctl"]


def run_chat(*args: str, stdin: str | None = None, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """`apirctl chat ARGS` in a subprocess (stdin is a pipe, so never interactive)."""
    return subprocess.run(
        [*apirctl_command(), "chat", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


class Tmux:
    """A command in a pane of a tmux server of its own: a real terminal emulator, so what the screen
    shows (after cursor moves, erasing, wrapping) and the scrollback can be read back as a user sees
    them, and pastes arrive the way a terminal sends them (bracketed, when the program asks)."""

    def __init__(self, workdir: Path, command: list[str], env: dict[str, str] | None = None,
                 width: int = 100, height: int = 30) -> None:
        self.workdir = workdir
        self.socket = workdir / "tmux.sock"
        self.status = workdir / "exit-status"
        config = workdir / "tmux.conf"
        # The pane stays after its command exits, so that what it printed last can be read.
        config.write_text("set -g remain-on-exit on\nset -g history-limit 10000\n")
        environment = [f"{key}={value}" for key, value in (env or {}).items()]
        # The shell that waits for the command ignores Ctrl-C (its own, a trap: the command gets the default).
        script = f'trap : INT; "$@"; echo $? > {shlex.quote(str(self.status))}'
        self._tmux("-f", str(config), "new-session", "-d", "-x", str(width), "-y", str(height),
                   shlex.join(["sh", "-c", script, "sh", "env", *UNSET, *environment, *command]))

    def _tmux(self, *args: str, input: str | None = None) -> str:  # noqa: A002 - subprocess's name
        done = subprocess.run(["tmux", "-S", str(self.socket), *args], capture_output=True, text=True,
                              input=input, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"tmux {args[0]} failed: {done.stderr.strip()}")
        return done.stdout

    def type(self, text: str) -> None:
        """Keys typed one by one (no Enter)."""
        self._tmux("send-keys", "-l", text)

    def line(self, text: str = "") -> None:
        """A line typed and Enter."""
        if text:
            self.type(text)
        self._tmux("send-keys", "Enter")

    def keys(self, *names: str) -> None:
        """Named keys: C-c, C-d, Up, Enter."""
        self._tmux("send-keys", *names)

    def paste(self, text: str) -> None:
        """Paste as a terminal does: bracketed when the program turned bracketed paste on."""
        self._tmux("load-buffer", "-b", "test", "-", input=text)
        self._tmux("paste-buffer", "-p", "-d", "-b", "test")

    def screen(self, escapes: bool = False) -> str:
        """The visible screen; with `escapes`, with its colours and attributes as SGR sequences."""
        return self._tmux("capture-pane", "-p", *(["-e"] if escapes else []))

    def scrollback(self) -> str:
        """Everything the pane ever scrolled away plus the screen, wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-E", "-")

    def wait(self, pattern: str, timeout: float = 180.0, context: Callable[[], str] | None = None) -> str:
        """Poll until `pattern` (a regex) is found on the screen; return the screen. On a timeout the
        failure shows the scrollback, and what `context` says (what else the test knows)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if re.search(pattern, text, re.M):
                return text
            if time.monotonic() > deadline:
                extra = f"\n{context()}" if context else ""
                pytest.fail(f"{pattern!r} never appeared; the pane shows:\n{self.scrollback()}{extra}")
            time.sleep(0.05)

    def wait_text(self, text: str, timeout: float = 180.0, context: Callable[[], str] | None = None) -> str:
        """Poll until the scrollback (wrapped lines joined) holds `text`; return the scrollback."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.scrollback()
            if text in shown:
                return shown
            if time.monotonic() > deadline:
                extra = f"\n{context()}" if context else ""
                pytest.fail(f"{text!r} never appeared; the pane shows:\n{shown}{extra}")
            time.sleep(0.05)

    def wait_prompt(self, count: int, timeout: float = 180.0) -> str:
        """Wait until the scrollback holds `count` prompts, the last one empty (the session waits for input)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.scrollback().rstrip()
            if len(PROMPT_LINE.findall(text)) >= count and text.endswith(">>>"):
                return text
            if time.monotonic() > deadline:
                pytest.fail(f"no prompt number {count}; the pane shows:\n{text}")
            time.sleep(0.05)

    def exit_status(self, timeout: float = 180.0) -> int:
        """Wait for the command to end; its exit status."""
        deadline = time.monotonic() + timeout
        while True:
            if self.status.exists() and self.status.read_text().strip():
                return int(self.status.read_text())
            if time.monotonic() > deadline:
                pytest.fail(f"the command did not end; the pane shows:\n{self.scrollback()}")
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], capture_output=True, timeout=30)


def resident_served() -> int | None:
    """How many commands the suite's resident apirctl process has run; None when none runs."""
    done = subprocess.run([*apirctl_command(), "resident", "status", "--json"], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, APIRCTL_RESIDENT="0"))
    found = json.loads(done.stdout)
    return int(found["served"]) if found.get("running") and "served" in found else None


def start_resident(timeout: float = 180.0) -> int:
    """Make sure the resident process runs (any command spawns it); how many commands it has run."""
    subprocess.run([*apirctl_command(), "--version"], capture_output=True, timeout=180,
                   env=dict(os.environ, APIRCTL_RESIDENT="1"))
    deadline = time.monotonic() + timeout
    while (served := resident_served()) is None:
        if time.monotonic() > deadline:
            pytest.fail("the resident apirctl process did not start")
        time.sleep(0.2)
    return served
