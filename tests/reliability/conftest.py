"""Fixtures of the fault and bad-input suite (the checks themselves are in `sweep`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sweep import files_under


@pytest.fixture
def home(isolated_home: Path) -> Iterator[Path]:
    """The test's apirctl home; after the test, no temporary or lock file is left in its config folder."""
    yield isolated_home
    config = isolated_home / "config"
    stray = sorted(name for name in files_under(config) if name != "config.toml")
    assert not stray, f"left behind in the config folder: {stray}"


@pytest.fixture
def elsewhere() -> Iterator[Path]:
    """A folder outside pytest's (root-only) temporary tree, that another user may enter; removed after."""
    import shutil
    import tempfile

    from tests.support.sweep import can_switch_user

    if not can_switch_user():
        pytest.skip("needs root and setpriv to act as another user")
    root = Path(tempfile.mkdtemp(prefix="apirctl-rel-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)
