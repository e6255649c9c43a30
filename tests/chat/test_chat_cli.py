"""`apirctl chat` one-shot, JSON, pipe and error paths against a real llama-server."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.chat_helpers import LlamaServer, run_chat
from tests.support.ports import free_port
from tests.support.vision import write_png

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France? Answer in one short sentence."


def _no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr


def test_one_shot_prints_exactly_the_servers_answer(llama_server: LlamaServer) -> None:
    """The streamed pieces, joined, are the answer the server gives to the same greedy request."""
    args = ["--url", llama_server.url, QUESTION, "--temperature", "0", "--max-tokens", "24"]
    result = run_chat(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    direct = httpx.post(
        f"{llama_server.url}/chat/completions",
        json={
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 24,
        },
        timeout=120,
    ).json()
    expected = direct["choices"][0]["message"]["content"]
    assert expected.strip()
    assert result.stdout.rstrip("\n") == expected.rstrip("\n")


def test_json_prints_the_whole_response(llama_server: LlamaServer) -> None:
    result = run_chat("--url", llama_server.url, QUESTION, "--max-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["content"].strip()
    assert data["usage"]["completion_tokens"] <= 8
    assert data["timings"]["predicted_n"] == data["usage"]["completion_tokens"]


def test_system_prompt_and_max_tokens_reach_the_server(llama_server: LlamaServer) -> None:
    """A long --system prompt makes the server count more prompt tokens; --max-tokens caps the answer.

    (SmolLM2's template adds its own short system prompt when none is given, hence a long one here.)
    """
    plain = json.loads(run_chat("--url", llama_server.url, "Hi", "--max-tokens", "3", "--json").stdout)
    system = "You are a pirate. Always answer like a pirate would, with many nautical words. " * 4
    with_system = json.loads(
        run_chat("--url", llama_server.url, "-s", system, "Hi", "--max-tokens", "3", "--json").stdout
    )
    assert with_system["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 30
    assert with_system["usage"]["completion_tokens"] <= 3


def test_piped_stdin_is_the_question(llama_server: LlamaServer) -> None:
    """`echo QUESTION | apirctl chat` prints only the answer; with -p, stdin follows the prompt."""
    piped = run_chat("--url", llama_server.url, "--temperature", "0", "--max-tokens", "24", stdin=QUESTION + "\n")
    assert piped.returncode == 0, piped.stderr
    flag = run_chat("--url", llama_server.url, QUESTION, "--temperature", "0", "--max-tokens", "24")
    assert piped.stdout.strip() and piped.stdout == flag.stdout

    both = run_chat(
        "--url", llama_server.url, "Repeat this text:", "--max-tokens", "1", "--json",
        stdin="the quick brown fox jumps over the lazy dog",
    )  # fmt: skip
    alone = run_chat("--url", llama_server.url, "Repeat this text:", "--max-tokens", "1", "--json")
    assert both.returncode == 0, both.stderr
    grown = json.loads(both.stdout)["usage"]["prompt_tokens"] - json.loads(alone.stdout)["usage"]["prompt_tokens"]
    assert grown >= 8  # the nine piped words reached the server


def test_base_url_forms_are_accepted(llama_server: LlamaServer) -> None:
    """host:port, the bare origin and a pasted endpoint all reach /v1/chat/completions."""
    for url in (
        f"127.0.0.1:{llama_server.port}",
        llama_server.origin,
        f"{llama_server.url}/chat/completions",
    ):
        result = run_chat("--url", url, "Hi", "--max-tokens", "2")
        assert result.returncode == 0, (url, result.stderr)
        assert result.stdout.strip(), url


def test_unreachable_server_is_one_clear_line() -> None:
    port = free_port()  # nothing listens there any more
    result = run_chat("--url", f"http://127.0.0.1:{port}/v1", "Hi", timeout=60)
    assert result.returncode == 1
    _no_traceback(result.stderr)
    assert result.stdout == ""
    assert f"apirctl: error: cannot reach http://127.0.0.1:{port}/v1" in result.stderr


def test_server_error_is_reported_with_the_servers_message(llama_server: LlamaServer) -> None:
    """A prompt larger than the context makes llama-server answer 400 with its reason."""
    huge = "banana " * 3000  # > CTX_SIZE tokens
    result = run_chat("--url", llama_server.url, "--max-tokens", "4", stdin=huge)
    assert result.returncode == 1
    _no_traceback(result.stderr)
    assert result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert first.startswith("apirctl: error: server error (HTTP 400):")
    assert "context" in first.lower()


def test_a_server_that_is_not_openai_compatible(llama_server: LlamaServer) -> None:
    """A wrong base path is a 404 from the server, reported with a hint about the URL."""
    result = run_chat("--url", f"{llama_server.origin}/nothing/here", "Hi")
    assert result.returncode == 1
    _no_traceback(result.stderr)
    assert "server error (HTTP 404)" in result.stderr
    assert "hint:" in result.stderr


def test_connection_dropped_by_a_non_http_peer() -> None:
    """A port that accepts and closes at once (not HTTP at all) is an error, not a hang or traceback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        stop = threading.Event()

        def hang_up() -> None:
            listener.settimeout(0.1)
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                conn.close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        try:
            result = run_chat("--url", f"http://127.0.0.1:{port}/v1", "Hi", timeout=60)
        finally:
            stop.set()
            thread.join(5)
    assert result.returncode == 1
    _no_traceback(result.stderr)
    assert "apirctl: error: cannot reach" in result.stderr


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["--url", "ftp://example.invalid"], "Hi", "invalid URL"),
        (["--url", "http://127.0.0.1:99999"], "Hi", "bad port"),
        (["--url", "http://127.0.0.1:1", "--name", "x"], "Hi", "exclude each other"),
        (["--url", "http://127.0.0.1:1"], "", "nothing to ask"),
        (["--url", "http://127.0.0.1:1", "--max-tokens", "0"], "Hi", "--max-tokens"),
    ],
)
def test_bad_input_is_one_line(args: list[str], stdin: str, message: str) -> None:
    result = run_chat(*args, stdin=stdin, timeout=60)
    assert result.returncode != 0
    _no_traceback(result.stderr)
    assert message in result.stderr


def test_port_and_context_checks_against_the_real_server(llama_server: LlamaServer) -> None:
    """`-p PORT` is the server on that port of 127.0.0.1; `-c N` passes when the server's context (its
    /props) holds N tokens and fails, with the serve hint, when it holds fewer."""
    from tests.support.chat_helpers import CTX_SIZE

    port = str(llama_server.port)
    fits = run_chat("-p", port, "-c", str(CTX_SIZE), "Hi", "--max-tokens", "2")
    assert fits.returncode == 0 and fits.stdout.strip() and fits.stderr == "", fits.stderr
    more = run_chat("-p", port, "--ctx-size", str(CTX_SIZE + 1), "Hi")
    assert more.returncode == 1 and more.stdout == ""
    assert f"has a context of {CTX_SIZE} tokens, fewer than --ctx-size {CTX_SIZE + 1}" in more.stderr
    assert f"apirctl serve MODEL --ctx-size {CTX_SIZE + 1}" in more.stderr
    _no_traceback(more.stderr)


def test_context_check_against_a_server_that_does_not_report_it() -> None:
    """An OpenAI server without llama-server's /props: a notice, and the answer still comes."""
    from tests.support.openai_fake import FakeChatServer

    server = FakeChatServer("An answer.").start()
    try:
        result = run_chat("--url", server.url, "-c", "8192", "Hi")
    finally:
        server.stop()
    assert result.returncode == 0 and result.stdout == "An answer.\n", result.stderr
    assert "does not report its context size; --ctx-size 8192 is not checked" in result.stderr


def test_an_image_to_a_server_without_a_projector_says_so(llama_server: LlamaServer, tmp_path: Path) -> None:
    """llama-server's own words ("image input is not supported ... mmproj") become apirctl's."""
    image = tmp_path / "a.png"
    write_png(image)
    result = run_chat("--url", llama_server.url, "describe it", "--image", str(image), "--max-tokens", "4")
    _no_traceback(result.stderr)
    assert result.returncode == 1
    first, _, rest = result.stderr.partition("\n")
    assert "takes no images" in first and "vision projector" in first, result.stderr
    assert "ollama://" in rest
