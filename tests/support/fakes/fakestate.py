"""Shared state of the macOS tool fakes: one JSON file, a call log, and failure injection.

See README.md in this directory for what the fakes model and what they do not.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

RECORDED_PREFIXES = ("CONTAINERS_", "DYLD_", "VIRGL_", "APIR_", "GGML_")


def state_path() -> Path:
    value = os.environ.get("FAKE_MACOS_STATE")
    if not value:
        print("fake tool: FAKE_MACOS_STATE is not set", file=sys.stderr)
        raise SystemExit(2)
    return Path(value)


def load() -> dict[str, Any]:
    path = state_path()
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def save(state: dict[str, Any]) -> None:
    path = state_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(tmp, path)


def record(tool: str, argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith(RECORDED_PREFIXES)}
    with (state_path().parent / "calls.jsonl").open("a") as fh:
        fh.write(json.dumps({"tool": tool, "argv": argv, "env": env}) + "\n")


def injected_failure(state: dict[str, Any], key: str) -> tuple[int, str] | None:
    """A failure the test asked for under `key` ("machine start", "codesign --verify", ...)."""
    spec = state.get("fail", {}).get(key)
    if not spec:
        return None
    times = spec.get("times")
    if times is not None:
        if times <= 0:
            return None
        spec["times"] = times - 1
        save(state)
    return int(spec.get("exit", 125)), str(spec.get("stderr", f"Error: injected failure of {key}"))
