"""How answers look: streamed as plain text, then rendered as Markdown on a terminal; plain elsewhere.

The answers come from a scripted OpenAI-compatible server (tests/support/openai_fake.py), because
these tests must know the answer's Markdown in advance; what the terminal shows is read back from
a real terminal emulator (tmux). Input that must not reach the server (a dropped block) is checked
against the same server's record of requests.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pexpect
import pytest

from tests.support.chat_helpers import Tmux, apirctl_command, resident_served, run_chat, start_resident
from tests.support.openai_fake import FakeChatServer

pytestmark = pytest.mark.integration

ANSWER = """# Doubling

Use **twice** and `int`:

- first item
- second item

```python
def twice(x):
    return 2 * x
```
"""
LONG_ANSWER = (
    "Here is **the list**:\n\n"
    + "".join(f"{n}. item number {n} with `code{n}`\n" for n in range(1, 41))
    + "\n```\nverbatim line\n```\nThe end.\n"
)
RAW_MARKS = ("**", "```", "# Doubling", "`int`", "- first")


@pytest.fixture
def scripted() -> Iterator[Callable[..., FakeChatServer]]:
    """Start scripted servers: `scripted(answer, hold_after=None)`; all stop after the test."""
    servers: list[FakeChatServer] = []

    def start(answer: str, hold_after: int | None = None) -> FakeChatServer:
        servers.append(FakeChatServer(answer, hold_after=hold_after).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def chat_pane(tmp_path: Path, url: str, *args: str, height: int = 30, env: dict[str, str] | None = None) -> Tmux:
    pane = Tmux(tmp_path, [*apirctl_command(), "chat", "--url", url, *args], {"NO_COLOR": "1", **(env or {})},
                width=80, height=height)
    pane.wait_prompt(1)
    return pane


@pytest.mark.parametrize("mode", ["own-process", "resident"])
def test_answer_streams_plain_then_is_rendered(
    mode: str, scripted: Callable[..., FakeChatServer], tmp_path: Path
) -> None:
    served = start_resident() if mode == "resident" else None
    server = scripted(ANSWER, hold_after=6)  # the stream stops after "Use **twice** and `int`:"
    # in the resident process, however long its fork takes on a loaded machine (by default the caller
    # gives up after 2 s and runs the session itself)
    env = {"APIRCTL_RESIDENT": "0"} if served is None else {"APIRCTL_RESIDENT": "1",
                                                             "APIRCTL_RESIDENT_ANSWER_SECONDS": "120"}
    pane = chat_pane(tmp_path, server.url, env=env)
    try:
        pane.line("How do I double a number?")
        assert server.wait_held(), pane.scrollback()  # the request came (the pane says what happened if not)
        # Mid-answer: the pieces so far, as plain text, as they came.
        streaming = pane.wait(r"Use \*\*twice\*\* and `int`:")
        assert "# Doubling" in streaming
        server.release()
        pane.wait_prompt(2)
        screen = pane.screen()
        answer = screen[screen.index("How do I double a number?") :]
        for mark in RAW_MARKS:
            assert mark not in answer, answer
        assert re.search(r"^ *Doubling *$", answer, re.M)  # the heading, without its #
        assert "Use twice and int:" in answer
        assert re.search(r"^ *• first item", answer, re.M) and re.search(r"^ *• second item", answer, re.M)
        assert "def twice(x):" in answer and "    return 2 * x" in answer
        styled = pane.screen(escapes=True)
        assert re.search(r"\x1b\[1m(?:\x1b\[[\d;]*m)*twice", styled), "bold text is not bold"
        pane.line("/exit")
        assert pane.exit_status() == 0
    finally:
        pane.close()
    assert len(server.requests) == 1
    if served is not None:
        after = resident_served()
        assert after is not None and after > served, "the session did not run in the resident process"


@pytest.mark.parametrize("environment", [{}, {"LINES": "24", "COLUMNS": "80"}], ids=["plain", "stale-LINES"])
def test_a_long_answer_is_in_the_scrollback_once_rendered(
    environment: dict[str, str], scripted: Callable[..., FakeChatServer], tmp_path: Path
) -> None:
    """An answer three times the terminal's height: the streamed text never stays behind; the rendered
    answer is there once, whole, and its end is on the screen. Also when the environment says the
    terminal is taller than it is (a `LINES` exported before a resize; rich believes it)."""
    server = scripted(LONG_ANSWER)
    pane = chat_pane(tmp_path, server.url, height=15, env=environment)
    try:
        pane.line("List forty things.")
        pane.wait_prompt(2)
        everything = pane.scrollback()
        for n in range(1, 41):
            assert len(re.findall(rf"^ *{n}\.? item number {n} with code{n} *$", everything, re.M)) == 1, everything
        assert everything.count("verbatim line") == 1 and everything.count("The end.") == 1
        assert "**" not in everything and "```" not in everything and "`code" not in everything
        assert "The end." in pane.screen()
        pane.line("/exit")
        assert pane.exit_status() == 0
    finally:
        pane.close()


def test_plain_flag_shows_the_text_as_sent(scripted: Callable[..., FakeChatServer], tmp_path: Path) -> None:
    """The answer appears as the server sent it, Markdown marks and all. Waits for the answer itself
    (not for the next prompt), and says what the server received when it does not come."""
    server = scripted(ANSWER)
    pane = chat_pane(tmp_path, server.url, "--plain")
    try:
        pane.line("How do I double a number?")
        pane.wait_text(ANSWER.rstrip("\n"), context=lambda: f"the server received: {server.requests}")
        assert [r["messages"][-1]["content"] for r in server.requests] == ["How do I double a number?"]
        pane.wait_prompt(2)
        pane.line("/exit")
        assert pane.exit_status() == 0
    finally:
        pane.close()


def test_stdout_that_is_not_a_terminal_gets_plain_text(scripted: Callable[..., FakeChatServer], tmp_path: Path) -> None:
    """A session typed on a terminal with its output going to a file: no escape codes, even with --markdown."""
    server = scripted(ANSWER)
    output = tmp_path / "chat.txt"
    command = ["sh", "-c", f'exec "$@" > {output}', "sh", *apirctl_command(), "chat", "--url", server.url, "--markdown"]
    pane = Tmux(tmp_path, command, {"NO_COLOR": "1"})
    try:
        pane.line("How do I double a number?")
        pane.line("/exit")
        assert pane.exit_status() == 0
    finally:
        pane.close()
    text = output.read_text()
    assert ANSWER in text and "\x1b" not in text
    assert len(server.requests) == 1


def test_one_shot_output_is_the_answer_byte_for_byte(scripted: Callable[..., FakeChatServer]) -> None:
    """-p and pipes print exactly what the server sent, --markdown or not, on a pipe or a terminal."""
    server = scripted(ANSWER)
    for args, stdin in (
        (["How do I double a number?", "--markdown"], None),
        (["--markdown"], "How do I double a number?"),
        (["How do I double a number?"], None),
    ):
        result = run_chat("--url", server.url, *args, stdin=stdin)
        assert result.returncode == 0, result.stderr
        assert result.stdout == ANSWER and result.stderr == ""
    command = apirctl_command()
    child = pexpect.spawn(command[0], [*command[1:], "chat", "--url", server.url, "Again?", "--markdown"],
                          env=dict(os.environ, TERM="xterm"), dimensions=(30, 80), timeout=60)
    try:
        output = child.read()  # everything up to the end of the output
    finally:
        child.close()
    assert child.exitstatus == 0
    assert output == ANSWER.replace("\n", "\r\n").encode()  # the terminal's own newline translation only


def test_a_dropped_block_is_never_sent_and_ctrl_d_sends_one(
    scripted: Callable[..., FakeChatServer], tmp_path: Path
) -> None:
    server = scripted("Fine.")
    pane = chat_pane(tmp_path, server.url)
    try:
        pane.line('"""')
        pane.wait(r'"""\n\.\.\. ?$')  # in the block before the next keys (a loaded machine is slow to draw)
        pane.line("a draft")
        pane.wait(r"a draft\n\.\.\. ?$")
        pane.keys("C-c")
        pane.wait(r"message dropped")
        pane.wait(r"^>>> ?$")
        assert server.requests == []
        pane.line('"""first line')
        pane.line("second line")
        pane.wait(r"second line\n\.\.\. ?$")  # Ctrl-D goes to the next continuation prompt, not into the line
        pane.keys("C-d")  # ends the block: it goes as it stands, and the session stays
        pane.wait("Fine.", context=lambda: f"requests the server saw: {server.requests}")
        assert [m["content"] for m in server.requests[0]["messages"]] == ["first line\nsecond line"]
        pane.wait_prompt(3)
        pane.keys("C-d")
        assert pane.exit_status() == 0
    finally:
        pane.close()
