"""A small client of llama.cpp's RPC server: enough to prove it is alive and describe it.

Why our own: readiness must be a protocol answer, not an open port (a port can be
held by anything), and the questions we ask (protocol version, device count, free
and total memory) are three fixed-size messages. The layout, as read in the pinned
source (`ggml/src/ggml-rpc/ggml-rpc.cpp`, protocol 7):

- request: command (1 byte), payload size (u64 little-endian), payload;
- response, for the commands that have one: payload size (u64), payload;
- the first command of a connection must be HELLO, whose payload is 24 bytes of
  transport capabilities (zeros: plain TCP) and whose answer is major, minor,
  patch, one padding byte and the server's 24 capability bytes;
- DEVICE_COUNT has no payload and answers a u32; GET_DEVICE_MEMORY takes a u32
  device index and answers free and total bytes (two u64).

The same exchange runs over the Unix-socket endpoint of apirctl's patched server
(`unix:PATH`): a client that offers all-zero capabilities in HELLO, as this one does,
stays on the socket instead of upgrading to shared memory.

The server serves one connection at a time and queues the others, so a probe that
gets no HELLO answer within its timeout means "busy with another client", not "dead".
Such an abandoned probe must be closed with a reset, not a normal close: the server
would otherwise read our queued HELLO later, answer into a closed socket, and die of
SIGPIPE (seen with the pinned version).
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum

PROTOCOL_MAJOR = 7
CAPS_SIZE = 24


class Command(IntEnum):
    """Command numbers of the RPC protocol (their order in the upstream enum)."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    # host buffers shared on shared-memory connections (llama_patches/ 0007)
    SHARE_HOST_BUFFER = 18
    UNSHARE_HOST_BUFFER = 19
    SET_TENSOR_SHARED = 20
    GET_TENSOR_SHARED = 21


# Commands the server answers; the others are fire-and-forget (a tracer needs this to pair replies).
ANSWERED = frozenset({
    Command.ALLOC_BUFFER, Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.BUFFER_GET_BASE,
    Command.SET_TENSOR_HASH, Command.GET_TENSOR, Command.COPY_TENSOR, Command.GET_DEVICE_MEMORY,
    Command.GET_ALLOC_SIZE, Command.HELLO, Command.DEVICE_COUNT,
    Command.SHARE_HOST_BUFFER, Command.SET_TENSOR_SHARED, Command.GET_TENSOR_SHARED,
})


class RpcError(Exception):
    """The peer is not a compatible RPC server (or went away mid-answer)."""


class RpcBusy(RpcError):
    """Connected, but no HELLO answer in time: the server is serving another client."""


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    free: int
    total: int


@dataclass(frozen=True)
class ServerInfo:
    """What a successful probe learnt."""

    version: str
    devices: list[DeviceMemory] = field(default_factory=list)
    latency_ms: float = 0.0

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        got = sock.recv(n - len(chunks))
        if not got:
            raise RpcError("the server closed the connection")
        chunks += got
    return bytes(chunks)


def _request(sock: socket.socket, cmd: Command, payload: bytes, answer_size: int) -> bytes:
    sock.sendall(struct.pack("<BQ", int(cmd), len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != answer_size:
        raise RpcError(f"{cmd.name}: answer of {size} bytes, expected {answer_size} (not an RPC v7 server?)")
    return _recv_exact(sock, size)


def hello(sock: socket.socket) -> str:
    """The handshake: returns "major.minor.patch"; we offer no transport upgrade (all-zero caps)."""
    answer = _request(sock, Command.HELLO, bytes(CAPS_SIZE), 4 + CAPS_SIZE)
    major, minor, patch = answer[0], answer[1], answer[2]
    return f"{major}.{minor}.{patch}"


MAX_DEVICES = 256  # more is a broken or hostile peer: never loop over 4 billion memory queries


def device_count(sock: socket.socket) -> int:
    (count,) = struct.unpack("<I", _request(sock, Command.DEVICE_COUNT, b"", 4))
    if count > MAX_DEVICES:
        raise RpcError(f"DEVICE_COUNT: {count} devices (more than {MAX_DEVICES}: not an RPC server)")
    return int(count)


def device_memory(sock: socket.socket, index: int) -> DeviceMemory:
    free, total = struct.unpack("<QQ", _request(sock, Command.GET_DEVICE_MEMORY, struct.pack("<I", index), 16))
    return DeviceMemory(index=index, free=int(free), total=int(total))


def _reset(sock: socket.socket) -> None:
    """Close with RST (linger 0) so the server's later read fails instead of its write."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


UNIX_PREFIX = "unix:"


def endpoint(host: str, port: int | None = None) -> str:
    """How an endpoint is written in messages and in llama.cpp's `--rpc`: `HOST:PORT` or `unix:PATH`."""
    return host if port is None else f"{host}:{port}"


def connect(host: str, port: int | None = None, timeout: float = 2.0) -> socket.socket:
    """A connected socket: TCP to `host:port` (no Nagle), or the Unix socket `host` = `unix:PATH`."""
    if host.startswith(UNIX_PREFIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(host.removeprefix(UNIX_PREFIX))
        except BaseException:
            sock.close()
            raise
        return sock
    if port is None:
        raise ValueError(f"{host!r}: a TCP endpoint needs a port")
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def probe(host: str, port: int | None = None, timeout: float = 2.0) -> ServerInfo:
    """Connect, handshake, and read the device list with free/total memory.

    `host` is an address with `port`, or `unix:PATH` alone. Raises ConnectionRefusedError/
    FileNotFoundError/OSError when nothing listens, RpcBusy when the server is busy with another
    client, RpcError for anything that is not an RPC v7 server.
    """
    start = time.monotonic()
    where = endpoint(host, port)
    with connect(host, port, timeout) as sock:
        try:
            version = hello(sock)
        except TimeoutError as exc:
            _reset(sock)
            raise RpcBusy(f"{where} accepted but did not answer HELLO within {timeout:g}s") from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise RpcError(f"{where} dropped the connection during HELLO") from exc
        if int(version.split(".")[0]) != PROTOCOL_MAJOR:
            raise RpcError(f"{where} speaks RPC protocol {version}; this apirctl speaks {PROTOCOL_MAJOR}.x")
        try:
            devices = [device_memory(sock, i) for i in range(device_count(sock))]
        except TimeoutError as exc:
            _reset(sock)
            raise RpcError(f"{where} stopped answering after HELLO") from exc
    return ServerInfo(version=version, devices=devices, latency_ms=(time.monotonic() - start) * 1000)
