"""Property: rewriting a dylib reference on a real Mach-O either fits and changes exactly that
reference, or fails with the header-space error and leaves the file byte-identical."""

from __future__ import annotations

import shutil
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from apirctl.errors import ApirctlError
from apirctl.macos import krunkit

from .conftest import references

pytestmark = pytest.mark.integration  # the Mach-O files come from the package index (cached after once)

OLD = "/usr/lib/libSystem.B.dylib"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(name="libkrun-efi.dylib")  # fits
@example(name="a" * 300)  # does not
@given(name=st.text(alphabet=string.ascii_letters + string.digits + "._-", min_size=1, max_size=300))
def test_rewrite_fits_or_fails_cleanly(macho_files: Path, tmp_path: Path, name: str) -> None:
    work = tmp_path / "lib.dylib"
    shutil.copy2(macho_files / "libXau.6.dylib", work)  # only about 120 bytes of header room
    before_bytes = work.read_bytes()
    before = krunkit.read(work)
    new = f"@executable_path/{name}"
    try:
        krunkit._rewrite(work, OLD, new)
    except ApirctlError as exc:
        assert "not enough Mach-O header space" in exc.message
        assert work.read_bytes() == before_bytes
        return
    krunkit._check(before, krunkit.read(work), OLD, new)  # raises on any other difference
    assert references(work) == [new]
    assert len(work.read_bytes()) == len(before_bytes)
