"""apirctl-front, the door of a router server's container (templates/apirctl-front.c), built here as the
image builds it and run in front of a real HTTP server standing in for llama-server's router: a POST
whose JSON names no model gets the default, everything else passes unchanged, the router's stop signal
and exit status pass through, and bad arguments are refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apirctl.build import image
from tests.support.ports import free_port
from tests.support.waiting import wait_for

#: The stand-in router: answers every request with what it received (path, body, Connection header).
ECHO = r'''
import http.server, json, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        out = json.dumps({"method": self.command, "path": self.path, "body": body.decode(),
                          "connection": self.headers.get("Connection")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
'''


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("front")
    return image.compile_health_check(folder / "apirctl-front", source_name=image.FRONT_SOURCE)


@pytest.fixture
def door(front: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The front on a free port, the echo server behind it as its child; yields its base URL."""
    listen, upstream = free_port(), free_port()
    (tmp_path / "echo.py").write_text(ECHO)
    # a session of its own: the echo server (the front's child) ends with it, whatever the test did
    proc = subprocess.Popen([str(front), "--listen", str(listen), "--upstream", str(upstream), "--model", "second",
                             "--", sys.executable, str(tmp_path / "echo.py"), str(upstream)], start_new_session=True)
    base = f"http://127.0.0.1:{listen}"

    def answers() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("the front and its upstream to answer", answers, timeout=30)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        wait_for("the echo server to end with its front", lambda: not _group_alive(proc.pid), timeout=30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _echo(response: httpx.Response) -> dict[str, object]:
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_a_post_without_a_model_gets_the_default_and_others_pass_unchanged(
        door: tuple[str, subprocess.Popen[bytes]]) -> None:
    base, _ = door
    with httpx.Client(timeout=30) as client:  # kept alive by the client: each request is still answered
        unnamed = _echo(client.post(f"{base}/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": 'a "model": b'}]}))
        assert json.loads(str(unnamed["body"])) == {"model": "second",
                                                    "messages": [{"role": "user", "content": 'a "model": b'}]}
        assert unnamed["connection"] == "close"
        assert json.loads(str(_echo(client.post(f"{base}/v1/completions", content=b" { } "))["body"])) == \
            {"model": "second"}
        named = {"model": "first", "options": {"model": 1}}
        assert json.loads(str(_echo(client.post(f"{base}/v1/completions", json=named))["body"])) == named
        nested = {"options": {"model": 1}}  # a "model" below the top level is not the request's
        assert json.loads(str(_echo(client.post(f"{base}/v1/completions", json=nested))["body"]))["model"] == "second"
        for body in (b"[1, 2]", b"not json", b'{"unterminated": "'):  # not an object: the router judges it
            assert _echo(client.post(f"{base}/v1/completions", content=body))["body"] == body.decode()
        assert _echo(client.post(f"{base}/models/load", json={}))["body"] == "{}"  # the router's own
        got = _echo(client.get(f"{base}/metrics"))
        assert (got["method"], got["path"], got["body"]) == ("GET", "/metrics", "")
        big = {"prompt": "x" * 300_000}
        assert json.loads(str(_echo(client.post(f"{base}/v1/completions", json=big))["body"])) == \
            {"model": "second", **big}


def test_a_head_too_large_or_a_body_too_large_is_refused_with_a_status(
        door: tuple[str, subprocess.Popen[bytes]]) -> None:
    base, _ = door
    port = int(base.rsplit(":", 1)[1])
    for request in (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(request)
            status = conn.recv(64).split(b"\r\n")[0]
        assert status.startswith(b"HTTP/1.1 4"), status
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # and it still serves


def test_the_stop_signal_reaches_the_router_and_its_status_comes_back(
        door: tuple[str, subprocess.Popen[bytes]]) -> None:
    _, proc = door
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # the echo server died of the forwarded SIGTERM


@pytest.mark.parametrize("args", [[], ["--listen", "1"], ["--listen", "1", "--upstream", "2", "--model", 'a"b', "--",
                                                           "true"], ["--bogus", "1", "--", "true"]])
def test_bad_arguments_are_refused(front: Path, args: list[str]) -> None:
    done = subprocess.run([str(front), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ})
    assert done.returncode == 2 and done.stderr.startswith(("usage: apirctl-front", "apirctl-front:"))
