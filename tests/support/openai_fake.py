"""Test infrastructure: a scripted OpenAI-compatible chat server on 127.0.0.1, made with `http.server`.

`apirctl chat --url` talks to any OpenAI-compatible server, so a server that always streams the
same, known answer is a legitimate peer for testing how answers are *shown* (Markdown rendering,
plain output): the demo model's real answers are not predictable enough to assert on their
formatting. Everything about the model's behaviour is tested against the real llama-server.

It speaks the common subset `apirctl chat` uses, written from the OpenAI API's documented shapes:

- `POST /v1/chat/completions` with `"stream": true`: `text/event-stream`, one `data:` event per
  piece of the answer (`choices[0].delta.content`), a last chunk with `finish_reason`, then
  `data: [DONE]`; without `stream`: one `chat.completion` JSON object;
- `GET /v1/models`: one model.

Each request's JSON body is kept in `requests`. `hold_after` pieces into an answer, the stream
waits until `release()`, so a test can look at the terminal while an answer is half-written.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "scripted"


def pieces_of(text: str) -> list[str]:
    """Split an answer into stream pieces the way tokens come: words with their following spaces."""
    return re.findall(r"\S+\s*|\s+", text)


@dataclass
class FakeChatServer:
    """Answers every question with `answer`, streamed in `pieces_of(answer)`."""

    answer: str
    hold_after: int | None = None  # pieces sent before the stream waits for `release()`
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    _released: threading.Event = field(default_factory=threading.Event)
    _held: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def release(self) -> None:
        """Let a held stream go on to its end."""
        self._released.set()

    def wait_held(self, timeout: float = 180.0) -> bool:
        """True once a stream has stopped at `hold_after` pieces."""
        return self._held.wait(timeout)

    def start(self) -> FakeChatServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/") == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._json(404, {"error": {"message": f"no route {self.path}"}})
                    return
                fake.requests.append(body)
                if not body.get("stream"):
                    self._json(200, {
                        "id": "chatcmpl-1", "object": "chat.completion", "model": MODEL,
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": fake.answer}}],
                    })  # fmt: skip
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for number, piece in enumerate(pieces_of(fake.answer)):
                    if number == fake.hold_after:
                        fake._held.set()
                        fake._released.wait()
                    self._event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
                self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _event(self, chunk: dict[str, Any]) -> None:
                chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, **chunk}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
