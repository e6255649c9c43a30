"""The lock the suite's shared builds are made under (tests/support/native_builds.locked) excludes
other processes, as pytest-xdist's workers are: while one holds it, another cannot take it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import native_builds

HOLDER = """
import sys
from tests.support import native_builds
with native_builds.locked("probe"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_build_lock_held_by_another_process_excludes_this_one(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_builds, "SHARED_CACHE", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=REPO, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, "APIRCTL_TEST_CACHE": str(tmp_path)})
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        with (tmp_path / "locks" / "probe.lock").open("w") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=120) == 0
        with native_builds.locked("probe"):  # free again: taken at once
            pass
    finally:
        holder.kill()
        holder.wait()
