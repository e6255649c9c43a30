"""`chat` against servers that misbehave: every request has a connect, first-byte and stall limit, a
cut answer ends with the error on a line of its own, and nothing is left running."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.support.peers import Peer
from tests.support.ports import free_port
from tests.support.sweep import sweep


@pytest.fixture
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    started = Peer(request.param).start()
    yield started
    started.stop()


def test_a_stopped_peer_listens_no_more() -> None:
    """An endless peer, once stopped, neither streams nor takes a later connection to its port: one
    left listening once streamed x's into a chat test's terminal."""
    peer = Peer("endless").start()
    port = int(peer.url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        peer.stop()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=10):
        pass


@pytest.mark.parametrize("peer", ["silent"], indirect=True)
def test_a_server_that_accepts_and_never_answers(peer: Peer) -> None:
    out = sweep("chat", "--url", peer.url, "--prompt", "hi", "--first-byte-timeout", "1")
    out.fails_cleanly(code=1, says="accepted the request but sent no answer within 1 s")


@pytest.mark.parametrize("peer", ["silent"], indirect=True)
def test_json_mode_has_the_same_limit(peer: Peer) -> None:
    out = sweep("chat", "--url", peer.url, "--prompt", "hi", "--json", "--first-byte-timeout", "1")
    out.fails_cleanly(code=1, says="sent no answer")


@pytest.mark.parametrize("peer", ["stall"], indirect=True)
def test_a_stream_that_stalls(peer: Peer) -> None:
    out = sweep("chat", "--url", peer.url, "--prompt", "hi", "--stall-timeout", "1")
    out.fails_cleanly(code=1, says="stalled: nothing for 1 s")
    assert out.stdout == "piece0 piece1 piece2 \n"  # what came is shown, and the line is ended


@pytest.mark.parametrize("peer", ["cut"], indirect=True)
def test_a_cut_stream_ends_its_line_before_the_error(peer: Peer) -> None:
    out = sweep("chat", "--url", peer.url, "--prompt", "hi")
    out.fails_cleanly(code=1, says="closed in the middle of the answer")
    assert out.stdout.endswith("piece2 \n")


def test_nothing_listens() -> None:
    port = free_port()  # free a moment ago
    sweep("chat", "--url", f"http://127.0.0.1:{port}/v1", "--prompt", "hi").fails_cleanly(code=1, says="cannot reach")


@pytest.mark.parametrize("url", ["not a url", "ftp://127.0.0.1/v1", "http://", "http://[::1/v1"])
def test_malformed_urls(url: str) -> None:
    sweep("chat", "--url", url, "--prompt", "hi").fails_cleanly()


def test_url_and_name_together() -> None:
    sweep("chat", "--url", "http://127.0.0.1:9/v1", "--name", "x", "--prompt", "hi").fails_cleanly(
        code=1, says="exclude each other")


@pytest.mark.parametrize("flag", [["--first-byte-timeout", "0"], ["--stall-timeout", "-1"], ["--max-tokens", "0"]])
def test_bad_chat_flags(flag: list[str]) -> None:
    sweep("chat", "--url", "http://127.0.0.1:9/v1", "--prompt", "hi", *flag).fails_cleanly(code=2, lines=8)
