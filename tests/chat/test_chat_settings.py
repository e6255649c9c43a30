"""Sampling settings and images as a user types them: `--temp`, `--seed`, `--max-tokens`, `--image`, and in
the session `/set temp 0.2` and `/image FILE`. The scripted OpenAI-compatible server keeps each request
body, so the test reads exactly what `apirctl chat` sent."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from tests.support.chat_helpers import apirctl_command, run_chat
from tests.support.openai_fake import FakeChatServer

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/"
                       "iZk9HQAAAABJRU5ErkJggg==")


@pytest.fixture
def server() -> Iterator[FakeChatServer]:
    fake = FakeChatServer("Paris.").start()
    yield fake
    fake.stop()


def test_flags_go_into_every_request(server: FakeChatServer, tmp_path: Path) -> None:
    picture = tmp_path / "dot.png"
    picture.write_bytes(PNG)
    done = run_chat("--url", server.url, "--temp", "0.2", "--seed", "42", "--max-tokens", "7",
                    "--image", str(picture), "What is this?")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Paris."
    body = server.requests[-1]
    assert (body["temperature"], body["seed"], body["max_tokens"]) == (0.2, 42, 7)
    content = body["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(PNG).decode()


def test_a_file_that_is_not_an_image_is_one_line(server: FakeChatServer, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    done = run_chat("--url", server.url, "--image", str(text), "hi")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("apirctl: error: ") and "not an image file" in done.stderr
    assert server.requests == []


def test_set_and_image_in_the_session(server: FakeChatServer, tmp_path: Path) -> None:
    picture = tmp_path / "dot.png"
    picture.write_bytes(PNG)
    command = apirctl_command()
    child = pexpect.spawn(command[0], [*command[1:], "chat", "--url", server.url, "--plain"],
                          env=dict(os.environ, TERM="xterm", NO_COLOR="1", COLUMNS="120"), encoding="utf-8",
                          timeout=60, dimensions=(40, 120))
    try:
        child.expect_exact(">>> ")
        for line, reply in (("/set temp 0.2", "temp = 0.2"), ("/set parameter seed 7", "seed = 7"),
                            ("/set max-tokens 5", "max-tokens = 5"), ("/set top-k x", "top-k takes a number"),
                            ("/set warmth 3", "unknown setting warmth"), (f"/image {picture}", "1 image(s)")):
            child.sendline(line)
            child.expect_exact(reply)
            child.expect_exact(">>> ")
        child.sendline("/set")
        child.expect("temp=0.2 +max-tokens=5 +seed=7")
        child.expect_exact(">>> ")
        child.sendline("Describe it.")
        child.expect_exact("Paris.")
        child.expect_exact(">>> ")
        child.sendline("And now?")
        child.expect_exact("Paris.")
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    first, second = server.requests[-2:]
    assert (first["temperature"], first["seed"], first["max_tokens"]) == (0.2, 7, 5)
    assert first["messages"][-1]["content"][1]["type"] == "image_url"
    assert second["messages"][-1] == {"role": "user", "content": "And now?"}  # the image went once
    assert second["temperature"] == 0.2


def test_a_conversation_keeps_only_answered_turns(server: FakeChatServer) -> None:
    """The library side of the session, with no terminal: the history, `/set`, and a failed turn that
    leaves the history as it was (the CLI prints; `chat` only returns and raises)."""
    from apirctl import chat
    from apirctl.errors import ApirctlError

    with chat.ChatClient(server.url) as client:
        conversation = chat.Conversation(client, system="Be brief.")
        assert conversation.set("temp 0.3") == "temp = 0.3"
        assert conversation.set("top-k x") == "top-k takes a number, not 'x'"
        pieces: list[str] = []
        reply = conversation.send("Capital of France?", pieces.append)
        assert reply.content == "Paris." and "".join(pieces) == "Paris."
        assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant"]
        assert server.requests[-1]["temperature"] == 0.3 and conversation.last is reply
    with chat.ChatClient("http://127.0.0.1:1/v1") as closed:
        conversation.client = closed
        with pytest.raises(ApirctlError):
            conversation.send("And of Spain?", pieces.append)
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant"]
