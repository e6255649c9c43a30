"""`apirctl backend selftest`: drive the real host backend library through APIR, from Python.

Loads `libggml-virtgpu-backend` in a child process (see `session`), gives it the GGML library to
wrap, and walks the protocol the way a guest would: device queries, buffer-type queries, a buffer
(backed by a shared resource when the device can wrap host memory), tensor upload and download, a
copy, a clear, and a small graph (a matrix product plus an addition on fresh random inputs) whose
result is compared with numpy. It times a cheap forwarded call and the graph compute. A crash of
the library ends the run with the call that caused it; apirctl itself survives.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from apirctl.apir import protocol, tensor
from apirctl.apir.graph_check import matmul_add_case
from apirctl.apir.session import BackendCrashed, BackendProcess, CallFailed, HostError

Progress = Callable[[str], None]


class Check(BaseModel):
    name: str
    ok: bool
    detail: str = ""


class Latency(BaseModel):
    """Time spent inside `apir_backend_dispatcher` per call (no pipe or Python overhead)."""

    call: str
    calls: int
    median_us: float
    p99_us: float
    min_us: float
    max_us: float


class DeviceInfo(BaseModel):
    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int
    props: dict[str, bool]
    buffer_type: str
    alignment: int
    max_size: int


class SelftestReport(BaseModel):
    ok: bool
    library: str
    ggml_library: str
    reg: str
    init_code: int | None = None
    init_status: str = ""
    device: DeviceInfo | None = None
    buffer_kind: Literal["shared", "device", ""] = ""
    max_rel_error: float | None = None
    tolerance: float | None = None
    checks: list[Check] = Field(default_factory=list)
    latencies: list[Latency] = Field(default_factory=list)
    leak_bytes_per_graph_compute: float | None = None
    notes: list[str] = Field(default_factory=list)
    crashed_in: str | None = None
    crash: str | None = None
    error: str | None = None
    #: What the library wrote to stderr (its log; after a crash, its last words).
    stderr: str = ""


def latency(call: str, times_ns: list[int]) -> Latency:
    us = sorted(t / 1000 for t in times_ns)
    p99 = us[min(len(us) - 1, max(0, round(0.99 * len(us)) - 1))]
    return Latency(call=call, calls=len(us), median_us=round(statistics.median(us), 3), p99_us=round(p99, 3),
                   min_us=round(us[0], 3), max_us=round(us[-1], 3))


def run(library: Path, ggml_library: Path, reg: str,
        cheap_calls: int = 1000, graph_calls: int = 100, size: tuple[int, int, int] = (64, 32, 16),
        tolerance: float | None = None, free_shared: bool = False, call_timeout: float = 120.0,
        progress: Progress | None = None) -> SelftestReport:
    """Run the selftest; never raises for a broken library (the report says what broke).

    `free_shared` also frees the shared-resource buffer and deinitializes, which crashes upstream's
    library when the GGML backend's host-pointer buffers have no free function (CPU does not):
    off by default so that the selftest checks what works; on to reproduce the bug. A call that
    takes longer than `call_timeout` seconds counts as a hang: the child is killed and reported.
    The libraries are the caller's choice (`apirctl.macos.bundle.backend_libraries` picks the
    default): the protocol package knows nothing of bundles or builds.
    """
    report = SelftestReport(ok=False, library=str(library), ggml_library=str(ggml_library), reg=reg)
    say = progress or (lambda _msg: None)
    with BackendProcess(timeout=call_timeout) as proc:
        try:
            _drive(proc, report, cheap_calls, graph_calls, size, tolerance, free_shared, say)
        except BackendCrashed as exc:
            report.crashed_in = exc.call
            report.crash = str(exc)
            report.checks.append(Check(name=exc.call, ok=False, detail=str(exc)))
        except CallFailed as exc:
            report.error = str(exc)
            report.checks.append(Check(name=exc.call, ok=False, detail=str(exc)))
        except HostError as exc:
            report.error = str(exc)
            report.checks.append(Check(name="load", ok=False, detail=str(exc)))
        report.stderr = proc.stderr()
    report.ok = (report.crashed_in is None and report.error is None and bool(report.checks)
                 and all(c.ok for c in report.checks))
    return report


def _drive(proc: BackendProcess, report: SelftestReport, cheap_calls: int, graph_calls: int,
           size: tuple[int, int, int], tolerance: float | None, free_shared: bool, say: Progress) -> None:
    def check(name: str, ok: bool, detail: str = "") -> bool:
        report.checks.append(Check(name=name, ok=ok, detail=detail))
        return ok

    say("loading the backend library")
    code = proc.initialize(Path(report.library), Path(report.ggml_library), report.reg)
    report.init_code = code
    report.init_status = protocol.describe_load_library(code)
    if not check("initialize", code == protocol.LoadLibraryCode.INIT_BASE_INDEX, report.init_status):
        return

    say("querying the device")
    count = proc.call("device_get_count")[0]["count"]
    check("device_get_count", count >= 1, f"{count} device(s)")
    check("device_get_device_count", proc.call("device_get_device_count")[0]["count"] == count)
    name = proc.call("device_get_name")[0]["name"]
    desc = proc.call("device_get_description")[0]["description"]
    dtype = proc.call("device_get_type")[0]["type"]
    mem = proc.call("device_get_memory")[0]
    props = proc.call("device_get_props")[0]
    buft = proc.call("device_get_buffer_type")[0]["buft"]
    check("device_get_buffer_type", buft != 0, f"handle {buft:#x}")
    say("querying the buffer type")
    buft_name = proc.call("buffer_type_get_name", buft=buft)[0]["name"]
    align = proc.call("buffer_type_get_alignment", buft=buft)[0]["alignment"]
    max_size = proc.call("buffer_type_get_max_size", buft=buft)[0]["max_size"]
    check("buffer_type_get_alignment", align > 0 and align & (align - 1) == 0, f"{align} bytes")
    check("buffer_type_is_host (deprecated)", proc.call("buffer_type_is_host")[0]["is_host"] is False)
    try:
        type_name = protocol.DeviceType(dtype).name
    except ValueError:
        type_name = str(dtype)
    report.device = DeviceInfo(name=name, description=desc, type=type_name, memory_free=mem["free"],
                               memory_total=mem["total"], props=props, buffer_type=buft_name, alignment=align,
                               max_size=max_size)
    check("device_get_memory", mem["total"] >= mem["free"] >= 0,
          f"{mem['free'] >> 20} MiB free of {mem['total'] >> 20} MiB")

    case = matmul_add_case(*size, align=align)
    say("allocating a buffer")
    if props["buffer_from_host_ptr"]:
        res = proc.shmem(case.buffer_size)
        got = proc.call("device_buffer_from_ptr", res_id=res, size=case.buffer_size,
                        max_tensor_size=case.buffer_size)[0]
        buffer, report.buffer_kind = got["buffer"], "shared"
        check("device_buffer_from_ptr", buffer != 0 and got["buft"] != 0, f"buffer {buffer:#x}")
    else:
        buffer = proc.call("buffer_type_alloc_buffer", buft=buft, size=case.buffer_size)[0]["buffer"]
        report.buffer_kind = "device"
        check("buffer_type_alloc_buffer", buffer != 0, f"buffer {buffer:#x}")
    if not buffer:
        return
    base = proc.call("buffer_get_base", buffer=buffer)[0]["base"]
    check("buffer_get_base", base != 0 and base % align == 0, f"base {base:#x}")
    case.place(buffer)

    staging = proc.shmem(case.largest)
    ops = case.graph.nodes
    check("device_supports_op", all(proc.call("device_supports_op", op=n)[0]["supported"] for n in ops),
          ", ".join(n.name for n in ops))
    alloc = proc.call("buffer_type_get_alloc_size", buft=buft, op=case.out)[0]["size"]
    check("buffer_type_get_alloc_size", alloc >= case.out.nbytes, f"{alloc} bytes for {case.out.nbytes}")

    say("clearing the buffer")
    proc.call("buffer_clear", buffer=buffer, value=0x5A)
    raw = _get(proc, buffer, case.a, staging)
    check("buffer_clear", raw == b"\x5a" * case.a.nbytes)

    say("uploading tensors")
    for t, arr in case.inputs():
        proc.shmem_write(staging, arr.tobytes())
        proc.call("buffer_set_tensor", buffer=buffer, tensor=t.to_rpc(), res_id=staging, offset=0,
                  size=t.nbytes)
    back = _get(proc, buffer, case.b, staging)
    check("buffer_set_tensor/get_tensor", back == case.b_data.tobytes(), f"{case.b.nbytes} bytes round trip")
    copied = proc.call("buffer_cpy_tensor", buffer=buffer, src=case.a.to_rpc(), dst=case.scratch.to_rpc())[0]
    check("buffer_cpy_tensor", copied["copied"] and _get(proc, buffer, case.scratch, staging)
          == case.a_data.tobytes())

    say("computing a graph")
    graph = case.graph.serialize()
    gres = proc.shmem(len(graph))
    proc.shmem_write(gres, graph)
    status = proc.call("backend_graph_compute", res_id=gres, graph_size=len(graph))[0]["status"]
    check("backend_graph_compute", status == protocol.GgmlStatus.SUCCESS, f"status {status}")
    out = _get(proc, buffer, case.out, staging)
    err = case.relative_error(out)
    tol = tolerance if tolerance is not None else (1e-5 if type_name == "CPU" else 1e-3)
    report.max_rel_error, report.tolerance = err, tol
    check("graph result vs numpy", err < tol, f"max relative error {err:.2e} (tolerance {tol:.0e})")

    say(f"timing {cheap_calls} cheap calls and {graph_calls} graph computes")
    report.latencies.append(latency("device_get_count", proc.call("device_get_count", repeat=cheap_calls)[1]))
    rss0 = proc.rss_kb()
    times = proc.call("backend_graph_compute", repeat=graph_calls, res_id=gres, graph_size=len(graph))[1]
    report.leak_bytes_per_graph_compute = (proc.rss_kb() - rss0) * 1024 / max(graph_calls, 1)
    report.latencies.append(latency("backend_graph_compute", times))

    say("allocating and freeing a device buffer")
    owned = proc.call("buffer_type_alloc_buffer", buft=buft, size=case.buffer_size)[0]["buffer"]
    check("buffer_type_alloc_buffer", owned != 0, f"buffer {owned:#x}")
    proc.call("buffer_free_buffer", buffer=owned)
    check("buffer_free_buffer", True, "device buffer")
    if report.buffer_kind == "device" or free_shared:
        proc.call("buffer_free_buffer", buffer=buffer)
        check("buffer_free_buffer", True, f"{report.buffer_kind} buffer")
        proc.deinit()
        check("deinit", True)
    else:
        report.notes.append(
            "the shared-resource buffer was neither freed nor deinit called (--free-shared-buffer does both; "
            "upstream's backend crashed there on CPU, patch 0008 of llama_patches/ fixes it: see docs/apir.md)")


def _get(proc: BackendProcess, buffer: int, t: tensor.Tensor, staging: int) -> bytes:
    proc.call("buffer_get_tensor", buffer=buffer, tensor=t.to_rpc(), res_id=staging, offset=0, size=t.nbytes)
    return proc.shmem_read(staging, t.nbytes)
