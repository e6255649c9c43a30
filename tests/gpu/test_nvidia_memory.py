"""The GPU memory each remoting backend holds, from the NVIDIA driver's per-process report; whether CUDA
MPS lets several backends compute at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apirctl.gpu import nvidia

# nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits, with a process on two
# GPUs and the values it prints where it cannot tell (processes of another namespace)
REPORT = """\
4242, 1536
4243, 812
4242, 512
77, [N/A]
not a line
"""


def test_the_report_is_read_per_process_and_summed_over_gpus() -> None:
    assert nvidia.memory_by_process(REPORT) == {4242: 2048 * 2**20, 4243: 812 * 2**20}
    assert nvidia.memory_by_process("") == {}


def test_a_process_counts_its_childrens_memory() -> None:
    """apir-host computes in a child per client: the host's pid stands for what the child holds."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        report = {child.pid: 700 * 2**20, os.getpid(): 100 * 2**20}
        assert nvidia.memory_of(os.getpid(), report) == 800 * 2**20
        assert nvidia.memory_of(child.pid, report) == 700 * 2**20
        assert nvidia.memory_of(os.getpid(), {}) is None
        assert nvidia.memory_of(1, {child.pid: 2**20}) is None  # not init's child
    finally:
        child.kill()
        child.wait()


def test_no_driver_tool_means_no_report(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", "/nonexistent")
    assert nvidia.memory_by_process() == {}


def fake_proc(root: Path, processes: dict[int, bytes]) -> Path:
    """A /proc of `pid: command line` (NUL-separated, as the kernel writes it), and a file that is no process."""
    for pid, cmdline in processes.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(cmdline)
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "uptime").write_text("1 1\n")
    return root


def test_mps_is_found_by_its_programs_name_not_its_cut_comm(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", {
        10: b"/usr/bin/nvidia-cuda-mps-control\0-d\0",
        11: b"nvidia-cuda-mps-server\0",  # the server the daemon starts is not the daemon
        12: b"/usr/bin/python3\0nvidia-cuda-mps-control\0",  # the name as an argument only
        13: b"",  # a kernel thread
    })
    found = nvidia.mps_state(proc, {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})
    assert found.running and found.pids == [10] and found.pipe_directory == "/run/mps"
    absent = nvidia.mps_state(fake_proc(tmp_path / "none", {20: b"/usr/bin/nvidia-cuda-mps-server\0"}), {})
    assert not absent.running and absent.pids == [] and absent.pipe_directory == nvidia.MPS_PIPE_DEFAULT
    assert not nvidia.mps_state(tmp_path / "no-proc", {}).running


def test_a_running_daemon_is_seen_in_the_real_proc() -> None:
    """A real process whose program name is the daemon's (bash's `exec -a`), found among this host's."""
    before = nvidia.mps_state()
    daemon = subprocess.Popen(["bash", "-c", f"exec -a {nvidia.MPS_CONTROL} sleep 30"])
    try:
        deadline = time.monotonic() + 10
        while daemon.pid not in (found := nvidia.mps_state()).pids:
            assert time.monotonic() < deadline, "the stand-in daemon never showed in /proc"
            time.sleep(0.05)
        assert found.running
    finally:
        daemon.kill()
        daemon.wait()
    assert daemon.pid not in nvidia.mps_state().pids
    assert nvidia.mps_state().pids == before.pids


def test_machine_status_says_how_backends_share_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from apirctl.remoting import rpc_server

    monkeypatch.setattr(nvidia, "find_driver", lambda **_: nvidia.NvidiaDriver())
    assert rpc_server.gpu_sharing() is None  # no NVIDIA GPU: no line
    monkeypatch.setattr(nvidia, "find_driver", lambda **_: nvidia.NvidiaDriver(gpus={"0": "/dev/nvidia0"}))
    monkeypatch.setattr(nvidia, "mps_state", lambda: nvidia.MpsState(running=False, pipe_directory="/tmp/nvidia-mps"))
    assert (line := rpc_server.gpu_sharing()) and line.startswith("time-sliced") and "mps-control -d" in line
    running = nvidia.MpsState(running=True, pids=[77], pipe_directory="/tmp/nvidia-mps")
    monkeypatch.setattr(nvidia, "mps_state", lambda: running)
    assert rpc_server.gpu_sharing() == "CUDA MPS (pid 77): the backends compute at once"
