"""Test isolation and the shared expensive parts.

Every test gets its own APIRCTL_HOME (a temporary folder). The llama.cpp build lives in one
shared cache (`APIRCTL_TEST_CACHE`, default `.test-cache/` at the repository root, git-ignored)
so it is built once per machine; the demo model and the image are made once per session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_CACHE = Path(os.environ.get("APIRCTL_TEST_CACHE", REPO / ".test-cache")).resolve()
SHARED_HOME = SHARED_CACHE / "home"


def _user_cache() -> Path | None:
    """The developer's own apirctl cache (where `apirctl setup` builds), read before the tests move it:
    builds with the same key are copied from it (tests/support/native_builds.py), never written there."""
    if os.environ.get("APIRCTL_CACHE_DIR"):
        return Path(os.environ["APIRCTL_CACHE_DIR"]).expanduser().resolve()
    if os.environ.get("APIRCTL_HOME"):
        return Path(os.environ["APIRCTL_HOME"]).expanduser().resolve() / "cache"
    try:
        import platformdirs
    except ImportError:
        return None
    return Path(platformdirs.user_cache_dir("apirctl")).resolve()


USER_CACHE = _user_cache()
# Variables a developer may set to reuse things made elsewhere, or to build for any AVX2 CPU (the VM tests
# on emulation, on a host CPU with AVX-512: tests/vm/test_vm_serve.py); all other APIRCTL_* are cleared.
PASSTHROUGH = ("APIRCTL_HOME", "APIRCTL_CACHE_DIR", "APIRCTL_TEST_CACHE", "APIRCTL_LLAMA_BUILD", "APIRCTL_VULKAN_BUILD",
               "APIRCTL_NATIVE_CPU")

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would
# every apirctl it starts: the Ctrl-C tests would then test nothing. A handled signal is reset to its
# default in an exec'd child; an ignored one stays ignored.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resident_dir: Path) -> Iterator[Path]:
    """A home of the test's own; its runtime directory (sockets) is a short temporary folder, as a
    socket path must stay under 108 bytes. RPC backends the test left running are stopped."""
    home = tmp_path / "apirctl-home"
    monkeypatch.setenv("APIRCTL_HOME", str(home))
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(SHARED_CACHE))
    for name in list(os.environ):
        if name.startswith("APIRCTL_") and name not in PASSTHROUGH:
            monkeypatch.delenv(name)
    monkeypatch.setenv("APIRCTL_RESIDENT_DIR", str(resident_dir))
    runtime = Path(tempfile.mkdtemp(prefix="apirctl-run-"))
    monkeypatch.setenv("APIRCTL_RUNTIME_DIR", str(runtime))
    yield home
    from apirctl.remoting import backends, rpc_server

    for instance in backends.instances():
        backends.stop(instance)
    record = rpc_server.read_record()
    if record is not None:
        backends.terminate(record.pid)
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(autouse=True)
def _stop_own_service(isolated_home: Path) -> Iterator[None]:
    """A test may start apirctl's own podman service in its home; stop it afterwards (only that one:
    session fixtures keep theirs in the shared home)."""
    yield
    from apirctl.podman import engine

    engine.stop_service()


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
    """The host llama.cpp build: the test cache's, else the one `apirctl setup` made (copied), else
    built from the pinned source (minutes on 2 cores)."""
    from tests.support import native_builds

    with shared_env(), native_builds.locked("llama-host-build"):
        return native_builds.host_build()


@pytest.fixture(scope="session")
def container_build(llama_build):  # type: ignore[no-untyped-def]
    from apirctl.build import llamacpp, provision
    from tests.support import native_builds

    with shared_env(), native_builds.locked("llama-container-build"):
        found = llamacpp.container_build() or native_builds.from_user_cache(llamacpp.container_options())
        if found is not None:
            return found
        with native_builds.timed("llama.cpp container build"):
            return provision.builds()[1]


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The real demo model (SmolLM2-135M-Instruct Q4_1, from a wheel on the package index)."""
    from apirctl import models
    from tests.support import native_builds

    with shared_env(), native_builds.locked("demo-model"):  # a second pull at once is refused
        return models.resolve("smollm2", pull=True).path


@pytest.fixture(scope="session")
def llama_image(container_build) -> str:  # type: ignore[no-untyped-def]
    """The local inference image, built with podman from the container build."""
    from apirctl.build import image
    from tests.support import native_builds

    with shared_env(), native_builds.locked("llama-image"):
        return image.ensure(container_build)


@contextlib.contextmanager
def _native_cpu(value: str) -> Iterator[None]:
    saved = os.environ.get("APIRCTL_NATIVE_CPU")
    os.environ["APIRCTL_NATIVE_CPU"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("APIRCTL_NATIVE_CPU", None)
        else:
            os.environ["APIRCTL_NATIVE_CPU"] = saved


@pytest.fixture(scope="session")
def portable_build():  # type: ignore[no-untyped-def]
    """A host build for any AVX2 CPU (`native_cpu` false): what a VM on QEMU's emulation can run where
    the host's CPU has AVX-512. It differs from the host build in ggml-cpu's flags alone, so it is
    mostly ccache's."""
    from tests.support import native_builds

    with _native_cpu("false"), shared_env(), native_builds.locked("llama-portable-build"):
        return native_builds.host_build("cpu", what=" for any AVX2 CPU")


@pytest.fixture(scope="session")
def portable_image(portable_build) -> str:  # type: ignore[no-untyped-def]
    """The inference image of `portable_build`, under a tag of its own."""
    from apirctl.build import image
    from tests.support import native_builds

    with _native_cpu("false"), shared_env(), native_builds.locked("llama-portable-image"):
        return image.ensure(portable_build)


@pytest.fixture(scope="session")
def podman_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Podman API for the session, found or started by apirctl's engine in a home of its own."""
    from apirctl.podman import engine

    saved = os.environ.get("APIRCTL_HOME")
    os.environ["APIRCTL_HOME"] = str(tmp_path_factory.mktemp("podman-home"))
    # apirctl's own service exits after some idle minutes; a long stretch of tests that need no
    # Podman outlasts that, so the session's service never idles out (it is stopped at the end)
    idle, engine.SERVICE_IDLE_SECONDS = engine.SERVICE_IDLE_SECONDS, 0
    try:
        yield engine.discover().url
        engine.stop_service()
    finally:
        engine.SERVICE_IDLE_SECONDS = idle
        if saved is None:
            os.environ.pop("APIRCTL_HOME", None)
        else:
            os.environ["APIRCTL_HOME"] = saved


@pytest.fixture
def podman(podman_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point apirctl (and podman-py) at the session's Podman API."""
    monkeypatch.setenv("CONTAINER_HOST", podman_url)
    return podman_url


_WORKER_TIMES: list[tuple[str, float, str]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand the builds it timed to the controller, which prints them."""
    import sys

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["native_builds"] = list(getattr(sys.modules.get("tests.support.native_builds"), "TIMES", []))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller: a worker ended; keep the builds it timed."""
    _WORKER_TIMES.extend(tuple(t) for t in getattr(node, "workeroutput", {}).get("native_builds", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The wall time of each build the session (or its workers) made or reused (CI's budget:
    docs/testing.md)."""
    import sys

    support = sys.modules.get("tests.support.native_builds")
    times = [*getattr(support, "TIMES", []), *_WORKER_TIMES]
    if times:
        terminalreporter.write_sep("=", "native builds")
        for what, seconds, how in times:
            terminalreporter.write_line(f"{how} {what} in {seconds:.0f} s")
