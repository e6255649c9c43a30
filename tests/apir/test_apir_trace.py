"""Traces of `apir-host --trace`, built by hand with the wire encoders: decoding, summary, following,
and hostile or cut files (one-line errors through the real CLI, never a traceback)."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apirctl.apir import extensions, messages, protocol, table, tensor
from apirctl.apir import trace as apir_trace
from apirctl.apir.wire import Encoder
from tests.support.bench_helpers import run_cli

GET_NAME = table.by_name("device_get_name")
SET_TENSOR = table.by_name("buffer_set_tensor")
COMPUTE = table.by_name("backend_graph_compute")


def _tensor() -> tensor.RpcTensor:
    return tensor.Tensor(shape=(7,), name="inp_tokens", type=26, buffer=0x5000, offset=0).to_rpc()


def _session() -> bytes:
    """A short session as apir-host would write it: handshake, load, a few calls and two computes."""
    enc = Encoder()
    enc.u32(0)
    enc.u32(2)
    parts = [
        apir_trace.encode_record(messages.encode_handshake(reply_res_id=1), reply=enc.getvalue(), start_ns=1_000,
                                 duration_ns=500),
        apir_trace.encode_record(messages.encode_command(protocol.CommandType.LOADLIBRARY, 0, 1), start_ns=2_000,
                                 duration_ns=90_000),
        apir_trace.encode_record(messages.encode_forward(GET_NAME, reply_res_id=1),
                                 reply=messages.encode_reply(GET_NAME, name="CPU"), start_ns=100_000,
                                 duration_ns=2_000),
        apir_trace.encode_record(
            messages.encode_forward(SET_TENSOR, reply_res_id=1, buffer=0x5000, tensor=_tensor(), res_id=7, offset=0,
                                    size=28),
            start_ns=110_000, duration_ns=3_000),
    ]
    for i in range(2):
        parts.append(apir_trace.encode_record(
            messages.encode_forward(COMPUTE, reply_res_id=1, res_id=9, graph_size=4096),
            reply=messages.encode_reply(COMPUTE, status=0), start_ns=200_000 + i * 100_000, duration_ns=40_000))
    return apir_trace.MAGIC + b"".join(parts)


def test_a_session_decodes_with_names_sizes_and_times() -> None:
    found = apir_trace.read(_session())
    assert [r.name for r in found] == ["handshake", "loadlibrary", "device_get_name", "buffer_set_tensor",
                                       "backend_graph_compute", "backend_graph_compute"]
    assert all(r.ok for r in found)
    assert found[1].outcome == "backend init: SUCCESS"
    name = found[2]
    assert name.kind == "FORWARD" and name.cmd_flags == GET_NAME.index
    assert len(name.request) == protocol.COMMAND_HEADER_SIZE
    assert name.arguments()["reply"] == {"name": "CPU"}
    assert found[0].arguments()["request"] == {"major": protocol.PROTOCOL_MAJOR, "minor": protocol.PROTOCOL_MINOR}
    set_tensor = found[3].arguments()["request"]
    assert set_tensor["buffer"] == 0x5000 and set_tensor["size"] == 28
    assert set_tensor["tensor"]["name"].rstrip("\x00") == "inp_tokens"
    assert len(found[3].request) == 12 + 8 + 304 + 4 + 8 + 8


def test_the_summary_counts_calls_time_and_calls_per_compute() -> None:
    summary = apir_trace.summarize(apir_trace.read(_session()))
    rows = {row.name: row for row in summary.rows()}
    assert rows["backend_graph_compute"].calls == 2
    assert rows["backend_graph_compute"].total_ns == 80_000
    assert summary.rows()[0].name == "loadlibrary"  # most time first
    assert summary.host_ns == 500 + 90_000 + 2_000 + 3_000 + 80_000
    assert summary.span_ns == 340_000 - 1_000
    assert summary.calls_per_compute == 2.0  # four forwarded calls, two computes


def test_failed_calls_and_unknown_functions_are_named() -> None:
    bad = messages.encode_command(protocol.CommandType.FORWARD, 99, 1)
    failed = messages.encode_forward(GET_NAME, reply_res_id=1)
    data = apir_trace.MAGIC + apir_trace.encode_record(bad, ret=protocol.ForwardCode.BASE_INDEX + 6) + \
        apir_trace.encode_record(failed, ret=protocol.ForwardCode.NO_DISPATCH_FCT)
    unknown, refused = apir_trace.read(data)
    assert unknown.name == "unknown function 99" and unknown.outcome == "function failed (6)" and not unknown.ok
    assert refused.outcome == "NO_DISPATCH_FCT"
    assert apir_trace.summarize([unknown, refused]).failed == 2


def test_a_record_whose_fields_do_not_decode_is_kept_with_the_reason() -> None:
    cut = messages.encode_forward(SET_TENSOR, reply_res_id=1, buffer=1, tensor=_tensor(), res_id=7, offset=0,
                                  size=28)[:40]
    (record,) = apir_trace.read(apir_trace.MAGIC + apir_trace.encode_record(cut))
    assert record.name == "buffer_set_tensor"
    assert "needs" in (record.problem() or "")
    assert "undecodable" in record.as_dict(with_arguments=True)


def test_follow_waits_for_records_the_host_is_still_writing() -> None:
    whole = _session()
    cut = len(apir_trace.MAGIC) + apir_trace.HEADER.size + 5  # inside the handshake's request
    stream = io.BytesIO(whole[:cut])
    waits = []

    def wait() -> bool:
        waits.append(1)
        if len(waits) == 1:  # the host writes the rest
            pos = stream.tell()
            stream.seek(0, io.SEEK_END)
            stream.write(whole[cut:])
            stream.seek(pos)
            return True
        return False

    with pytest.raises(apir_trace.ApirTraceError):  # the second wait ends it inside nothing: a clean end is no error
        list(apir_trace.records(io.BytesIO(whole[:cut]), follow=True, wait=lambda: False))
    found = list(apir_trace.records(stream, follow=True, wait=wait))
    assert len(found) == 6 and len(waits) == 2


def test_a_live_trace_cut_inside_a_record_ends_there() -> None:
    whole = _session()
    complete = apir_trace.read(whole)
    for cut in (len(whole) - 3, len(whole) - 30):
        with pytest.raises(apir_trace.ApirTraceError, match="cut short in record 5"):
            apir_trace.read(whole[:cut])
        assert len(list(apir_trace.records(io.BytesIO(whole[:cut]), live=True))) == len(complete) - 1


@pytest.mark.parametrize(("data", "message"), [
    (b"", "not an APIR trace"),
    (b"APIRTRC0" + bytes(40), "not an APIR trace"),
    (apir_trace.MAGIC + bytes(20), "cut short in record 0: record header"),
    (apir_trace.MAGIC + struct.pack("<IIIIIIQQ", 2, 0, 4, 100, 0, 0, 0, 0) + bytes(10),
     "cut short in record 0: request"),
    (apir_trace.MAGIC + struct.pack("<IIIIIIQQ", 2, 0, 4, 0xFFFFFFFF, 0, 0, 0, 0), "claims a request of 4294967295"),
    (apir_trace.MAGIC + struct.pack("<IIIIIIQQ", 2, 0, 4, 0, 1 << 30, 0, 0, 0), "claims a reply"),
])
def test_bad_files_are_one_line_errors(data: bytes, message: str) -> None:
    with pytest.raises(apir_trace.ApirTraceError, match=message):
        apir_trace.read(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600), st.integers(0, 2000))
def test_any_bytes_decode_or_fail_with_a_trace_error(noise: bytes, cut: int) -> None:
    """Random bytes after the magic, or a real session cut anywhere: records or an ApirTraceError,
    and every record's arguments decode or give a reason."""
    for data in (apir_trace.MAGIC + noise, _session()[:cut]):
        try:
            found = apir_trace.read(data)
        except apir_trace.ApirTraceError:
            continue
        for record in found:
            record.as_dict(with_arguments=True)
            assert record.name and record.outcome


# --- the command line ------------------------------------------------------------------------------


@pytest.fixture
def session_file(tmp_path: Path) -> Path:
    path = tmp_path / "session.trace"
    path.write_bytes(_session())
    return path


def test_cli_lists_each_command_and_the_summary(session_file: Path) -> None:
    done = run_cli("apir", "trace", str(session_file))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("device_get_name" in line and "12 B ->" in line and "2.0 us" in line for line in lines)
    assert sum("backend_graph_compute" in line for line in lines) >= 3  # two records and the summary row
    assert "2 graph computes, 2.0 forwarded calls per compute" in done.stdout


def test_cli_json_with_arguments(session_file: Path) -> None:
    done = run_cli("apir", "trace", str(session_file), "--json", "--args")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [r["function"] for r in data["records"]][:3] == ["handshake", "loadlibrary", "device_get_name"]
    assert data["records"][2]["arguments"]["reply"] == {"name": "CPU"}
    assert data["summary"]["graph_computes"] == 2
    only = json.loads(run_cli("apir", "trace", str(session_file), "--json", "--summary").stdout)
    assert "records" not in only and only["summary"]["records"] == 6


@pytest.mark.parametrize("content", [b"hello world, not a trace", _session()[:-3]])
def test_cli_bad_file_is_one_line_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    done = run_cli("apir", "trace", str(path))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("apirctl: error:")]
    assert len(errors) == 1 and str(path) in errors[0]


def test_cli_missing_file_and_no_trace(tmp_path: Path) -> None:
    done = run_cli("apir", "trace", str(tmp_path / "nope.trace"))
    assert done.returncode == 1 and "cannot read" in done.stderr and "Traceback" not in done.stderr
    done = run_cli("apir", "trace")
    assert done.returncode == 1 and "no APIR trace found" in done.stderr


def _graph_run(run: extensions.GraphRun, result: int = extensions.RESULT_DONE) -> bytes:
    request = messages.encode_command(protocol.CommandType.FORWARD, run.command, 1) + run.encode()
    return apir_trace.encode_record(request, struct.pack("<Ii", result, 0))


def test_graph_runs_count_as_computes_and_show_how_their_graphs_travelled() -> None:
    out = (extensions.Output(0, 0), extensions.Output(1, 2304))
    data = apir_trace.MAGIC + b"".join([
        _graph_run(extensions.GraphRun(1, 2, 4000, 4096, 9, 3, out)),  # sent
        _graph_run(extensions.GraphRun(1, 2, 0, 64, 9, 3, out)),  # named by id
        _graph_run(extensions.GraphRun(1, 2, 0, 64, 9, 3, out), extensions.RESULT_UNKNOWN_GRAPH),
        _graph_run(extensions.GraphRun(1, 2, 4000, 4096, 9, 3, out)),  # sent again
        _graph_run(extensions.GraphRun(0, 2, 0, 64, 3)),  # writes only: no compute
    ])
    records = apir_trace.read(data)
    assert {r.name for r in records} == {"ext_graph_run"}
    summary = apir_trace.summarize(records)
    assert summary.computes == 3
    assert summary.graph_cache.as_dict() == {"by_id": 1, "sent": 2, "delta": 0, "unknown": 1, "delta_refused": 0,
                                             "writes": 30, "outputs": 6, "outputs_placed": 0, "reads": 0,
                                             "read_calls": 0}
    assert summary.graph_bytes_per_compute == 8000 / 3
    assert summary.calls_per_compute == 5 / 3
    args = records[1].arguments()
    assert args["request"]["n_writes"] == 9 and args["request"]["outputs"][1] == {"node": 1, "offset": 2304}
    assert args["reply"] == {"result": 0, "status": 0}


def test_a_graph_run_past_the_hosts_limits_is_a_problem_not_a_crash() -> None:
    run = extensions.GraphRun(1, 2, 0, 0, extensions.MAX_WRITES + 1)
    record = apir_trace.read(apir_trace.MAGIC + _graph_run(run))[0]
    assert record.problem() is not None and "writes" in str(record.problem())
    assert record.graph_run() is None
    assert apir_trace.summarize([record]).computes == 0


def test_graph_deltas_count_their_changes_as_graph_bytes(tmp_path: Path) -> None:
    """EXT_GRAPH_DELTA (llama_patches 0021): a compute whose graph travelled as its changed records."""
    data = apir_trace.MAGIC + b"".join([
        _graph_run(extensions.GraphRun(1, 2, 40_000, 40_064, 9)),  # sent
        _graph_run(extensions.GraphRun(1, 2, 0, 1_152, 9, n_changes=10)),  # updated by 10 records
        _graph_run(extensions.GraphRun(1, 2, 0, 1_152, 9, n_changes=10), extensions.RESULT_DELTA_REFUSED),
        _graph_run(extensions.GraphRun(1, 2, 40_000, 40_064, 9)),  # sent whole after the refusal
    ])
    records = apir_trace.read(data)
    assert [r.name for r in records] == ["ext_graph_run", "ext_graph_delta", "ext_graph_delta", "ext_graph_run"]
    assert records[1].arguments()["request"]["n_changes"] == 10
    summary = apir_trace.summarize(records)
    assert summary.computes == 3
    assert summary.graph_cache.delta == 1 and summary.graph_cache.delta_refused == 1 and summary.graph_cache.sent == 2
    assert summary.graph_bytes == 80_000 + 2 * 10 * extensions.CHANGE_SIZE
    path = tmp_path / "delta.trace"
    path.write_bytes(data)
    done = run_cli("apir", "trace", str(path), "--summary")
    assert done.returncode == 0, done.stderr
    assert "1 updated one by a delta" in done.stdout and "1 deltas were refused" in done.stdout
    assert "forwarded calls per compute" in done.stdout and "KB per compute" in done.stdout


def test_outputs_name_their_resource_once_the_host_grants_it() -> None:
    """FEATURE_OUTPUT_RESOURCES (patch 0029): the same bytes are other outputs before and after the grant."""
    out = (extensions.Output(0, 0, 3), extensions.Output(1, 1024, 9))
    placed = extensions.GraphRun(1, 2, 0, 64, 0, 3, out, output_resources=True)
    grant = (messages.encode_command(protocol.CommandType.FORWARD, extensions.GET_FEATURES, 1)
             + extensions.encode_features_request(extensions.FEATURES))
    data = apir_trace.MAGIC + b"".join([
        _graph_run(extensions.GraphRun(1, 2, 0, 64, 0, 3, (extensions.Output(0, 0),))),
        apir_trace.encode_record(grant, struct.pack("<Q", extensions.FEATURES)),
        _graph_run(placed),
    ])
    before, _, after = apir_trace.read(data)
    assert not before.output_resources and after.output_resources
    found = after.graph_run()
    assert found is not None and found[0].outputs == out
    assert after.arguments()["request"]["outputs"][1] == {"node": 1, "offset": 1024, "res_id": 9}
    assert extensions.GraphRun.decode(placed.encode(), output_resources=True) == placed
    # the narrow decoding of the same request reads other outputs: the grant decides, not the bytes
    assert extensions.GraphRun.decode(placed.encode()).outputs != out
    # the summary counts the output written elsewhere (res 9), not the one in the run's own (res 3)
    cache = apir_trace.summarize([before, after]).graph_cache
    assert cache.outputs == 3 and cache.outputs_placed == 1


def test_the_summary_counts_reads_answered_together(tmp_path: Path) -> None:
    """EXT_TENSORS_GET (patch 0028): reads and calls, in the summary and on the command line."""
    reads = [messages.encode_command(protocol.CommandType.FORWARD, extensions.TENSORS_GET, 1)
             + extensions.TensorsGet(2, n).encode() for n in (32, 32, 56)]
    path = tmp_path / "reads.trace"
    path.write_bytes(apir_trace.MAGIC + b"".join(apir_trace.encode_record(r) for r in reads))
    cache = apir_trace.summarize(apir_trace.read(path.read_bytes())).graph_cache
    assert (cache.reads, cache.read_calls) == (120, 3)
    done = run_cli("apir", "trace", str(path), "--summary")
    assert done.returncode == 0 and "120 reads of device memory answered in 3 calls (40.0 a call)" in done.stdout
