"""doctor detects a host whose container runtime refuses ulimits (a faked failing runtime).

The fake `podman` placed first on PATH behaves like podman on a restricted host: a container
start without apirctl's containers.conf fails with runc's real rlimit error (recorded on such a
host); with the fix it hands over to the real podman. In "broken" mode every start fails with an
error that no containers.conf can fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RLIMIT_ERROR = (
    "Error: runc: runc create failed: unable to start container process: error during container init: "
    "error setting rlimits for ready process: error setting rlimit type 7: operation not permitted: "
    "OCI permission denied"
)
BROKEN_ERROR = "Error: OCI runtime error: runc: exec: no such file or directory: unknown runtime failure"

FAKE = """#!/bin/sh
# fake podman for tests: a restricted host
if [ "$1" = "run" ]; then
  if [ "$FAKE_PODMAN_MODE" = "broken" ]; then echo "{broken}" >&2; exit 126; fi
  if [ -z "$CONTAINERS_CONF" ]; then echo "{rlimit}" >&2; exit 126; fi
fi
exec {real} "$@"
"""


def fake_podman(tmp_path: Path) -> dict[str, str]:
    real = shutil.which("podman")
    if real is None:
        pytest.skip("podman is not installed")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    script = bin_dir / "podman"
    script.write_text(FAKE.format(broken=BROKEN_ERROR, rlimit=RLIMIT_ERROR, real=real))
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("CONTAINERS_CONF", None)
    return env


def doctor(env: dict[str, str]) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "apirctl", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.integration
def test_doctor_detects_restricted_runtime_and_uses_the_fix(tmp_path: Path, isolated_home: Path) -> None:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    _, report = doctor(fake_podman(tmp_path))
    start = check(report, "containers start")
    assert start["status"] == "ok", start
    assert "rlimit" in start["detail"] and "runc" in start["detail"] and "default_ulimits" in start["detail"]
    conf = isolated_home / "state" / "containers.conf"
    assert 'runtime = "runc"' in conf.read_text() and "default_ulimits = []" in conf.read_text()


@pytest.mark.integration
def test_doctor_reports_a_broken_runtime_with_the_fix(tmp_path: Path) -> None:
    env = fake_podman(tmp_path) | {"FAKE_PODMAN_MODE": "broken"}
    code, report = doctor(env)
    assert code == 1 and report["ok"] is False
    start = check(report, "containers start")
    assert start["status"] == "fail"
    assert "unknown runtime failure" in start["detail"]
    assert "containers.conf" in start["fix"]


def test_doctor_without_podman_says_how_to_install(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, report = doctor({**os.environ, "PATH": str(empty)})
    assert code == 1
    podman = check(report, "podman")
    assert podman["status"] == "fail" and "not installed" in podman["detail"]
    assert "install" in podman["fix"]
    assert check(report, "containers start")["status"] == "skip"


def test_gpu_sharing_says_whether_mps_lets_backends_compute_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from apirctl.diagnose import doctor as checks
    from apirctl.gpu import nvidia

    monkeypatch.setattr(checks.host, "is_macos", lambda: False)
    monkeypatch.setattr(nvidia, "find_driver", lambda **_: nvidia.NvidiaDriver())
    assert checks._gpu_sharing().status == "skip"  # no NVIDIA GPU: nothing to share
    monkeypatch.setattr(nvidia, "find_driver", lambda **_: nvidia.NvidiaDriver(gpus={"0": "/dev/nvidia0"}))
    monkeypatch.setattr(nvidia, "mps_state", lambda: nvidia.MpsState(running=False, pipe_directory="/tmp/nvidia-mps"))
    off = checks._gpu_sharing()
    assert off.status == "ok" and "not running" in off.detail and "nvidia-cuda-mps-control -d" in off.detail
    running = nvidia.MpsState(running=True, pids=[4242], pipe_directory="/run/m")
    monkeypatch.setattr(nvidia, "mps_state", lambda: running)
    on = checks._gpu_sharing()
    assert on.status == "ok" and "running (pid 4242" in on.detail and "/run/m" in on.detail
    assert "GPU sharing" in [name for name, _fn, _needs in checks.CHECKS]
