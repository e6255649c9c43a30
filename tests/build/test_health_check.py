"""The container's health check program (templates/apirctl-health.c), built as `apirctl setup` builds
it and under ASan/UBSan, against servers that answer well, badly or not at all: it reads bytes from
the server in the container, so no answer may crash it or make it lie."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.build import image

SANITIZE = ("-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer")


class OneAnswer:
    """A TCP server on 127.0.0.1 that reads a request and sends `reply` (None: says nothing) to each client."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                self.requests.append(conn.recv(4096))
                if self.reply is None:
                    conn.recv(1)  # hold the connection until the client gives up
                    continue
                conn.sendall(self.reply)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module", params=["static", "sanitized"])
def program(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("health")
    if request.param == "static":
        built = image.compile_health_check(folder / "apirctl-health")
        ldd = subprocess.run(["ldd", str(built)], capture_output=True, text=True)
        assert "not a dynamic executable" in ldd.stdout + ldd.stderr  # runs in any image
        return built
    return image.compile_health_check(folder / "apirctl-health-asan", extra_flags=SANITIZE)


@pytest.fixture
def answering() -> Iterator[list[OneAnswer]]:
    servers: list[OneAnswer] = []
    yield servers
    for server in servers:
        server.close()


def check(program: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(program), *args], capture_output=True, text=True, timeout=30,
                          env={"ASAN_OPTIONS": "detect_leaks=1", "PATH": "/usr/bin:/bin"})
    assert "runtime error" not in done.stderr and "Sanitizer" not in done.stderr, done.stderr
    return done


LONG = b"HTTP/1.1 200 OK\r\nX: " + b"a" * 5000 + b"\r\n\r\n{}"


@pytest.mark.parametrize(("reply", "args", "code", "says"), [
    (b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}', [], 0, 'HTTP 200 {"status":"ok"}'),
    (b"HTTP/1.1 503 Service Unavailable\r\n\r\n{\"error\":\"Loading model\"}", [], 1, "HTTP 503"),
    (b"HTTP/1.1 503 Service Unavailable\r\n\r\n{\"error\":\"Loading model\"}", ["--live"], 0, "HTTP 503"),
    (b"HTTP/1.1 500 Internal Server Error\r\n\r\n", ["--live"], 1, "HTTP 500"),
    (b"HTTP/1.0 200", [], 0, "HTTP 200"),  # no headers, no body
    (LONG, [], 0, "HTTP 200"),  # more than the reply buffer
    (b"SSH-2.0-OpenSSH_9.6\r\n", [], 1, "no HTTP answer"),
    (b"HTTP/1.1 abc\r\n\r\n", [], 1, "no HTTP answer"),
    (b"", [], 1, "no HTTP answer"),  # closed without a word
    (b"\x00\xff" * 700, [], 1, "no HTTP answer"),
])
def test_answers(program: Path, answering: list[OneAnswer], reply: bytes, args: list[str], code: int,
                 says: str) -> None:
    answering.append(OneAnswer(reply))
    server = answering[-1]
    done = check(program, *args, str(server.port))
    assert done.returncode == code and says in done.stdout, (done.stdout, done.stderr)
    assert server.requests[0].startswith(b"GET /health HTTP/1.1\r\n")


def test_silent_server_and_nothing_listening(program: Path, answering: list[OneAnswer]) -> None:
    answering.append(OneAnswer(None))
    silent = check(program, str(answering[-1].port))
    assert silent.returncode == 1 and "no HTTP answer" in silent.stdout  # its own time limit, not Podman's
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    nobody = check(program, str(free))
    assert nobody.returncode == 1 and f"cannot connect to 127.0.0.1:{free}" in nobody.stdout


@pytest.mark.parametrize("args", [["0"], ["65536"], ["80x"], ["-1"], ["--nope"]])
def test_bad_arguments_are_usage_errors(program: Path, args: list[str]) -> None:
    done = check(program, *args)
    assert done.returncode == 2 and "usage: apirctl-health" in done.stderr
