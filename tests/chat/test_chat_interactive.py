"""The interactive `apirctl chat` in a real pseudo-terminal (pexpect) against a real llama-server."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
import pexpect
import pytest

from tests.support.chat_helpers import LlamaServer, apirctl_command

pytestmark = pytest.mark.integration

PROMPT = ">>> "
QUESTION = "What is the capital of France? Answer in one short sentence."
# At temperature 0 the demo model answers this one at length, so Ctrl-C lands mid-answer.
LONG_QUESTION = "What is the capital of France?"
STATS = re.compile(r"prompt: +(\d+) tokens(?: \(\+(\d+) cached\))?.*?generation: +(\d+) tokens", re.S)
TIMEOUT = 180


def spawn(server: LlamaServer, *args: str) -> pexpect.spawn:
    command = apirctl_command()
    env = dict(os.environ, TERM="xterm", NO_COLOR="1", COLUMNS="120")
    child = pexpect.spawn(
        command[0],
        [*command[1:], "chat", "--url", server.url, "--temperature", "0", *args],
        env=env,
        encoding="utf-8",
        timeout=TIMEOUT,
        dimensions=(40, 120),
    )
    child.expect("apirctl chat")
    child.expect_exact(PROMPT)
    return child


def ask(child: pexpect.spawn, line: str) -> str:
    """Send a line and return what was printed before the next prompt."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    return str(child.before)


def prompt_total(stats: str) -> tuple[int, int]:
    """(prompt tokens incl. cached, generated tokens) from the /stats text."""
    found = STATS.search(stats)
    assert found, stats
    return int(found.group(1)) + int(found.group(2) or 0), int(found.group(3))


def wait_decoding(server: LlamaServer, at_least: int = 2) -> None:
    """Poll the server's /slots until it has generated a few tokens of the current answer."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        slot = httpx.get(f"{server.origin}/slots", timeout=10).json()[0]
        if slot["is_processing"] and slot["next_token"][0]["n_decoded"] >= at_least:
            return
        time.sleep(0.05)
    pytest.fail("the server never started answering")


def test_streamed_answer_stats_multi_turn_and_exit(llama_server: LlamaServer) -> None:
    child = spawn(llama_server, "--max-tokens", "24")
    try:
        expected = httpx.post(
            f"{llama_server.url}/chat/completions",
            json={"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 24},
            timeout=TIMEOUT,
        ).json()["choices"][0]["message"]["content"]
        first = ask(child, QUESTION)
        assert expected.strip() in first.replace("\r\n", "\n")

        stats = ask(child, "/stats")
        assert "(server timings)" in stats
        assert re.search(r"generation: +\d+ tokens, [\d.]+ tokens/s", stats), stats
        turn1_prompt, generated = prompt_total(stats)
        assert 0 < generated <= 24

        ask(child, "And the capital of Germany?")
        turn2_prompt, _ = prompt_total(ask(child, "/stats"))
        assert turn2_prompt > turn1_prompt + generated  # the first turn went along as history

        assert "conversation cleared" in ask(child, "/clear")
        ask(child, QUESTION)
        again, _ = prompt_total(ask(child, "/stats"))
        assert again == turn1_prompt  # exactly the first request again: no history left

        assert "system prompt set" in ask(child, "/system You answer in French.")
        assert "You answer in French." in ask(child, "/system")
        ask(child, QUESTION)
        with_system, _ = prompt_total(ask(child, "/stats"))
        assert with_system != turn1_prompt  # SmolLM2's default system prompt was replaced

        assert "unknown command /nope" in ask(child, "/nope")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_not_the_session(llama_server: LlamaServer) -> None:
    log_before = llama_server.log.read_text(errors="replace").count("cancel task")
    child = spawn(llama_server, "--max-tokens", "1000")
    try:
        child.sendline(LONG_QUESTION)
        wait_decoding(llama_server)
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect_exact(PROMPT)
        # Closing the stream made llama-server cancel the generation.
        deadline = time.monotonic() + 30
        while llama_server.log.read_text(errors="replace").count("cancel task") == log_before:
            assert time.monotonic() < deadline, "llama-server did not cancel the answer"
            time.sleep(0.1)
        stats = ask(child, "/stats")
        assert "the answer was interrupted" in stats

        # Ctrl-C at the prompt only clears the line; the session still answers.
        child.sendintr()
        child.expect("Ctrl-C cancels a line")
        child.expect_exact(PROMPT)
        child.sendline("/system Be brief.")
        child.expect_exact("system prompt set")
        child.expect_exact(PROMPT)
        child.sendeof()  # Ctrl-D leaves like /exit
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_line_history_survives_sessions(llama_server: LlamaServer, isolated_home: Path) -> None:
    """A line typed in one session comes back with the Up arrow in the next (readline + history file)."""
    first = spawn(llama_server)
    try:
        assert "system prompt set" in ask(first, "/system Remember the word heliotrope.")
        first.sendline("/exit")
        first.expect(pexpect.EOF)
    finally:
        first.close(force=True)
    history = isolated_home / "state" / "chat_history"
    assert "/system Remember the word heliotrope." in history.read_text()

    second = spawn(llama_server)
    try:
        second.send("\x1b[A\x1b[A")  # Up twice: past "/exit" to the line before it, from the last session
        second.send("\r")
        second.expect_exact("system prompt set")
        second.expect_exact(PROMPT)
        assert "Remember the word heliotrope." in ask(second, "/system")
        second.sendline("/exit")
        second.expect(pexpect.EOF)
    finally:
        second.close(force=True)
    assert second.exitstatus == 0


def test_errors_do_not_end_the_session(llama_server: LlamaServer) -> None:
    """An unreachable server is reported and the session goes on; the failed turn is not kept."""
    from tests.support.ports import free_port

    command = apirctl_command()
    dead = f"http://127.0.0.1:{free_port()}/v1"
    child = pexpect.spawn(
        command[0],
        [*command[1:], "chat", "--url", dead],
        env=dict(os.environ, TERM="xterm", NO_COLOR="1"),
        encoding="utf-8",
        timeout=TIMEOUT,
        dimensions=(40, 120),
    )
    try:
        child.expect_exact(PROMPT)
        out = ask(child, "Hello?")
        assert f"cannot reach {dead}" in out and "error" in out
        assert "no answer yet" in ask(child, "/stats")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_in_one_shot_mode_exits_130(llama_server: LlamaServer) -> None:
    command = apirctl_command()
    child = pexpect.spawn(
        command[0],
        [*command[1:], "chat", "--url", llama_server.url, LONG_QUESTION, "--max-tokens", "1000",
         "--temperature", "0"],
        env=dict(os.environ, TERM="xterm", NO_COLOR="1"),
        encoding="utf-8",
        timeout=TIMEOUT,
    )  # fmt: skip
    try:
        wait_decoding(llama_server)
        child.sendintr()
        child.expect_exact("apirctl: interrupted")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130
