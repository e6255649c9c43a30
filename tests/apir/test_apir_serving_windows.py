"""benchmarks/apir_serving_windows.py: a serving row's time read from an apir-host trace built with the
wire encoders, where every figure is known beforehand."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from apirctl.apir import extensions, messages, protocol, table, tensor
from apirctl.apir import trace as apir_trace
from benchmarks import apir_serving_windows as windows

GET_TENSOR = table.by_name("buffer_get_tensor")
MS = 1_000_000


def _run(start_ms: float, host_ms: float) -> bytes:
    run = extensions.GraphRun(1, 2, 0, 64, 0, 3, (extensions.Output(0, 0),))
    request = messages.encode_command(protocol.CommandType.FORWARD, run.command, 1) + run.encode()
    return apir_trace.encode_record(request, struct.pack("<Ii", extensions.RESULT_DONE, 0),
                                    start_ns=int(start_ms * MS), duration_ns=int(host_ms * MS))


def _read(start_ms: float, host_ms: float) -> bytes:
    cell = tensor.Tensor(shape=(512, 16), name="cache_k_l0 (view)", type=1, buffer=0x5000, offset=0).to_rpc()
    request = messages.encode_forward(GET_TENSOR, reply_res_id=1, buffer=0x5000, tensor=cell, res_id=2, offset=0,
                                      size=16384)
    return apir_trace.encode_record(request, start_ns=int(start_ms * MS), duration_ns=int(host_ms * MS))


def _reads(start_ms: float, host_ms: float, n_reads: int) -> bytes:
    """A save's reads in one EXT_TENSORS_GET (patch 0028)."""
    get = extensions.TensorsGet(2, n_reads)
    request = messages.encode_command(protocol.CommandType.FORWARD, extensions.TENSORS_GET, 1) + get.encode()
    return apir_trace.encode_record(request, start_ns=int(start_ms * MS), duration_ns=int(host_ms * MS))


def _trace(tmp_path: Path) -> Path:
    """A row from 1,000 to 1,100 ms: four computes of 2 ms, 10 ms apart, then a save of three reads
    (0.2 ms each, 0.1 ms between), llama-server's 5 ms, and a second save of two reads; a compute
    before the row and one long after it (another row) are not the row's."""
    parts = [_run(900, 2)]
    parts += [_run(1000 + 12 * i, 2) for i in range(4)]  # ends at 1038; 10 ms between computes
    parts += [_read(1040 + 0.3 * i, 0.2) for i in range(3)]  # ends at 1040.8
    parts += [_read(1045.8 + 0.3 * i, 0.2) for i in range(2)]  # 5 ms after the first save
    parts += [_run(5000, 2)]
    path = tmp_path / "serving.trace"
    path.write_bytes(apir_trace.MAGIC + b"".join(parts))
    return path


def test_a_rows_computes_reads_and_gaps_are_told_apart(tmp_path: Path) -> None:
    found = windows.load(_trace(tmp_path))
    row = windows.breakdown(found, 1000 * MS, 1100 * MS)
    assert row["computes"] == 4 and row["calls"] == 9
    assert row["host_ms_per_compute"] == 2.0
    assert row["client_ms_between_computes"] == 10.0
    assert row["kv_reads"] == 5
    assert row["kv_reads_host_ms"] == 1.0
    assert row["kv_reads_client_ms"] == 0.3  # three 0.1 ms gaps inside the two saves
    assert row["gaps_between_saves_ms"] == 5.0  # llama-server's own work, not a read's
    assert row["kv_reads_share"] == round(1.3 / 100, 3)


def test_a_saves_reads_in_one_call_count_one_by_one(tmp_path: Path) -> None:
    """Two saves of 32 reads, each in one call, 0.1 ms apart: 64 reads in 2 calls, the gap the client's."""
    path = tmp_path / "batched.trace"
    path.write_bytes(apir_trace.MAGIC + _run(1000, 2) + _reads(1010, 1.5, 32) + _reads(1011.6, 1.5, 32) +
                     _run(1020, 2))
    row = windows.breakdown(windows.load(path), 1000 * MS, 1100 * MS)
    assert row["kv_reads"] == 64 and row["kv_read_calls"] == 2
    assert row["kv_reads_host_ms"] == 3.0 and row["kv_reads_client_ms"] == 0.1
    assert row["computes"] == 2


def test_idle_stretches_split_a_trace_without_recorded_windows(tmp_path: Path) -> None:
    found = windows.load(_trace(tmp_path))
    assert [(a // MS, b // MS) for a, b in windows.idle_windows(found, idle_s=1.0, shortest_s=0.1)] == [(900, 1046)]
    assert windows.idle_windows(found, idle_s=0.05, shortest_s=0.1) == []


def test_the_command_line_writes_its_file_and_refuses_a_bad_trace_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    script = Path(windows.__file__)
    done = subprocess.run([sys.executable, str(script), "--trace", str(_trace(tmp_path)), "--split-idle", "1",
                           "--shortest", "0.1", "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert written["env"]["trace_name"] == "serving.trace" and len(written["windows"]) == 1
    assert written["windows"][0]["kv_reads"] == 5
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"not a trace")
    done = subprocess.run([sys.executable, str(script), "--trace", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[0].startswith("apir_serving_windows: cannot read") and "hint:" in done.stderr
