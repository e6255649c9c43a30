"""Test infrastructure: HTTP peers on 127.0.0.1 that misbehave on purpose, each in one way a real
server or network can (a hung process, a stalled stream, a dropped connection). Raw sockets, so the
misbehaviour is exact: `http.server` would finish what it started.

- `silent`: accepts and reads the request, never answers;
- `stall`: answers a chat stream with `events` pieces, then sends nothing more and keeps the socket;
- `cut`: the same, then closes the connection without the stream's end;
- `endless`: streams a piece every 50 ms until the client hangs up (`hung_up` is set then).

`requests` counts the requests that arrived. `stop` shuts the listener down before closing it: a
socket closed while another thread waits in its accept() stays listening in the kernel (Linux), held
by no descriptor, and would take the next connection to its port and stream `endless`'s x's into it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(text: str) -> bytes:
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return _chunk(b"data: " + json.dumps(body).encode() + b"\n\n")


@dataclass
class Peer:
    behaviour: str
    events: int = 3
    requests: int = 0
    hung_up: threading.Event = field(default_factory=threading.Event)
    stopped: threading.Event = field(default_factory=threading.Event)
    _sock: socket.socket | None = None
    _conns: list[socket.socket] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self._sock is not None
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"

    def start(self) -> Peer:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:
                    return
                data += piece
            self.requests += 1
            if self.behaviour == "silent":
                return  # the socket stays open in `_conns`
            conn.sendall(HEAD)
            if self.behaviour == "endless":
                while not self.stopped.is_set():
                    conn.sendall(_event("x"))
                    time.sleep(0.05)
                return
            for number in range(self.events):
                conn.sendall(_event(f"piece{number} "))
            if self.behaviour == "cut":
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        except OSError:
            self.hung_up.set()

    def stop(self) -> None:
        self.stopped.set()
        for conn in [*self._conns, *([self._sock] if self._sock else [])]:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv() on it
            with contextlib.suppress(OSError):
                conn.close()
