"""Test isolation: every test gets its own APIRCTL_HOME; the llama.cpp build cache is shared.

The shared cache lives in `.test-cache/` at the repository root (git-ignored), or where
`APIRCTL_TEST_CACHE` points, so the expensive build happens once per machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_CACHE = Path(os.environ.get("APIRCTL_TEST_CACHE", REPO / ".test-cache"))


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "apirctl-home"
    monkeypatch.setenv("APIRCTL_HOME", str(home))
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(SHARED_CACHE))
    for name in list(os.environ):
        if name.startswith("APIRCTL_") and name not in ("APIRCTL_HOME", "APIRCTL_CACHE_DIR", "APIRCTL_TEST_CACHE"):
            monkeypatch.delenv(name)
    return home
