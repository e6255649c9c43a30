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
