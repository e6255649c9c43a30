#!/usr/bin/env python3
"""A counting TCP proxy for llama.cpp's RPC protocol: where does the per-token time go?

Why: the lent GPU machine has no strace, perf or tcpdump, and what we need is at the
protocol level anyway: how many commands of each kind a generated token costs, how
many of them are round trips (the client waits for an answer), the bytes each way,
and how long the server takes to answer (measured next to the server, so the proxy's
own overhead is outside it). Put it between a client and `ggml-rpc-server`:

    rpc_trace.py --listen 127.0.0.1:50060 --target 127.0.0.1:50052 --out trace.json &
    llama-bench --rpc 127.0.0.1:50060 ...     # then SIGTERM/SIGINT the proxy: it writes the JSON

Run two generation lengths and subtract (see `per_token`) to cancel model loading and
warm-up. The proxy adds latency to every message, so take speeds from runs without it;
take counts and bytes (exact) and server answer times (close) from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import struct
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apirctl.remoting.rpc_client import ANSWERED, Command


class Stats:
    """Totals over all connections, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.commands: Counter[str] = Counter()
        self.request_bytes: Counter[str] = Counter()
        self.answer_bytes: Counter[str] = Counter()
        self.wait_s: Counter[str] = Counter()  # request forwarded -> first answer byte
        self.connections = 0

    def as_dict(self) -> dict[str, object]:
        with self.lock:
            return {
                "connections": self.connections,
                "commands": dict(self.commands),
                "round_trips": sum(n for c, n in self.commands.items() if Command[c] in ANSWERED),
                "bytes_to_server": sum(self.request_bytes.values()),
                "bytes_to_client": sum(self.answer_bytes.values()),
                "request_bytes": dict(self.request_bytes),
                "answer_bytes": dict(self.answer_bytes),
                "server_wait_s": dict(self.wait_s),
                "server_wait_total_s": sum(self.wait_s.values()),
            }


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(min(n - len(buf), 1 << 20))
        if not got:
            return None
        buf += got
    return bytes(buf)


def _pipe_payload(src: socket.socket, dst: socket.socket, n: int) -> bool:
    while n:
        got = src.recv(min(n, 1 << 20))
        if not got:
            return False
        dst.sendall(got)
        n -= len(got)
    return True


def _client_to_server(cli: socket.socket, srv: socket.socket, pending: deque, cond: threading.Condition,
                      stats: Stats) -> None:
    while True:
        head = _recv_exact(cli, 9)
        if head is None:
            break
        cmd_num, size = struct.unpack("<BQ", head)
        try:
            name = Command(cmd_num).name
        except ValueError:
            name = f"UNKNOWN_{cmd_num}"
        srv.sendall(head)
        if not _pipe_payload(cli, srv, size):
            break
        with stats.lock:
            stats.commands[name] += 1
            stats.request_bytes[name] += 9 + size
        if cmd_num in ANSWERED:
            with cond:
                pending.append((name, time.perf_counter()))
                cond.notify()
    with contextlib.suppress(OSError):
        srv.shutdown(socket.SHUT_WR)


def _server_to_client(srv: socket.socket, cli: socket.socket, pending: deque, cond: threading.Condition,
                      stats: Stats) -> None:
    while True:
        first = srv.recv(1)
        arrived = time.perf_counter()
        if not first:
            break
        rest = _recv_exact(srv, 7)
        if rest is None:
            break
        head = first + rest
        (size,) = struct.unpack("<Q", head)
        with cond:
            while not pending:
                cond.wait(1.0)
            name, sent = pending.popleft()
        cli.sendall(head)
        if not _pipe_payload(srv, cli, size):
            break
        with stats.lock:
            stats.answer_bytes[name] += 8 + size
            stats.wait_s[name] += arrived - sent
    with contextlib.suppress(OSError):
        cli.shutdown(socket.SHUT_WR)


def _serve_one(cli: socket.socket, target: tuple[str, int], stats: Stats) -> None:
    srv = socket.create_connection(target)
    for s in (cli, srv):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pending: deque = deque()
    cond = threading.Condition()
    with stats.lock:
        stats.connections += 1
    t = threading.Thread(target=_server_to_client, args=(srv, cli, pending, cond, stats), daemon=True)
    t.start()
    _client_to_server(cli, srv, pending, cond, stats)
    t.join()
    cli.close()
    srv.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def per_token(short: dict, long: dict, tokens: int) -> dict[str, float]:
    """Per generated token: (long run - short run) / the extra tokens generated."""

    def diff(key: str) -> float:
        return (float(long[key]) - float(short[key])) / tokens  # type: ignore[arg-type]

    out = {k: diff(k) for k in ("round_trips", "bytes_to_server", "bytes_to_client", "server_wait_total_s")}
    names = set(long["commands"]) | set(short["commands"])
    out |= {f"cmd_{n}": (long["commands"].get(n, 0) - short["commands"].get(n, 0)) / tokens for n in sorted(names)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept the client on")
    ap.add_argument("--target", required=True, help="HOST:PORT of ggml-rpc-server")
    ap.add_argument("--out", type=Path, required=True, help="JSON file written on SIGTERM/SIGINT")
    ap.add_argument("--ready-file", type=Path, help="created once the proxy listens")
    args = ap.parse_args(argv)

    stats = Stats()
    lsock = socket.create_server(_addr(args.listen))
    if args.ready_file:
        args.ready_file.touch()
    done = threading.Event()

    def stop(*_: object) -> None:
        done.set()
        lsock.close()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threads = []
    while not done.is_set():
        try:
            cli, _ = lsock.accept()
        except OSError:
            break
        t = threading.Thread(target=_serve_one, args=(cli, _addr(args.target), stats), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=5)
    args.out.write_text(json.dumps(stats.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
