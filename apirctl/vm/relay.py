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
that breaks the framing only garbles its own VM's stream, which its own backend refuses.

A VM and its backend end together, and this module alone decides it (`serve_vm`, `_end_both`). The
relay is the backend's owner (`supervised`): while it runs, the backend is kept. When QEMU ends (its
stream closes), the relay stops the backend and exits. When the backend closes a session by itself
(it refused what the guest sent) or its process dies (killed, crashed: a pidfd tells at once, even
with no session open), the relay ends the VM (`machines.end`, with one line that `ps -a` shows after
`exited:`), then stops the backend: the one stream cannot tell the guest's client that its connection
closed, so that client would otherwise wait for ever, and a VM without its backend cannot serve. This
is what a container's llama-server does by itself when its backend's socket closes: it ends. `stop`
then removes the VM's folder; nothing else is left. Notes (sessions, the graphs each computed, and why
the VM was ended) go into the backend's log.

A VM on APIR (`--transport virtgpu`) has an apir-host of its own instead (`Backend.of_apir_host`). APIR's
frontend keeps one connection for its process's life, so its stream is not split: the relay pipes it
to one connection, opened at the guest's first byte, and ends the VM and the host together as above.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from apirctl.remoting import apir_hosts, backends, supervised
from apirctl.remoting.rpc_client import Command
from apirctl.vm import machines

CONNECT_TIMEOUT = 30.0
CHUNK = 1 << 20
HEADER = struct.Struct("<BQ")
#: The commands whose count the relay notes: a graph the backend computed for the VM.
GRAPHS = (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)
NOTE = "--- apirctl relay:"
#: A backend that died has closed its sockets a moment before it ends: how long that moment may be.
DIED_WITHIN = 2.0


@dataclass(frozen=True)
class Backend:
    """What a VM's relay carries the guest's stream to, and how it ends: the VM's backend of its own
    (ggml-rpc-server, a connection per client session) or its apir-host (one stream)."""

    kind: str  # how `ps -a` names it: "rpc backend", "apir-host"
    binary: str
    pid: int
    socket: Path
    log: Path
    sessions: bool  # split the stream at each HELLO (RPC), or pipe it whole (APIR)
    stop: Callable[[], None]

    @classmethod
    def of_instance(cls, instance: backends.Instance) -> Backend:
        return cls("rpc backend", backends.BINARY, instance.pid, instance.socket, Path(instance.log), True,
                   lambda: backends.stop(instance))

    @classmethod
    def of_apir_host(cls, host: apir_hosts.Host) -> Backend:
        return cls("apir-host", apir_hosts.BINARY, apir_hosts.current_pid(host), host.socket, Path(host.log), False,
                   lambda: apir_hosts.stop(host))

    def running(self) -> bool:
        return supervised.is_process(self.pid, self.binary)


class Relay:
    """One VM's relay: the guest stream in, a backend connection per session out (or one for the whole
    stream). `run` returns why the relay ended the stream itself (the backend went: see the module's
    docstring), or "" when the stream closed (QEMU ended)."""

    def __init__(self, guest: socket.socket, backend: Backend | backends.Instance) -> None:
        self.guest = guest
        self.backend = backend if isinstance(backend, Backend) else Backend.of_instance(backend)
        self.log = self.backend.log
        self.upstream: socket.socket | None = None
        self.pump: threading.Thread | None = None
        self.ending = threading.Event()  # set by the relay before it closes a session itself
        self.sessions = 0
        self.counts: Counter[int] = Counter()
        self.why = ""
        self.done = threading.Event()  # `run` returned: nothing is noted or closed any more
        self._lock = threading.Lock()

    def note(self, text: str) -> None:
        with contextlib.suppress(OSError), self.log.open("a") as fh:
            fh.write(f"{NOTE} {text}\n")

    def backend_gone(self, why: str) -> None:
        """The backend ended a session or its process: close the guest stream (`run` returns `why`).
        Called from the answers' thread, the backend's watcher and `run`; the first reason stays."""
        with self._lock:
            if self.why or self.done.is_set():
                return
            self.why = why
        self.note(f"ending the VM: {why}")
        with contextlib.suppress(OSError):
            self.guest.shutdown(socket.SHUT_RDWR)

    def _session_dropped(self, session: int) -> None:
        """The backend closed session `session` by itself: it refused what the guest sent, or it died.
        Which one: its process ends within a moment of its sockets closing when it died."""
        if _wait_gone(self.backend, DIED_WITHIN):
            self.backend_gone(down(self.backend))
        else:
            failure = backends.failure_line(self.log)
            self.backend_gone(f"{self.backend.kind} refused the guest's session {session}: {failure}")

    def _recv_exact(self, n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            got = self.guest.recv(n - len(data))
            if not got:
                return None
            data += got
        return bytes(data)

    def _answers(self, upstream: socket.socket, session: int, ending: threading.Event) -> None:
        """Copy the backend's answers of one session to the guest, until the session closes; a close
        the relay did not ask for is the backend's (`_session_dropped`)."""
        while True:
            try:
                data = upstream.recv(CHUNK)
            except OSError:
                data = b""
            if not data:
                if not ending.is_set():
                    self._session_dropped(session)
                return
            try:
                self.guest.sendall(data)
            except OSError:  # the guest stream is gone: `run` sees it too
                return

    def _end_session(self) -> None:
        if self.upstream is None:
            return
        graphs = sum(self.counts[c] for c in GRAPHS)
        self.note(f"session {self.sessions} ended: {sum(self.counts.values())} commands, {graphs} graphs computed")
        self.ending.set()
        with contextlib.suppress(OSError):
            self.upstream.shutdown(socket.SHUT_RDWR)
        self.upstream.close()
        if self.pump is not None:
            self.pump.join(timeout=DIED_WITHIN + 5)
        self.upstream, self.pump = None, None
        self.counts.clear()

    def _new_session(self) -> socket.socket | None:
        self._end_session()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(str(self.server))
        except OSError as exc:
            upstream.close()
            gone = _wait_gone(self.backend, DIED_WITHIN)
            self.backend_gone(down(self.backend) if gone else f"{self.backend.kind} refused a new session: {exc}")
            return None
        self.sessions += 1
        self.note(f"session {self.sessions} began")
        self.upstream, self.ending = upstream, threading.Event()
        self.pump = threading.Thread(target=self._answers, args=(upstream, self.sessions, self.ending), daemon=True)
        self.pump.start()
        return upstream

    @property
    def server(self) -> Path:
        return self.backend.socket

    def run(self) -> str:
        """Until the guest stream closes (QEMU ended, or `backend_gone` closed it); returns `why`."""
        try:
            return self._sessions() if self.backend.sessions else self._pipe()
        except OSError as exc:
            self.note(f"stream ended: {exc}")
            return self.why
        finally:
            self._end_session()
            with self._lock:
                self.done.set()

    def _forward(self, upstream: socket.socket, data: bytes) -> bool:
        """`data` to the backend; False when the backend closed the connection (its answers' thread says why)."""
        try:
            upstream.sendall(data)
            return True
        except OSError:
            if self.pump is not None:
                self.pump.join(timeout=DIED_WITHIN + 5)
            self.backend_gone(self.why or f"{self.backend.kind} dropped session {self.sessions}")
            return False

    def _sessions(self) -> str:
        """A backend connection per client session, split at each HELLO (RPC)."""
        while True:
            header = self._recv_exact(HEADER.size)
            if header is None:
                return self.why
            cmd, size = HEADER.unpack(header)
            upstream = self.upstream
            if cmd == Command.HELLO or upstream is None:
                upstream = self._new_session()
                if upstream is None:
                    return self.why
            self.counts[cmd] += 1
            if cmd in GRAPHS and self.counts[cmd] == 1:
                self.note(f"session {self.sessions}: first {Command(cmd).name} (graphs computed here)")
            left = size
            data = header
            while True:
                if not self._forward(upstream, data):
                    return self.why
                if not left:
                    break
                data = self.guest.recv(min(left, CHUNK))
                if not data:
                    return self.why
                left -= len(data)

    def _pipe(self) -> str:
        """The whole stream to one backend connection, opened at the guest's first byte (APIR)."""
        while True:
            data = self.guest.recv(CHUNK)
            if not data:
                return self.why
            upstream = self.upstream or self._new_session()
            if upstream is None or not self._forward(upstream, data):
                return self.why


def down(backend: Backend | backends.Instance) -> str:
    """The one line for a VM whose backend died (a container's `ps` says `rpc backend down` too)."""
    found = backend if isinstance(backend, Backend) else Backend.of_instance(backend)
    return f"{found.kind} down: {found.binary} pid {found.pid} ended"


def _wait_gone(backend: Backend, timeout: float) -> bool:
    """Whether the backend's process ends within `timeout` seconds: a pidfd says so at once; where
    there is none, poll."""
    pid = backend.pid
    if not backend.running():
        return True
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = -1
    try:
        if pidfd >= 0 and not backend.running():  # a recycled pid: ours ended before the open
            return True
        deadline = time.monotonic() + timeout
        while backend.running():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if pidfd >= 0:
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                poller.poll(left * 1000)
            else:
                time.sleep(min(left, 0.05))
        return True
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _watch(relay: Relay) -> None:
    """The backend's death ends the VM even while no session is open (the guest idle, or not yet up).
    One pidfd, polled in slices of a second so that the relay's own end is seen too; without pidfds,
    `_wait_gone` polls the process."""
    pid = relay.backend.pid
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = -1
    try:
        poller = select.poll()
        if pidfd >= 0:
            poller.register(pidfd, select.POLLIN)
        while not relay.done.is_set():
            # a recycled pid (ours ended before the open) is not our backend: gone as well
            gone = not relay.backend.running() or (
                bool(poller.poll(1000)) if pidfd >= 0 else _wait_gone(relay.backend, 1.0))
            if gone:
                relay.backend_gone(down(relay.backend))
                return
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def serve_vm(guest: socket.socket, backend: Backend | backends.Instance, vm: str) -> str:
    """The relay's life for VM `vm`: relay its guest stream to `instance` until one of the two ends,
    then end the other. QEMU ended: the backend is stopped. The backend died or refused the guest's
    bytes: the VM is ended (`machines.end`, with the reason `ps -a` shows), then the backend stopped.
    Returns that reason ("" when QEMU ended first)."""
    relay = Relay(guest, backend)
    threading.Thread(target=_watch, args=(relay,), daemon=True).start()
    why = ""
    try:
        why = relay.run()
    finally:
        if not why:  # QEMU closed the stream: it is exiting by itself (its program ended, or a stop)
            machines.wait_gone(vm, machines.STOP_TIMEOUT)
        _end_both(vm, relay.backend, why or "its relay ended")
    return why


def _end_both(vm: str, backend: Backend, why: str) -> None:
    """The one place a VM and its backend end together: the VM (a no-op when QEMU has ended already,
    else ended with `why`), then the backend (process, socket directory, record and log)."""
    machines.end(vm, why)
    backend.stop()


def _running(pid: int) -> bool:
    state = supervised.proc_state(pid)
    return state is not None and state[0] not in ("Z", "X")


def connect_guest(path: Path, qemu_pid: int, timeout: float) -> socket.socket:
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
    owner = parser.add_mutually_exclusive_group(required=True)
    owner.add_argument("--instance", help="the VM's rpc backend (its record's id)")
    owner.add_argument("--apir-host", help="the VM's apir-host (its record's id)")
    parser.add_argument("--vm", required=True, help="the VM's name (its folder)")
    parser.add_argument("--qemu-pid", required=True, type=int, help="the VM's QEMU")
    args = parser.parse_args(argv)
    # serve hands it over to this process (an rpc backend), or attaches it to the VM (an apir-host)
    backend: Backend | None = None
    if args.instance and (instance := backends.get(args.instance)) is not None:
        backend = Backend.of_instance(instance)
    elif args.apir_host and (host := apir_hosts.get(args.apir_host)) is not None:
        backend = Backend.of_apir_host(host)
    if backend is None:
        machines.end(args.vm, f"{'rpc backend' if args.instance else 'apir-host'} gone before its relay started")
        return 1
    guest = None
    why = "its relay ended"
    try:
        guest = connect_guest(args.guest, args.qemu_pid, CONNECT_TIMEOUT)
    except OSError as exc:
        why = f"no guest stream at {args.guest}: {exc}"
    finally:
        if guest is None:  # (a SIGTERM as well): the VM and its backend end here
            _end_both(args.vm, backend, why)
    if guest is None:
        return 1
    with guest:
        serve_vm(guest, backend, args.vm)
    return 0


def _exit_on_term(_signum: int, _frame: object) -> None:
    raise SystemExit(0)  # through main's `finally`: the backend is stopped on the way out


if __name__ == "__main__":
    os.umask(0o077)
    signal.signal(signal.SIGTERM, _exit_on_term)
    raise SystemExit(main())
