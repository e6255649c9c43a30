"""The host end of a VM's RPC stream: one byte stream from QEMU, one connection to the VM's backend
per client session.

Why it exists: QEMU 7.2 carries the guest's connection to the host by a `guestfwd` of its restricted
user network to a chardev, and a chardev is one stream for the VM's life: the guest's connections to
the forwarded address all arrive on it, one after the other, and nothing marks where one ends. llama.cpp's
RPC client opens several in turn (device count, memory, then the model's), each beginning with HELLO,
and `ggml-rpc-server` serves a connection from its HELLO to its close. So the relay reads the framing of
what the guest sends (a command byte and a u64 size, then that many bytes, which it forwards in chunks
without keeping them) and, at a HELLO on a message boundary, closes the backend connection of the
session before and opens a new one. What the backend answers goes back unread.

It parses only 9-byte headers of hostile bytes, allocates nothing by a size the guest sends, and
holds no state the guest can grow: the backend (sandboxed, capped) checks everything else. A guest
that breaks the framing only garbles its own session, which the backend refuses.

The relay is the backend's owner (`supervised`): while it runs, the backend is kept; when QEMU ends
(its stream closes), the relay stops the backend and exits, so the VM's backend ends with its VM.
Its notes (sessions, and the graphs each computed) go into the backend's log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path

from apirctl.remoting import backends, supervised
from apirctl.remoting.rpc_client import Command

CONNECT_TIMEOUT = 30.0
CHUNK = 1 << 20
HEADER = struct.Struct("<BQ")
#: The commands whose count the relay notes: a graph the backend computed for the VM.
GRAPHS = (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)
NOTE = "--- apirctl relay:"


class Relay:
    """One VM's relay: the guest stream in, a backend connection per session out."""

    def __init__(self, guest: socket.socket, server: Path, log: Path) -> None:
        self.guest = guest
        self.server = server
        self.log = log
        self.upstream: socket.socket | None = None
        self.pump: threading.Thread | None = None
        self.sessions = 0
        self.counts: Counter[int] = Counter()

    def note(self, text: str) -> None:
        with contextlib.suppress(OSError), self.log.open("a") as fh:
            fh.write(f"{NOTE} {text}\n")

    def _recv_exact(self, n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            got = self.guest.recv(n - len(data))
            if not got:
                return None
            data += got
        return bytes(data)

    def _answers(self, upstream: socket.socket) -> None:
        """Copy the backend's answers of one session to the guest, until the session closes."""
        with contextlib.suppress(OSError):
            while True:
                data = upstream.recv(CHUNK)
                if not data:
                    return
                self.guest.sendall(data)

    def _end_session(self) -> None:
        if self.upstream is None:
            return
        graphs = sum(self.counts[c] for c in GRAPHS)
        self.note(f"session {self.sessions} ended: {sum(self.counts.values())} commands, {graphs} graphs computed")
        with contextlib.suppress(OSError):
            self.upstream.shutdown(socket.SHUT_RDWR)
        self.upstream.close()
        if self.pump is not None:
            self.pump.join(timeout=5)
        self.upstream, self.pump = None, None
        self.counts.clear()

    def _new_session(self) -> socket.socket:
        self._end_session()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(str(self.server))
        self.sessions += 1
        self.note(f"session {self.sessions} began")
        self.upstream = upstream
        self.pump = threading.Thread(target=self._answers, args=(upstream,), daemon=True)
        self.pump.start()
        return upstream

    def run(self) -> None:
        """Until the guest stream (QEMU) closes, or the backend refuses a new session."""
        try:
            while True:
                header = self._recv_exact(HEADER.size)
                if header is None:
                    return
                cmd, size = HEADER.unpack(header)
                upstream = self.upstream
                if cmd == Command.HELLO or upstream is None:
                    upstream = self._new_session()
                self.counts[cmd] += 1
                if cmd in GRAPHS and self.counts[cmd] == 1:
                    self.note(f"session {self.sessions}: first {Command(cmd).name} (graphs computed here)")
                upstream.sendall(header)
                left = size
                while left:
                    data = self.guest.recv(min(left, CHUNK))
                    if not data:
                        return
                    left -= len(data)
                    with contextlib.suppress(OSError):  # a session the backend dropped: skip to the next
                        upstream.sendall(data)
        except OSError as exc:
            self.note(f"stream ended: {exc}")
        finally:
            self._end_session()


def _running(pid: int) -> bool:
    state = supervised.proc_state(pid)
    return state is not None and state[0] not in ("Z", "X")


def _connect(path: Path, qemu_pid: int, timeout: float) -> socket.socket:
    """QEMU's chardev socket; given up on at once when QEMU is gone (a VM killed as it started)."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline or not _running(qemu_pid):
                raise
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="apirctl.vm.relay")
    parser.add_argument("--guest", required=True, type=Path, help="QEMU's chardev socket of the guest stream")
    parser.add_argument("--instance", required=True, help="the VM's backend (its record's id)")
    parser.add_argument("--qemu-pid", required=True, type=int, help="the VM's QEMU")
    args = parser.parse_args(argv)
    instance = backends.get(args.instance)  # serve hands it over to this process: kept while it runs
    if instance is None:
        return 1
    log = Path(instance.log)
    try:
        try:
            guest = _connect(args.guest, args.qemu_pid, CONNECT_TIMEOUT)
        except OSError as exc:
            with contextlib.suppress(OSError), log.open("a") as fh:
                fh.write(f"{NOTE} no guest stream at {args.guest}: {exc}\n")
            return 1
        with guest:
            Relay(guest, instance.socket, log).run()
    finally:  # the VM is gone: its backend goes with it
        backends.stop(args.instance)
    return 0


def _exit_on_term(_signum: int, _frame: object) -> None:
    raise SystemExit(0)  # through main's `finally`: the backend is stopped on the way out


if __name__ == "__main__":
    os.umask(0o077)
    signal.signal(signal.SIGTERM, _exit_on_term)
    raise SystemExit(main())
