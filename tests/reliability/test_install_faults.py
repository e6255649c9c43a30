"""`install --from` with what is not a release: one error and a hint, and no folder left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from apirctl.paths import dirs
from tests.support.sweep import sweep


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p.joinpath("x.tar").write_text("hello"), "not a tar archive"),
    (lambda p: p.joinpath("x.tar").mkdir(), "is not an API-remoting release"),
    (lambda p: None, "does not exist"),
], ids=["not-a-tar", "folder-without-bin", "missing"])
def test_a_failed_first_install_leaves_nothing(home: Path, tmp_path: Path, make, says: str) -> None:  # type: ignore[no-untyped-def]
    make(tmp_path)
    sweep("install", "--from", str(tmp_path / "x.tar")).fails_cleanly(says=says)
    assert not dirs().bundles.exists() and not dirs().data.exists()
