"""Fixtures for the serve tests: one real Podman service per session, free ports, cleanup.

Tests run the real CLI (`python -m apirctl`) against real podman, the real image and the demo
model. Names and ports are unique per test, so other suites running beside these are safe.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port


@pytest.fixture
def port() -> int:
    return free_port()


def container_exists(name: str) -> bool:
    from apirctl.podman import engine

    return bool(engine.client().containers.exists(name))


@pytest.fixture
def name(podman: str) -> Iterator[str]:
    """A unique server name; whatever test made it, the container is removed afterwards."""
    from podman.errors import NotFound

    from apirctl.podman import engine

    value = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    yield value
    with contextlib.suppress(NotFound):
        engine.client().containers.get(value).remove(force=True)


def apirctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a child process with the test's environment."""
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


@pytest.fixture
def served(podman: str, llama_image: str, demo_model: Path, name: str, port: int) -> dict[str, object]:
    """A running demo-model server (transport none), as `apirctl serve --json` printed it."""
    import json

    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name, "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))
