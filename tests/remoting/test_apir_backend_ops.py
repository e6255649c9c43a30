"""Upstream's test-backend-ops through API remoting: the build's frontend (`libggml-virtgpu`, socket
transport) against `apir-host` over the CPU backend library, each case computed on the APIR device and
compared with the CPU backend in the same process.

The frontend asks the host's backend whether it supports an op (once per op signature), so a case
the host cannot run is reported "not supported" instead of reaching it. For the ops a Llama, Qwen or
Gemma graph uses, every case must pass or be reported unsupported, none may fail, at least one case
of each op must run, and the host must outlive the run.

Cases: test-backend-ops' own list, cut down where it is long so that the whole test stays within a
few minutes on a 2-core CI machine: `SUBSETS` gives, per op, a regex over the case's parameters
(test-backend-ops `-p`); an op without one runs all its cases.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import apir_host
from tests.support.backend_ops import ANSI, APIR_BACKEND, OPS, REFUSED, Counts, run_op
from tests.support.build_servers import backend_ops_tester

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]


@pytest.fixture(scope="module")
def tester(llama_build: llamacpp.Build) -> Path:
    return backend_ops_tester(llama_build)


def test_backend_ops_pass_or_are_unsupported_through_apir_host(tester: Path, llama_build: llamacpp.Build,
                                                               tmp_path: Path) -> None:
    workdir = tmp_path / "apir"
    workdir.mkdir(mode=0o700)
    log = workdir / "test-backend-ops.log"
    results: dict[str, Counts] = {}
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir) as (host, path, host_log):
        for op in OPS:
            started = time.monotonic()
            done, counts = run_op(tester, path, op, log)
            results[op] = counts
            where = f"{op} ({time.monotonic() - started:.0f} s); log: {log}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            assert host.poll() is None, f"apir-host died during {where}\n{host_log.read_text(errors='replace')[-3000:]}"
            assert "crashed" not in host_log.read_text(errors="replace"), \
                f"the backend library crashed during {where}\n{host_log.read_text(errors='replace')[-3000:]}"
            assert not counts.failed, f"failing cases of {where}"
            assert done.returncode == 0, f"test-backend-ops failed for {where}"
            assert "FAIL" not in ANSI.sub("", done.stdout), where
            assert counts.passed > 0, f"no case of {op} ran on the APIR device: {where}"
            if op == "MUL_MAT_HADAMARD":  # the rules take every transform upstream tests, F16 rows too
                assert not counts.unsupported, f"{counts.unsupported[:3]} {where}"
            if op in REFUSED:
                refused = [case for case in counts.unsupported if REFUSED[op] in case]
                assert refused and all(APIR_BACKEND in case for case in refused), f"{refused} {where}"
        assert host.poll() is None
    summary = ", ".join(f"{op} {c.passed}/{len(c.unsupported)}" for op, c in results.items())
    print(f"passed/unsupported per op: {summary}")
