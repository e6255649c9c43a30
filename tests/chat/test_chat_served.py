"""`apirctl chat` finding a real `apirctl serve` container by its labels (no --url)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.chat_helpers import apirctl_command, run_chat
from tests.support.ports import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(llama_image: str, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A demo-model server (transport none) with a unique name, and the Podman API it runs under."""
    from apirctl.podman import engine
    from tests.conftest import SHARED_CACHE

    saved = {key: os.environ.get(key) for key in ("APIRCTL_HOME", "CONTAINER_HOST", "APIRCTL_CACHE_DIR")}
    os.environ["APIRCTL_HOME"] = str(tmp_path_factory.mktemp("chat-serve-home"))
    # A module fixture runs before the per-test isolation: point at the shared build itself.
    os.environ["APIRCTL_CACHE_DIR"] = str(SHARED_CACHE)
    podman_url = engine.discover().url
    os.environ["CONTAINER_HOST"] = podman_url
    name = f"apirctl-chat-{uuid.uuid4().hex[:8]}"
    port = free_port()
    try:
        done = subprocess.run(
            [*apirctl_command(), "serve", str(demo_model), "--transport", "none", "--name", name, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ),
        )
        assert done.returncode == 0, done.stderr
        yield {"name": name, "url": f"http://127.0.0.1:{port}/v1", "podman": podman_url}
    finally:
        from podman.errors import NotFound

        with contextlib.suppress(NotFound):
            engine.client().containers.get(name).remove(force=True)
        engine.stop_service()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_chat_by_server_name(served: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTAINER_HOST", served["podman"])
    result = run_chat("--name", served["name"], "Say hello.", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert result.stderr == ""


def test_unknown_server_name_is_one_line(served: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTAINER_HOST", served["podman"])
    result = run_chat("--name", "no-such-server-here", "Hi")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "no inference server named 'no-such-server-here'" in result.stderr
