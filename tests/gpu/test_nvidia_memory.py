"""The GPU memory each remoting backend holds, from the NVIDIA driver's per-process report."""

from __future__ import annotations

import os
import subprocess
import sys

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
