"""A container's memory limit caps the host memory its own ggml-rpc-server maps and pins for it
(`GGML_RPC_SHM_CAP`); without a limit the server keeps its default. The server here is a stand-in
script that prints what it was given (the cap itself is tested on the real server in test_shm_memfd.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from apirctl.remoting import backends


def stand_in_build(tmp_path: Path) -> llamacpp.Build:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / backends.BINARY
    exe.write_text('#!/bin/sh\necho "cap=${GGML_RPC_SHM_CAP-unset}"\n')
    exe.chmod(0o755)
    return llamacpp.Build(root=tmp_path, bin_dir=bin_dir, backend="cpu", source_version="b0", external=True)


@pytest.mark.parametrize(("memory_limit", "expected"), [(2 * 1024**3, "cap=2147483648"), (None, "cap=unset"),
                                                         (0, "cap=unset")])
def test_the_cap_follows_the_containers_memory_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     memory_limit: int | None, expected: str) -> None:
    monkeypatch.setenv(backends.SHM_CAP_ENV, "1")  # apirctl's own environment never leaks into the backend
    log = tmp_path / "backend.log"
    child = backends.spawn(stand_in_build(tmp_path), ["-H", "unix:x"], log, None, None, False,
                           backends.shm_cap(memory_limit))
    assert child.wait(timeout=30) == 0
    assert log.read_text().splitlines()[-1] == expected
    assert os.environ[backends.SHM_CAP_ENV] == "1"
