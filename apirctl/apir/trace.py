"""Trace files of `apir-host --trace`: every command a frontend sent, its reply and its time.

Why a file and not a capture: on Linux the frontend and `apir-host` share memory, so nothing
crosses a socket that a sniffer could read; the host writes what it dispatched instead. The
format (all little-endian):

    "APIRTRC1"                                   8-byte magic
    then per command, a 40-byte record header:
      u32 cmd_type  u32 cmd_flags  u32 ret  u32 request_len  u32 reply_len  u32 reserved
      u64 start_ns  u64 duration_ns
    followed by request_len bytes of the whole command (its 12-byte header, then the function's
    fields) and reply_len bytes of the reply fields.

The file comes from a process that parses bytes a container chose, so it is read as hostile:
lengths are checked against what is there (and against `MAX_PART`) before anything is allocated,
and a bad file is an `ApirTraceError` naming the record and the byte, never an exception from
deep inside. A record whose fields do not decode is still a record (`Record.problem`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from apirctl.apir import extensions, messages, protocol, table
from apirctl.apir.wire import ApirDecodeError, Decoder

MAGIC = b"APIRTRC1"
HEADER = struct.Struct("<IIIIIIQQ")
#: No request or reply of the protocol comes near this (commands are a few KiB; bulk data is in
#: shared memory, not in the trace); a larger length means a corrupt or hostile file.
MAX_PART = 64 << 20


#: the commands that carry a token's writes, graph and outputs
_GRAPH_RUNS = (extensions.GRAPH_RUN, extensions.GRAPH_DELTA)


class ApirTraceError(ValueError):
    """The file is not a trace, or is cut or corrupt at `offset`."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(f"{message} (at byte {offset})")
        self.offset = offset


@dataclass(frozen=True)
class Record:
    """One dispatched command: what the frontend sent, what the host answered, and when."""

    index: int  # 0-based position in the file
    offset: int  # byte offset of the record header
    cmd_type: int
    cmd_flags: int
    ret: int
    start_ns: int
    duration_ns: int
    request: bytes
    reply: bytes
    #: the host had granted FEATURE_WIDE_TENSORS before this command: its tensors are wide records
    wide_tensors: bool = False
    #: the host had granted FEATURE_OUTPUT_RESOURCES: each output of a graph run names its resource
    output_resources: bool = False

    @property
    def kind(self) -> str:
        """HANDSHAKE, LOADLIBRARY, FORWARD, or `unknown(N)`."""
        try:
            return protocol.CommandType(self.cmd_type).name
        except ValueError:
            return f"unknown({self.cmd_type})"

    @property
    def function(self) -> table.Function | None:
        """The forwarded function (FORWARD with an index inside the table), else None."""
        if self.cmd_type == protocol.CommandType.FORWARD and 0 <= self.cmd_flags < table.dispatch_table_count():
            return table.by_index(self.cmd_flags)
        return None

    @property
    def name(self) -> str:
        """What people call this command: the function's name for a FORWARD, else the kind."""
        fn = self.function
        if fn is not None:
            return fn.qualname
        if self.cmd_type == protocol.CommandType.FORWARD:
            return extensions.NAMES.get(self.cmd_flags, f"unknown function {self.cmd_flags}")
        return self.kind.lower()

    @property
    def outcome(self) -> str:
        """The return code in words (each command type has its own table)."""
        return describe_ret(self.cmd_type, self.ret)

    @property
    def ok(self) -> bool:
        if self.cmd_type == protocol.CommandType.FORWARD:
            return self.ret == protocol.ForwardCode.BASE_INDEX
        if self.cmd_type == protocol.CommandType.HANDSHAKE:
            return self.ret == protocol.HANDSHAKE_MAGIC
        if self.cmd_type == protocol.CommandType.LOADLIBRARY:  # 6 + 0: the library initialized
            return self.ret in (protocol.LoadLibraryCode.SUCCESS, protocol.LoadLibraryCode.INIT_BASE_INDEX)
        return False

    def arguments(self) -> dict[str, Any]:
        """The request's fields and the reply's, decoded with `messages` (plain JSON values);
        raises `ApirDecodeError` when they do not decode."""
        out: dict[str, Any] = {}
        if len(self.request) < protocol.COMMAND_HEADER_SIZE:
            raise ApirDecodeError("request shorter than the command header", len(self.request))
        ctype, flags, res, rest = messages.decode_command(self.request)
        out["reply_res_id"] = res
        if ctype != self.cmd_type or (ctype == protocol.CommandType.FORWARD and flags != self.cmd_flags):
            out["header_mismatch"] = {"cmd_type": ctype, "cmd_flags": flags}
        fn = self.function
        if self.cmd_type == protocol.CommandType.HANDSHAKE:
            dec = Decoder(rest)
            out["request"] = {"major": dec.u32(), "minor": dec.u32()}
            if self.reply:
                reply = Decoder(self.reply)
                out["reply"] = {"major": reply.u32(), "minor": reply.u32()}
        elif fn is not None:
            out["request"] = {k: messages.plain(v)
                              for k, v in messages.decode_request(fn, rest, wide=self.wide_tensors).items()}
            if fn.reply and self.ok:
                out["reply"] = {k: messages.plain(v) for k, v in messages.decode_reply(fn, self.reply).items()}
        elif self.cmd_type == protocol.CommandType.FORWARD and self.cmd_flags in _GRAPH_RUNS:
            run = extensions.GraphRun.decode(rest, delta=self.cmd_flags == extensions.GRAPH_DELTA,
                                             output_resources=self.output_resources)
            out["request"] = {"graph_id": run.graph_id, "res_id": run.res_id, "graph_size": run.graph_size,
                              **({} if run.n_changes is None else {"n_changes": run.n_changes}),
                              "writes_offset": run.writes_offset, "n_writes": run.n_writes,
                              "out_res_id": run.out_res_id,
                              "outputs": [{"node": o.node, "offset": o.offset,
                                           **({} if o.res_id is None else {"res_id": o.res_id})}
                                          for o in run.outputs]}
            if self.ok:
                result, status = extensions.decode_graph_run_reply(self.reply)
                out["reply"] = {"result": result, "status": status}
        elif self.cmd_type == protocol.CommandType.FORWARD and self.cmd_flags == extensions.TENSORS_GET:
            get = extensions.TensorsGet.decode(rest)
            out["request"] = {"res_id": get.res_id, "n_reads": get.n_reads}
        elif self.cmd_type == protocol.CommandType.FORWARD and self.cmd_flags == extensions.GET_FEATURES:
            wanted = extensions.decode_features_request(rest)
            if wanted is not None:
                out["request"] = {"wanted": wanted}
            if self.ok:
                out["reply"] = {"features": extensions.decode_features(self.reply)}
        return out

    def features_granted(self) -> int | None:
        """The features an answered EXT_GET_FEATURES granted, else None."""
        if not (self.cmd_type == protocol.CommandType.FORWARD and self.cmd_flags == extensions.GET_FEATURES
                and self.ok and len(self.reply) >= 8):
            return None
        return extensions.decode_features(self.reply)

    def graph_run(self) -> tuple[extensions.GraphRun, int] | None:
        """An answered EXT_GRAPH_RUN's or EXT_GRAPH_DELTA's request and result, else None (also when it
        does not decode)."""
        if not (self.cmd_type == protocol.CommandType.FORWARD and self.cmd_flags in _GRAPH_RUNS and self.ok
                and len(self.request) >= protocol.COMMAND_HEADER_SIZE):
            return None
        try:
            run = extensions.GraphRun.decode(messages.decode_command(self.request)[3],
                                             delta=self.cmd_flags == extensions.GRAPH_DELTA,
                                             output_resources=self.output_resources)
            return run, extensions.decode_graph_run_reply(self.reply)[0]
        except (ApirDecodeError, ValueError):
            return None

    def tensors_get(self) -> extensions.TensorsGet | None:
        """An answered EXT_TENSORS_GET's request, else None (also when it does not decode)."""
        if not (self.cmd_type == protocol.CommandType.FORWARD and self.cmd_flags == extensions.TENSORS_GET
                and self.ok and len(self.request) >= protocol.COMMAND_HEADER_SIZE):
            return None
        try:
            return extensions.TensorsGet.decode(messages.decode_command(self.request)[3])
        except (ApirDecodeError, ValueError):
            return None

    def graph_bytes_sent(self) -> int:
        """Bytes of graph serialization this command made the host read (0 for every other command)."""
        if self.function is not None and self.function.qualname == "backend_graph_compute" and self.ok:
            try:
                return int(messages.decode_request(self.function, messages.decode_command(self.request)[3],
                                                   wide=self.wide_tensors).get("graph_size", 0))
            except (ApirDecodeError, ValueError):
                return 0
        found = self.graph_run()
        return found[0].graph_bytes if found else 0

    def problem(self) -> str | None:
        """Why the arguments do not decode, or None."""
        try:
            self.arguments()
        except (ApirDecodeError, ValueError) as exc:
            return str(exc)
        return None

    def as_dict(self, with_arguments: bool = False) -> dict[str, Any]:
        """The record as JSON-ready values (`with_arguments`: the decoded fields too)."""
        out: dict[str, Any] = {
            "index": self.index, "kind": self.kind, "function": self.name, "cmd_flags": self.cmd_flags,
            "ret": self.ret, "outcome": self.outcome, "ok": self.ok, "request_bytes": len(self.request),
            "reply_bytes": len(self.reply), "start_ns": self.start_ns, "duration_ns": self.duration_ns,
        }
        if with_arguments:
            try:
                out["arguments"] = self.arguments()
            except (ApirDecodeError, ValueError) as exc:
                out["undecodable"] = str(exc)
        return out


def describe_ret(cmd_type: int, ret: int) -> str:
    """A return code as the host's table for that command type names it."""
    if cmd_type == protocol.CommandType.HANDSHAKE:
        return "ok" if ret == protocol.HANDSHAKE_MAGIC else f"refused ({ret:#x})"
    if cmd_type == protocol.CommandType.LOADLIBRARY:
        return protocol.describe_load_library(ret)
    if cmd_type == protocol.CommandType.FORWARD:
        if ret >= protocol.ForwardCode.BASE_INDEX:
            inner = ret - protocol.ForwardCode.BASE_INDEX
            return "ok" if inner == 0 else f"function failed ({inner})"
        return protocol.ForwardCode(ret).name
    return str(ret)


# --- reading ---------------------------------------------------------------------------------------


class _Source:
    """Bytes of a trace as they become available: a whole buffer, or a file that may still grow."""

    def __init__(self, fh: BinaryIO, follow: bool, wait: Callable[[], bool]) -> None:
        self.fh = fh
        self.follow = follow
        self.wait = wait
        self.pos = 0

    def read(self, size: int, what: str, record: int) -> bytes | None:
        """`size` bytes, or None at a clean end (nothing at all was there); a partial read is an
        error unless following, where it waits for the writer."""
        chunks: list[bytes] = []
        got = 0
        while got < size:
            data = self.fh.read(size - got)
            if data:
                chunks.append(data)
                got += len(data)
                continue
            if self.follow and self.wait():
                continue
            if got == 0 and what == "record header":
                return None
            where = "the magic" if record < 0 else f"record {record}"
            raise ApirTraceError(f"trace cut short in {where}: {what} needs {size} bytes, {got} there",
                                 self.pos + got)
        self.pos += size
        return b"".join(chunks)


def records(fh: BinaryIO, follow: bool = False, wait: Callable[[], bool] | None = None,
            live: bool = False) -> Iterator[Record]:
    """The records of the trace open in `fh`, as they are read.

    With `follow`, the end of the file is not the end of the trace: `wait()` is called there and
    reading goes on while it returns True (default: sleep 0.2 s, forever). With `live` (a host that
    is still writing), a last record cut short ends the trace instead of being an error.
    """

    def sleep() -> bool:
        time.sleep(0.2)
        return True

    src = _Source(fh, follow, wait or sleep)
    try:
        magic = src.read(len(MAGIC), "magic", -1)
    except ApirTraceError as exc:
        raise ApirTraceError(f"not an APIR trace: {exc.offset} bytes, shorter than its magic", 0) from None
    if magic != MAGIC:
        raise ApirTraceError(f"not an APIR trace: it starts with {magic!r}, not {MAGIC.decode()}", 0)
    index = 0
    wide = False  # as the host reads the client's tensors: narrow until a reply grants the wide records
    placed = False  # outputs name their resources once a reply grants it
    while True:
        offset = src.pos
        try:
            head = src.read(HEADER.size, "record header", index)
        except ApirTraceError:
            if live:
                return
            raise
        if head is None:
            return
        cmd_type, cmd_flags, ret, request_len, reply_len, _reserved, start_ns, duration_ns = HEADER.unpack(head)
        for what, length in (("request", request_len), ("reply", reply_len)):
            if length > MAX_PART:
                raise ApirTraceError(f"record {index} claims a {what} of {length} bytes (more than "
                                     f"{MAX_PART >> 20} MiB: a corrupt file)", offset)
        try:
            request = src.read(request_len, "request", index) or b""
            reply = src.read(reply_len, "reply", index) or b""
        except ApirTraceError:
            if live:
                return
            raise
        record = Record(index=index, offset=offset, cmd_type=cmd_type, cmd_flags=cmd_flags, ret=ret,
                        start_ns=start_ns, duration_ns=duration_ns, request=request, reply=reply, wide_tensors=wide,
                        output_resources=placed)
        granted = record.features_granted()
        if granted is not None:
            wide = bool(granted & extensions.FEATURE_WIDE_TENSORS)
            placed = bool(granted & extensions.FEATURE_OUTPUT_RESOURCES)
        yield record
        index += 1


def read(data: bytes) -> list[Record]:
    """Every record of a whole trace held in memory."""
    import io

    return list(records(io.BytesIO(data)))


# --- the summary -----------------------------------------------------------------------------------


@dataclass
class FunctionStats:
    """Calls of one function (or command kind) in a trace."""

    name: str
    calls: int = 0
    failed: int = 0
    total_ns: int = 0
    max_ns: int = 0
    request_bytes: int = 0
    reply_bytes: int = 0

    def add(self, record: Record) -> None:
        self.calls += 1
        self.failed += 0 if record.ok else 1
        self.total_ns += record.duration_ns
        self.max_ns = max(self.max_ns, record.duration_ns)
        self.request_bytes += len(record.request)
        self.reply_bytes += len(record.reply)

    def as_dict(self) -> dict[str, Any]:
        return {"function": self.name, "calls": self.calls, "failed": self.failed, "total_ns": self.total_ns,
                "mean_ns": self.total_ns // self.calls if self.calls else 0, "max_ns": self.max_ns,
                "request_bytes": self.request_bytes, "reply_bytes": self.reply_bytes}


@dataclass
class GraphCache:
    """How the graphs of EXT_GRAPH_RUN travelled: named by id (`by_id`, the host's kept graph), sent
    (`sent`, first use or changed), updated by a delta (`delta`, EXT_GRAPH_DELTA: only the tensors whose
    shapes or places changed), or named but no longer kept (`unknown`) or a delta not taken
    (`delta_refused`), sent again after. `outputs_placed`: outputs the host wrote into a resource other
    than the run's outputs' one (where the frontend's caller reads them, patch 0029); `reads` in
    `read_calls`: reads of device memory answered together (EXT_TENSORS_GET, patch 0028)."""

    by_id: int = 0
    sent: int = 0
    delta: int = 0
    unknown: int = 0
    delta_refused: int = 0
    writes: int = 0
    outputs: int = 0
    outputs_placed: int = 0
    reads: int = 0
    read_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"by_id": self.by_id, "sent": self.sent, "delta": self.delta, "unknown": self.unknown,
                "delta_refused": self.delta_refused, "writes": self.writes, "outputs": self.outputs,
                "outputs_placed": self.outputs_placed, "reads": self.reads, "read_calls": self.read_calls}


@dataclass
class Summary:
    """Calls per function and where the time went.

    `calls_per_compute` is the number of synchronous round trips per graph compute: in generation,
    one compute is one token, so this is the calls-per-token figure the frontend pays for. A compute
    is a `backend_graph_compute` or an `ext_graph_run` that computed a graph.
    """

    functions: dict[str, FunctionStats] = field(default_factory=dict)
    graph_cache: GraphCache = field(default_factory=GraphCache)
    ext_computes: int = 0
    graph_bytes: int = 0  # graph serializations the host read, summed
    records: int = 0
    failed: int = 0
    host_ns: int = 0  # time inside the host's dispatch, summed
    first_ns: int | None = None
    last_end_ns: int | None = None

    def add(self, record: Record) -> None:
        stats = self.functions.setdefault(record.name, FunctionStats(record.name))
        stats.add(record)
        self.records += 1
        self.failed += 0 if record.ok else 1
        self.host_ns += record.duration_ns
        self.first_ns = record.start_ns if self.first_ns is None else min(self.first_ns, record.start_ns)
        end = record.start_ns + record.duration_ns
        self.last_end_ns = end if self.last_end_ns is None else max(self.last_end_ns, end)
        self.graph_bytes += record.graph_bytes_sent()
        reads = record.tensors_get()
        if reads is not None:
            self.graph_cache.reads += reads.n_reads
            self.graph_cache.read_calls += 1
        found = record.graph_run()
        if found is not None:
            run, result = found
            cache = self.graph_cache
            if result == extensions.RESULT_UNKNOWN_GRAPH:
                cache.unknown += 1
                return
            if result == extensions.RESULT_DELTA_REFUSED:
                cache.delta_refused += 1
                return
            cache.writes += run.n_writes
            cache.outputs += len(run.outputs)
            cache.outputs_placed += sum(1 for o in run.outputs if o.res_id not in (None, run.out_res_id))
            if run.graph_id:
                self.ext_computes += 1
                if run.n_changes is not None:
                    cache.delta += 1
                elif run.graph_size:
                    cache.sent += 1
                else:
                    cache.by_id += 1

    @property
    def span_ns(self) -> int:
        """From the first command's start to the last one's end (the session's wall time)."""
        if self.first_ns is None or self.last_end_ns is None:
            return 0
        return self.last_end_ns - self.first_ns

    @property
    def computes(self) -> int:
        found = self.functions.get("backend_graph_compute")
        return (found.calls if found else 0) + self.ext_computes

    @property
    def graph_bytes_per_compute(self) -> float | None:
        return self.graph_bytes / self.computes if self.computes else None

    @property
    def calls_per_compute(self) -> float | None:
        forwarded = sum(s.calls for name, s in self.functions.items() if name not in ("handshake", "loadlibrary"))
        return forwarded / self.computes if self.computes else None

    def rows(self) -> list[FunctionStats]:
        """Functions by time spent, most first."""
        return sorted(self.functions.values(), key=lambda s: (-s.total_ns, s.name))

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "failed": self.failed, "host_ns": self.host_ns, "span_ns": self.span_ns,
                "graph_computes": self.computes, "calls_per_compute": self.calls_per_compute,
                "graph_bytes_per_compute": self.graph_bytes_per_compute, "graph_cache": self.graph_cache.as_dict(),
                "functions": [s.as_dict() for s in self.rows()]}


def summarize(found: list[Record]) -> Summary:
    summary = Summary()
    for record in found:
        summary.add(record)
    return summary


# --- writing (for tests and tools that make traces) -----------------------------------------------


def encode_record(request: bytes, reply: bytes = b"", ret: int | None = None, start_ns: int = 0,
                  duration_ns: int = 0) -> bytes:
    """One record for `request` (a whole encoded command: `messages.encode_forward` and friends);
    `ret` defaults to the command type's success code."""
    ctype, flags = struct.unpack_from("<ii", request, 0) if len(request) >= 8 else (0, 0)
    if ctype >= protocol.VENUS_COMMAND_TYPE_LENGTH:
        ctype -= protocol.VENUS_COMMAND_TYPE_LENGTH
    if ret is None:
        ret = {protocol.CommandType.HANDSHAKE: protocol.HANDSHAKE_MAGIC,
               protocol.CommandType.LOADLIBRARY: protocol.LoadLibraryCode.INIT_BASE_INDEX}.get(
            ctype, protocol.ForwardCode.BASE_INDEX)
    return HEADER.pack(ctype & 0xFFFFFFFF, flags & 0xFFFFFFFF, int(ret), len(request), len(reply), 0, start_ns,
                       duration_ns) + request + reply
