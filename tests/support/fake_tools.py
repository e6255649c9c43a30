"""Put the faithful fakes of macOS tools (tests/support/fakes: `podman machine`, `codesign`, `lsof`) first on PATH.

Test infrastructure only: each fake is a small executable script that runs the fake's `main` from
tests/support/fakes, with its state in the JSON file named by FAKE_MACOS_STATE (see tests/support/fakes/README.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"


def install(bin_dir: Path, monkeypatch: pytest.MonkeyPatch, tools: tuple[str, ...] = ("podman",)) -> None:
    """Write the fakes' executables into `bin_dir` and put it first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        exe = bin_dir / tool
        exe.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(FAKES)!r})\n"
                       f"from fake_{tool} import main\nsys.exit(main(sys.argv[1:]))\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def machine_state(path: Path, monkeypatch: pytest.MonkeyPatch, provider: str,
                  machines: list[dict[str, Any]] | None = None) -> Path:
    """The fake podman's state file: its default provider and machines; FAKE_MACOS_STATE names it."""
    state: dict[str, Any] = {"default_provider": provider}
    if machines is not None:
        state["machines"] = {m["name"]: m for m in machines}
    path.write_text(json.dumps(state))
    monkeypatch.setenv("FAKE_MACOS_STATE", str(path))
    return path
