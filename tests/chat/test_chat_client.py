"""The library side of chat: URL forms, SSE parsing, streaming and the wait while a model loads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from apirctl.chat import client as chat
from apirctl.errors import ApirctlError
from tests.support.chat_helpers import LlamaServer, start_llama_server, stop, wait_ready


@pytest.mark.parametrize(
    ("given_url", "base"),
    [
        ("127.0.0.1:1234", "http://127.0.0.1:1234/v1"),
        ("http://127.0.0.1:1234", "http://127.0.0.1:1234/v1"),
        ("http://127.0.0.1:1234/", "http://127.0.0.1:1234/v1"),
        ("http://127.0.0.1:1234/v1/", "http://127.0.0.1:1234/v1"),
        ("http://127.0.0.1:1234/v1/chat/completions", "http://127.0.0.1:1234/v1"),
        ("https://example.org/api/openai/v1", "https://example.org/api/openai/v1"),
        ("  localhost:8080/v1  ", "http://localhost:8080/v1"),
        ("http://[::1]:8080", "http://[::1]:8080/v1"),
    ],
)
def test_base_url_forms(given_url: str, base: str) -> None:
    assert chat.normalize_base_url(given_url) == base


@pytest.mark.parametrize("bad", ["", "   ", "ftp://host/v1", "http://", "http://host:notaport/v1", "http://h:70000"])
def test_bad_base_urls_are_user_errors(bad: str) -> None:
    with pytest.raises(ApirctlError):
        chat.normalize_base_url(bad)


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n"), min_size=1), min_size=1, max_size=5))
def test_sse_data_survives_framing(payloads: list[str]) -> None:
    """Whatever the payloads, each event's data comes back whole, with pings and comments skipped."""
    lines: list[str] = [": ping", ""]
    for payload in payloads:
        lines += ["event: message", f"data: {payload}", ""]
    assert list(chat._sse_events(iter(lines))) == payloads


def test_sse_multi_line_data_and_unterminated_last_event() -> None:
    lines = ["data: one", "data: two", "", "data:three"]
    assert list(chat._sse_events(iter(lines))) == ["one\ntwo", "three"]


def test_stats_text_names_its_source() -> None:
    assert "ask something first" in chat.format_stats(None)
    reply = chat.Reply(content="x")
    reply.timings = chat.Timings.from_llama_server(
        {"prompt_n": 5, "cache_n": 20, "prompt_per_second": 100.0, "predicted_n": 7, "predicted_per_second": 50.0},
        first_token_s=0.1,
        total_s=0.3,
    )
    text = chat.format_stats(reply)
    assert "prompt:     5 tokens (+20 cached), 100.0 tokens/s" in text
    assert "generation: 7 tokens, 50.0 tokens/s" in text
    assert "(server timings)" in text


@pytest.mark.integration
def test_stream_delivers_pieces_as_they_come(llama_server: LlamaServer) -> None:
    """Streaming really streams: several pieces, joined equal to the reply, with server timings."""
    pieces: list[str] = []
    with chat.ChatClient(llama_server.url) as client:
        reply = client.stream(
            [{"role": "user", "content": "Name three colours."}], pieces.append, max_tokens=16, temperature=0
        )
    assert len(pieces) > 1
    assert "".join(pieces) == reply.content
    assert reply.finish_reason in ("stop", "length")
    assert reply.timings.from_server
    assert reply.usage is not None
    assert reply.timings.predicted_tokens == reply.usage["completion_tokens"]
    assert reply.timings.first_token_s is not None and reply.timings.first_token_s <= reply.timings.total_s


def first_health_status(server: LlamaServer, timeout: float = 60.0) -> int:
    """The first answer of /health: llama-server's HTTP side comes up before the model is loaded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"{server.origin}/health", timeout=5).status_code
        except httpx.TransportError:
            if server.process.poll() is not None:
                pytest.fail(server.log_tail())
            time.sleep(0.01)
    pytest.fail(f"llama-server did not answer within {timeout} s")


@pytest.mark.integration
def test_waits_while_the_model_loads(llama_build: Any, demo_model: Path, tmp_path: Path) -> None:
    """llama-server answers 503 until its model is loaded: the client waits, then gets its answer."""
    server = start_llama_server(llama_build, demo_model, tmp_path / "server.log")
    try:
        if first_health_status(server) != 503:
            pytest.skip("the model loaded before the first request could see it loading")
        waits: list[float] = []
        with chat.ChatClient(server.url, load_timeout=120) as client:
            reply = client.stream(
                [{"role": "user", "content": "Hi"}], lambda _: None, max_tokens=4, on_loading=waits.append
            )
        assert waits, "the client never saw the 503"
        assert waits == sorted(waits)
        assert reply.content
    finally:
        stop(server)


@pytest.mark.integration
def test_loading_timeout_is_a_clear_error(llama_build: Any, demo_model: Path, tmp_path: Path) -> None:
    server = start_llama_server(llama_build, demo_model, tmp_path / "server.log")
    try:
        if first_health_status(server) != 503:
            pytest.skip("the model loaded before the first request could see it loading")
        with chat.ChatClient(server.url, load_timeout=0) as client, pytest.raises(chat.StillLoading) as caught:
            client.complete([{"role": "user", "content": "Hi"}], max_tokens=1)
        assert "still loading its model" in caught.value.message
        assert "Loading model" in caught.value.message  # the server's own words
        wait_ready(server)
    finally:
        stop(server)
