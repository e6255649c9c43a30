"""Talk to the backend library in a child process: a crash there is a report here, not our death.

`BackendProcess` starts `python -m apirctl.apir.child`, loads the library in it and forwards calls
encoded with `messages`. Every call is named; if the child dies during one, `BackendCrashed` says
which call, the signal, and the last lines the library printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from apirctl.apir import extensions, messages, protocol, table
from apirctl.apir.child import read_frame, write_frame
from apirctl.apir.wire import Decoder


class HostError(Exception):
    """The child could not do what was asked (e.g. the file is not a backend library)."""


class BackendCrashed(Exception):
    """The child hosting the library died (or hung and was killed) while running `call`."""

    def __init__(self, call: str, returncode: int | None, stderr: str, timeout: float | None = None) -> None:
        self.call = call
        self.returncode = returncode
        self.stderr = stderr
        self.timed_out = timeout is not None
        why = f"no answer in {timeout:g} s, killed" if timeout is not None else describe_exit(returncode)
        verb = "hung" if timeout is not None else "crashed"
        super().__init__(f"the backend library {verb} during {call} ({why})")


#: Words of a GGML backend's stderr line that says why it died (for `apirctl.errors.tail(telling=...)`).
CRASH_WORDS = ("GGML_ASSERT", "what()", "error", "WARNING", "reading too much")


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class BackendProcess:
    """A child process holding one loaded backend library."""

    def __init__(self, timeout: float = 120.0) -> None:
        """`timeout`: seconds one call may take before the child is considered hung and killed."""
        self.timeout = timeout
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("GGML_NO_BACKTRACE", "1")  # ggml's abort would otherwise attach gdb: slow, noisy
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "apirctl.apir.child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=env)
        self._next_res = 100
        #: the library granted extensions.FEATURE_WIDE_TENSORS (`negotiate`): `call` sends wide records
        self.wide_tensors = False

    def __enter__(self) -> BackendProcess:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def stderr(self) -> str:
        """What the child has written to stderr: the library's own log and its last words. The caller
        picks the lines it quotes (`apirctl.errors.tail`); this package imports nothing outside itself."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _call(self, name: str, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            self.proc.kill()

        watchdog = threading.Timer(self.timeout, kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            write_frame(self.proc.stdin, header, payload)  # type: ignore[arg-type]
            frame = read_frame(self.proc.stdout)  # type: ignore[arg-type]
        except BrokenPipeError:
            frame = None
        finally:
            watchdog.cancel()
        if frame is None:
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = None
            raise BackendCrashed(name, rc, self.stderr(), self.timeout if fired.is_set() else None)
        head, body = frame
        if "error" in head:
            raise HostError(f"{name}: {head['error']}")
        return head, body

    # ---- operations ----

    def load(self, library: Path, ggml_library: Path | None, reg: str | None) -> None:
        """Load the library (dlopen) without initializing it."""
        self._call("dlopen", self._libs("load", library, ggml_library, reg))

    def initialize(self, library: Path, ggml_library: Path | None, reg: str | None) -> int:
        """Load the library if needed and call apir_backend_initialize: its return code."""
        head, _ = self._call("apir_backend_initialize", self._libs("init", library, ggml_library, reg))
        return int(head["code"])

    @staticmethod
    def _libs(op: str, library: Path, ggml_library: Path | None, reg: str | None) -> dict[str, Any]:
        return {"op": op, "library": str(library), "ggml_library": str(ggml_library) if ggml_library else None,
                "reg": reg}

    def deinit(self) -> None:
        self._call("apir_backend_deinit", {"op": "deinit"})

    def shmem(self, size: int) -> int:
        """Allocate a shared resource of `size` bytes; returns its resource id."""
        res = self._next_res
        self._next_res += 1
        self._call("shmem_alloc", {"op": "shmem_alloc", "res_id": res, "size": size})
        return res

    def shmem_write(self, res_id: int, data: bytes, offset: int = 0) -> None:
        self._call("shmem_write", {"op": "shmem_write", "res_id": res_id, "offset": offset}, data)

    def shmem_read(self, res_id: int, size: int, offset: int = 0) -> bytes:
        return self._call("shmem_read", {"op": "shmem_read", "res_id": res_id, "offset": offset,
                                         "size": size})[1]

    def rss_kb(self) -> int:
        return int(self._call("rss", {"op": "rss"})[0]["rss_kb"])

    def dispatch_raw(self, cmd: int, request: bytes, repeat: int = 1, name: str | None = None,
                     ) -> tuple[int, bytes, list[int]]:
        """Send any bytes as any command index: (dispatcher return code, reply bytes, ns per call)."""
        ret, body, times, _ = self.dispatch_limited(cmd, request, repeat=repeat, name=name)
        return ret, body, times

    def dispatch_limited(self, cmd: int, request: bytes, reply_limit: int | None = None, repeat: int = 1,
                         name: str | None = None) -> tuple[int, bytes, list[int], int]:
        """Like `dispatch_raw`, with a reply area of `reply_limit` bytes; also how far the library wrote past it."""
        label = name or (table.by_index(cmd).qualname if 0 <= cmd < table.dispatch_table_count()
                         else f"command {cmd}")
        header: dict[str, Any] = {"op": "dispatch", "cmd": cmd, "repeat": repeat}
        if reply_limit is not None:
            header["reply_limit"] = reply_limit
        head, body = self._call(label, header, request)
        return int(head["ret"]), body, [int(t) for t in head["times_ns"]], int(head.get("overrun", 0))

    def negotiate(self, wanted: int | None) -> int | None:
        """EXT_GET_FEATURES asking for `wanted` (None: the empty request of a frontend from before the
        negotiation). The features granted, as a frontend keeps them; None when the library lacks the
        command (upstream's). From then on `call` sends tensors in the width granted."""
        request = b"" if wanted is None else extensions.encode_features_request(wanted)
        ret, reply, _ = self.dispatch_raw(extensions.GET_FEATURES, request, name="ext_get_features")
        if ret == protocol.FORWARD_INDEX_INVALID:
            self.wide_tensors = False
            return None
        if ret != 0:
            raise CallFailed("ext_get_features", ret)
        granted = extensions.decode_features(reply)
        if wanted is not None:
            granted = extensions.granted(wanted, granted)
        self.wide_tensors = bool(granted & extensions.FEATURE_WIDE_TENSORS)
        return granted

    def call(self, fn: table.Function | str, repeat: int = 1, **values: Any,
             ) -> tuple[dict[str, Any], list[int]]:
        """Encode a request, forward it, check the return code, decode the reply."""
        f = table.by_name(fn) if isinstance(fn, str) else fn
        request = messages.encode_request(f, wide=self.wide_tensors, **values)
        ret, reply, times = self.dispatch_raw(f.index, request, repeat, f.qualname)
        if ret != 0:
            raise CallFailed(f.qualname, ret)
        dec = Decoder(reply)
        return {fld.name: messages.decode_field(dec, fld) for fld in f.reply}, times

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BackendCrashed, HostError):
                self._call("exit", {"op": "exit"})
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()


class CallFailed(Exception):
    """The dispatched function answered a non-zero code (virglrenderer adds FORWARD base 4)."""

    def __init__(self, call: str, code: int) -> None:
        self.call = call
        self.code = code
        fwd = protocol.ForwardCode.BASE_INDEX + code
        super().__init__(f"{call} answered {code} (FORWARD code {fwd})")
