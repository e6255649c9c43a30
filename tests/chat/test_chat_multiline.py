"""Messages of several lines in the interactive chat: a real terminal (tmux) and the real llama-server.

What proves that a message reached the server whole: llama-server's `/slots` gives the prompt of
its last request as it tokenized it (the fixture starts it with `show_prompts`), and its
`/apply-template` gives the prompt its model's chat template makes of given messages. They are
equal only if the last request held exactly those messages: sent line by line, it would hold
several user turns and answers; joined by spaces, it would lack the newlines. The demo model's
answers are never looked at.

Each test runs once in a process of its own (`APIRCTL_RESIDENT=0`) and once through the suite's
resident apirctl process (forked, with the terminal passed over a unix socket), since readline's
terminal handling (bracketed paste, raw mode) must work the same in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.chat_helpers import (
    PROMPT_LINE,
    LlamaServer,
    Tmux,
    apirctl_command,
    last_prompt,
    resident_served,
    start_resident,
    templated,
)

pytestmark = pytest.mark.integration

ANSWER_TOKENS = "8"  # the answers do not matter: keep them short


@pytest.fixture(params=["own-process", "resident"])
def terminal(request: pytest.FixtureRequest, tmp_path: Path, llama_server: LlamaServer) -> Iterator[Tmux]:
    """`apirctl chat --url` against the llama-server, in a tmux pane of 100x30, at its first prompt."""
    env = {"NO_COLOR": "1"}  # and the test's own environment, which the tmux server inherits
    served = None
    if request.param == "own-process":
        env["APIRCTL_RESIDENT"] = "0"
    else:
        env["APIRCTL_RESIDENT"] = "1"
        served = start_resident()
    command = [*apirctl_command(), "chat", "--url", llama_server.url, "--temperature", "0",
               "--max-tokens", ANSWER_TOKENS]  # fmt: skip
    pane = Tmux(tmp_path, command, env)
    try:
        pane.wait_prompt(1)
        yield pane
        pane.line("/exit")
        assert pane.exit_status() == 0
    finally:
        pane.close()
    if served is not None:
        after = resident_served()
        assert after is not None and after > served, "the session did not run in the resident process"


def test_a_block_reaches_the_server_as_one_message(terminal: Tmux, llama_server: LlamaServer) -> None:
    terminal.line('"""')
    terminal.wait(r"^\.\.\. ?$")  # the continuation prompt
    for line in ["Read this code:", "def twice(x):", '    """Doubles x."""', "", "    return 2 * x"]:
        terminal.line(line)
    terminal.line('"""')
    screen = terminal.wait_prompt(2)
    assert "...     return 2 * x" in screen
    message = 'Read this code:\ndef twice(x):\n    """Doubles x."""\n\n    return 2 * x'
    assert last_prompt(llama_server) == templated(llama_server, [{"role": "user", "content": message}])


def test_a_paste_is_sent_as_one_message_on_enter(terminal: Tmux, llama_server: LlamaServer) -> None:
    """Bracketed paste: the pasted lines wait in the prompt line, and Enter sends them together."""
    terminal.paste("First pasted line.\n  Second, indented.\n\nFourth after an empty one.\n")
    screen = terminal.wait("Fourth after an empty one.")
    assert len(PROMPT_LINE.findall(screen)) == 1 and "waiting" not in screen  # nothing went before Enter
    terminal.line()
    terminal.wait_prompt(2)
    message = "First pasted line.\n  Second, indented.\n\nFourth after an empty one."
    assert last_prompt(llama_server) == templated(llama_server, [{"role": "user", "content": message}])


def test_a_trailing_backslash_continues_the_message(terminal: Tmux, llama_server: LlamaServer) -> None:
    """For questions and for commands: `/system` takes a prompt of several lines."""
    terminal.line("/system You answer briefly.\\")
    terminal.line("You answer in English.")
    terminal.wait("system prompt set")
    terminal.line("Name a colour\\")
    terminal.wait(r"^\.\.\. ?$")
    terminal.line("  and a fruit.")
    terminal.wait_prompt(3)
    messages = [
        {"role": "system", "content": "You answer briefly.\nYou answer in English."},
        {"role": "user", "content": "Name a colour\n  and a fruit."},
    ]
    assert last_prompt(llama_server) == templated(llama_server, messages)
