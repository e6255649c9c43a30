"""The krunkit check against the real `lsof` of this host: a real process named krunkit that has
a real shared library mapped under a bundle's file name. This proves the `-Fn` parser on real
output (Linux's lsof prints no `f` lines for `-Fn`; macOS's does; the parser takes both)."""

from __future__ import annotations

import _ctypes
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.macos import krunkit


@pytest.fixture
def fake_krunkit(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    if shutil.which("lsof") is None:
        pytest.skip("lsof is not installed")
    exe = tmp_path / "krunkit"
    shutil.copy2(Path(sys.executable).resolve(), exe)
    lib = tmp_path / "bundle" / "bin" / "libvirglrenderer.1.dylib"
    lib.parent.mkdir(parents=True)
    shutil.copy2(_ctypes.__file__, lib)  # any real ELF shared object will be mapped by the loader
    code = f"import ctypes, sys, time; ctypes.CDLL({str(lib)!r}); print('ready', flush=True); time.sleep(120)"
    proc = subprocess.Popen([str(exe), "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield proc, lib
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_real_lsof_sees_the_mapped_virglrenderer(fake_krunkit: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, lib = fake_krunkit
    deadline = time.monotonic() + 20
    pid, virgl = krunkit.mapped_virglrenderers()
    while str(lib) not in virgl and time.monotonic() < deadline:
        time.sleep(0.2)
        pid, virgl = krunkit.mapped_virglrenderers()
    assert pid == proc.pid
    assert virgl == [str(lib)]


def test_no_krunkit_no_files(tmp_path: Path) -> None:
    if shutil.which("lsof") is None:
        pytest.skip("lsof is not installed")
    assert krunkit.process_files() == (None, [])
