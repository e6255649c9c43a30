"""The real backend library driven from Python: selftest, crash isolation, CLI, malformed commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apirctl.apir import probes, selftest, table
from apirctl.apir.session import BackendProcess
from apirctl.errors import ApirctlError
from apirctl.macos import bundle

pytestmark = pytest.mark.integration
Libs = tuple[Path, Path, str]


def test_selftest_passes_on_the_cpu_library(backend_libs: Libs) -> None:
    report = selftest.run(*backend_libs, cheap_calls=200, graph_calls=20)
    assert report.ok, report.model_dump_json(indent=1)
    assert report.init_status == "backend init: SUCCESS"
    assert report.device is not None and report.device.name == "CPU" and report.device.type == "CPU"
    assert report.device.alignment > 0 and report.device.memory_total > 0
    assert report.buffer_kind == "shared"  # the CPU device wraps our shared resource
    assert report.max_rel_error is not None and report.max_rel_error < 1e-5
    names = {c.name for c in report.checks}
    assert {"graph result vs numpy", "buffer_set_tensor/get_tensor", "buffer_cpy_tensor", "buffer_clear",
            "device_supports_op", "buffer_free_buffer"} <= names
    lat = {x.call: x for x in report.latencies}
    assert lat["device_get_count"].calls == 200 and lat["backend_graph_compute"].calls == 20
    for x in lat.values():
        assert 0 < x.min_us <= x.median_us <= x.p99_us <= x.max_us
    assert report.crashed_in is None


def test_freeing_the_shared_buffer_and_deinit_work_with_the_patched_library(backend_libs: Libs) -> None:
    # Upstream's library crashed in buffer_free_buffer here on CPU (docs/apir.md, finding 5): patch 0008
    # frees through ggml_backend_buffer_free. Crashes are still reported: see the crashing probes.
    report = selftest.run(*backend_libs, cheap_calls=10, graph_calls=2, free_shared=True)
    assert report.ok and report.crashed_in is None, report.model_dump_json(indent=1)
    assert [c.name for c in report.checks][-2:] == ["buffer_free_buffer", "deinit"]


def test_wrong_registration_symbol_is_an_init_failure_not_a_crash(backend_libs: Libs) -> None:
    lib, ggml, _ = backend_libs
    report = selftest.run(lib, ggml, "no_such_symbol_reg")
    assert not report.ok and report.crashed_in is None
    assert report.init_code == 5 and report.init_status == "SYMBOL_MISSING"


def test_missing_library_is_a_clear_error(backend_libs: Libs, tmp_path: Path) -> None:
    with pytest.raises(ApirctlError, match="does not exist"):
        bundle.backend_libraries(tmp_path / "nope.so", backend_libs[1], backend_libs[2])


def test_defaults_come_from_the_host_build(backend_libs: Libs) -> None:
    lib, ggml, reg = bundle.backend_libraries()
    assert (lib, ggml, reg) == (backend_libs[0].resolve(), backend_libs[1].resolve(), backend_libs[2])


def test_on_macos_the_active_bundle_is_the_default(backend_libs: Libs, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    # Only the platform is faked: the "bundle" names the real libraries' files.
    lib, ggml, reg = backend_libs
    fake = bundle.Bundle(version="t1", path=tmp_path, source="test", installed_at="now",
                         backend_library=lib.name, ggml_library=ggml.name, ggml_reg=reg)
    (tmp_path / "bin").mkdir()
    for name in (lib.name, ggml.name):  # stand-ins: only which files are chosen is checked
        (tmp_path / "bin" / name).write_bytes(b"")
    monkeypatch.setenv("APIRCTL_PLATFORM", "macos")
    monkeypatch.setattr(bundle, "active", lambda: fake)
    bin_dir = (tmp_path / "bin").resolve()
    assert bundle.backend_libraries() == (bin_dir / lib.name, bin_dir / ggml.name, reg)


def test_an_unknown_buffer_is_refused_and_the_library_lives_on(backend_libs: Libs) -> None:
    # upstream's library printed "HOST BUFFER NOT FOUND" and wrote through the tensor's data as an
    # address (docs/apir.md); apirctl's refuses the call, and answers the next one
    result = probes.run_probe(next(p for p in probes.PROBES if p.name == "tensor-unknown-buffer"), *backend_libs)
    assert result.outcome == "rejected", result.detail
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        assert proc.call("device_get_name")[0]["name"] == "CPU"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def test_cli_selftest_json(backend_libs: Libs) -> None:
    lib, ggml, reg = backend_libs
    done = _cli("backend", "selftest", "--library", str(lib), "--ggml-library", str(ggml), "--reg", reg,
                "--calls", "50", "--graph-calls", "5", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["device"]["name"] == "CPU"
    assert [x["call"] for x in report["latencies"]] == ["device_get_count", "backend_graph_compute"]


def test_cli_selftest_frees_the_shared_buffer_with_the_patched_library(backend_libs: Libs) -> None:
    # upstream's library crashed here on CPU (docs/apir.md, finding 5); patch 0008 frees it through ggml
    lib, ggml, reg = backend_libs
    done = _cli("backend", "selftest", "--library", str(lib), "--ggml-library", str(ggml), "--reg", reg,
                "--calls", "5", "--graph-calls", "1", "--free-shared-buffer")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "crashed" not in done.stdout and "Traceback" not in done.stderr + done.stdout


def test_cli_selftest_missing_library_is_one_line(tmp_path: Path) -> None:
    done = _cli("backend", "selftest", "--library", str(tmp_path / "x.so"), "--ggml-library",
                str(tmp_path / "y.so"), "--reg", "r")
    assert done.returncode != 0
    assert done.stderr.startswith("apirctl: error:") and "Traceback" not in done.stderr


@pytest.mark.parametrize("probe", probes.PROBES, ids=lambda p: p.name)
def test_malformed_command_outcome_is_the_documented_one(probe: probes.Probe, backend_libs: Libs) -> None:
    result = probes.run_probe(probe, *backend_libs)
    assert result.outcome == probe.expected, result.detail


def test_docs_list_every_probe() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "apir.md").read_text()
    for p in probes.PROBES:
        assert f"`{p.name}`" in doc


def test_graph_computes_do_not_grow_the_host(backend_libs: Libs) -> None:
    # upstream's library leaked the ggml context of every call (about 2.4 KB per graph compute);
    # 10,000 calls must now grow the host by less than 1 MB
    from apirctl.apir.graph_check import matmul_add_case

    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        case = matmul_add_case(8, 8, 8)
        case.place(proc.call("buffer_type_alloc_buffer", buft=buft, size=case.buffer_size)[0]["buffer"])
        graph = case.graph.serialize()
        res = proc.shmem(len(graph))
        proc.shmem_write(res, graph)
        # warm up the allocators, and the child's list of 10,000 latencies (Python keeps its memory)
        proc.call("backend_graph_compute", repeat=10_000, res_id=res, graph_size=len(graph))
        before = proc.rss_kb()
        proc.call("backend_graph_compute", repeat=10_000, res_id=res, graph_size=len(graph))
        grown = (proc.rss_kb() - before) * 1024
    assert grown < 1 << 20, f"grew by {grown} bytes"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tensor_bytes_round_trip_through_the_real_library(backend_libs: Libs, data: st.DataObject) -> None:
    from apirctl.apir import tensor

    shape = tuple(data.draw(st.lists(st.integers(1, 17), min_size=1, max_size=4), label="shape"))
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        t = tensor.Tensor(shape, name="t", offset=data.draw(st.sampled_from([0, 32, 64]), label="offset"))
        size = t.offset + t.nbytes  # type: ignore[operator]
        t.buffer = proc.call("buffer_type_alloc_buffer", buft=buft, size=size)[0]["buffer"]
        payload = data.draw(st.binary(min_size=t.nbytes, max_size=t.nbytes), label="payload")
        res = proc.shmem(t.nbytes)
        proc.shmem_write(res, payload)
        proc.call("buffer_set_tensor", buffer=t.buffer, tensor=t.to_rpc(), res_id=res, offset=0, size=t.nbytes)
        proc.shmem_write(res, bytes(t.nbytes))
        proc.call("buffer_get_tensor", buffer=t.buffer, tensor=t.to_rpc(), res_id=res, offset=0, size=t.nbytes)
        assert proc.shmem_read(res, t.nbytes) == payload


def test_a_hung_call_is_killed_and_reported(backend_libs: Libs) -> None:
    from apirctl.apir.session import BackendCrashed

    with BackendProcess() as proc:  # initializing may take more than 2 s on a loaded machine
        assert proc.initialize(*backend_libs) == 6
        proc.timeout = 2  # the limit of each call from here on
        with pytest.raises(BackendCrashed) as info:
            # 10^8 dispatches in one call: each costs a Python loop turn, so this never ends in 2 s.
            proc.call("device_get_count", repeat=10**8)
    assert info.value.timed_out and info.value.call == "device_get_count"
    assert "hung" in str(info.value)


def test_a_reply_area_too_small_is_refused_not_overrun(backend_libs: Libs) -> None:
    # upstream's encoder wrote a reply past the reply area it was given (docs/apir.md)
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        name = proc.call("device_get_description")[0]["description"]
        fn = table.by_name("device_get_description")
        ret, _, _, overrun = proc.dispatch_limited(fn.index, b"", reply_limit=4)
        assert ret == 1 and overrun == 0
        ret, reply, _, overrun = proc.dispatch_limited(fn.index, b"", reply_limit=1024)
        assert ret == 0 and overrun == 0 and len(reply) == 8 + (len(name.encode()) + 1 + 3) // 4 * 4


def test_a_file_that_is_not_a_backend_library_is_reported(backend_libs: Libs, tmp_path: Path) -> None:
    _, ggml, reg = backend_libs
    text = tmp_path / "libnot.so"
    text.write_text("not an ELF file")
    report = selftest.run(text, ggml, reg)
    assert not report.ok and report.crashed_in is None
    assert report.checks[-1].name == "load" and "libnot.so" in (report.error or "")
    wrong = selftest.run(ggml, ggml, reg)  # a real shared library, but not the backend
    assert not wrong.ok and "apir_backend_initialize" in (wrong.error or "")
    done = _cli("backend", "selftest", "--library", str(text), "--ggml-library", str(ggml), "--reg", reg)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
