"""The child process that hosts the backend library: `python -m apirctl.apir.child`.

It reads framed requests on stdin and answers on the original stdout; the library's own prints are
sent to stderr (fd 1 is redirected there) so they cannot corrupt the framing. A frame is a uint32
length and a JSON header, then a uint32 length and a binary payload. When the library crashes,
this process dies and the parent (`session.BackendProcess`) reports which call did it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO

from apirctl.apir.host import Host

_LEN = struct.Struct("<I")


def write_frame(out: BinaryIO, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    out.write(_LEN.pack(len(head)) + head + _LEN.pack(len(payload)) + payload)
    out.flush()


def _read_exact(inp: BinaryIO, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = inp.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_frame(inp: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    """One frame, or None at end of stream (the other side is gone)."""
    raw = _read_exact(inp, 4)
    if raw is None:
        return None
    head = _read_exact(inp, _LEN.unpack(raw)[0])
    raw = _read_exact(inp, 4) if head is not None else None
    if head is None or raw is None:
        return None
    payload = _read_exact(inp, _LEN.unpack(raw)[0])
    if payload is None:
        return None
    return json.loads(head), payload


def _rss_kb() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    host: Host | None = None
    while (frame := read_frame(inp)) is not None:
        req, payload = frame
        op = req["op"]
        try:
            if op in ("load", "init"):
                if host is None:
                    host = Host(Path(req["library"]),
                                Path(req["ggml_library"]) if req.get("ggml_library") else None, req.get("reg"))
                write_frame(out, {"code": host.initialize()} if op == "init" else {})
                continue
            if host is None:
                raise RuntimeError("load the library first")
            if op == "dispatch":
                limit = req.get("reply_limit")
                ret, reply, times, overrun = host.dispatch(int(req["cmd"]), payload, int(req.get("repeat", 1)),
                                                           None if limit is None else int(limit))
                write_frame(out, {"ret": ret, "times_ns": times, "overrun": overrun}, reply)
            elif op == "shmem_alloc":
                host.shmem_alloc(int(req["res_id"]), int(req["size"]))
                write_frame(out, {})
            elif op == "shmem_write":
                host.shmem_write(int(req["res_id"]), int(req["offset"]), payload)
                write_frame(out, {})
            elif op == "shmem_read":
                write_frame(out, {}, host.shmem_read(int(req["res_id"]), int(req["offset"]), int(req["size"])))
            elif op == "rss":
                write_frame(out, {"rss_kb": _rss_kb()})
            elif op == "deinit":
                host.deinit()
                write_frame(out, {})
            elif op == "exit":
                write_frame(out, {})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except (OSError, ValueError, RuntimeError, KeyError, AttributeError) as exc:
            write_frame(out, {"error": f"{type(exc).__name__}: {exc}"})


def main() -> None:
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the library prints goes to stderr
    serve(sys.stdin.buffer, proto_out)


if __name__ == "__main__":
    main()
