"""The Podman connection: install errors, the restricted-host probe, socket discovery, one-shot runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from apirctl import host
from apirctl.errors import ApirctlError
from apirctl.podman import containers, engine

# What runc printed on a host that refuses podman's default nofile ulimit (seen on the CI machine).
RLIMIT_ERROR = ("Error: runc: runc create failed: unable to start container process: error during container "
                "init: error setting rlimits for ready process: error setting rlimit type 7: operation not "
                "permitted: OCI permission denied")


def _isolate_sockets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No CONTAINER_HOST and an empty XDG_RUNTIME_DIR, so discovery sees only what the test makes."""
    runtime = tmp_path / "xdg"
    runtime.mkdir()
    monkeypatch.delenv("CONTAINER_HOST", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def test_missing_podman_is_one_line_with_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ApirctlError) as err:
        engine.podman_binary()
    assert err.value.exit_code == 3 and "not installed" in err.value.message
    assert err.value.hint and "install" in err.value.hint and "podman" in err.value.hint

    done = subprocess.run([sys.executable, "-m", "apirctl", "ps"], capture_output=True, text=True,
                          env={**os.environ, "PATH": str(tmp_path)})
    assert done.returncode == 3
    assert "Traceback" not in done.stderr and "podman is not installed" in done.stderr


def test_too_old_podman_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Podman 3 cannot be installed beside the real one here; this stand-in answers `--version`
    # the way podman 3.4.4 does ("podman version 3.4.4"), which is all the check reads.
    fake = tmp_path / "podman"
    fake.write_text("#!/bin/sh\necho 'podman version 3.4.4'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ApirctlError, match=r"podman 3\.4\.4 is too old \(apirctl needs 4\.0"):
        engine.podman_version()


def test_restricted_failure_signatures() -> None:
    assert engine.is_restricted_failure(RLIMIT_ERROR)
    assert engine.is_restricted_failure("crun: writing file `/sys/fs/cgroup/cgroup.subtree_control`: permission denied")
    assert not engine.is_restricted_failure("Error: localhost/x:latest: image not known")


def test_restricted_conf_says_runc_and_no_ulimits() -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    conf = tomllib.loads(engine.write_restricted_conf().read_text())
    assert conf == {"engine": {"runtime": "runc"}, "containers": {"default_ulimits": []}}


def test_spec_maps_to_podman_py_arguments(tmp_path: Path) -> None:
    spec = containers.ContainerSpec(
        image="img", command=["--version"], name="n", security_opt=["label=disable"], devices=["/dev/dri"],
        ports={8000: ("127.0.0.1", 1234)}, mounts=[containers.BindMount(source=tmp_path, target="/models")],
        network_mode="slirp4netns", network_options={"slirp4netns": ["allow_host_loopback=true"]},
    )
    kwargs = spec.create_kwargs()
    assert kwargs["security_opt"] == ["disable"]  # the libpod API has no "label=" prefix
    assert kwargs["ports"] == {"8000/tcp": ("127.0.0.1", 1234)}
    assert kwargs["mounts"] == [{"type": "bind", "source": str(tmp_path), "target": "/models", "read_only": True}]
    assert "entrypoint" not in kwargs  # the image's own entrypoint unless one is asked for


@pytest.mark.integration
def test_runtime_decision_matches_a_real_probe() -> None:
    decision = engine.runtime_decision()
    default_ok, output = engine.probe_runtime(None)
    assert decision.restricted == (not default_ok), output
    if decision.restricted:
        assert decision.conf and engine.probe_runtime(Path(decision.conf))[0]
        assert engine.podman_env()["CONTAINERS_CONF"] == decision.conf
        assert "rlimit" in decision.reason or "cgroup" in decision.reason
    again = engine.runtime_decision()  # read back from the state file
    assert again == decision


@pytest.mark.integration
def test_a_users_containers_conf_is_never_overridden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine.conf"
    mine.write_text(engine.RESTRICTED_CONF)
    monkeypatch.setenv("CONTAINERS_CONF", str(mine))
    decision = engine.runtime_decision()
    assert not decision.restricted and "user" in decision.reason
    assert engine.podman_env()["CONTAINERS_CONF"] == str(mine)


@pytest.mark.integration
def test_discovery_starts_its_own_service_and_stops_only_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _isolate_sockets(monkeypatch, tmp_path)
    rootful = engine.default_sockets()[0]
    if rootful.source == "rootful" and engine.answers(rootful.url) and not engine.runtime_decision().restricted:
        pytest.skip("a rootful podman service answers here; discovery rightly uses it")
    found = engine.discover()
    assert found.source == "apirctl service" and found.started_by_apirctl
    record = engine.service_record()
    assert record is not None and record.url == found.url and engine.answers(found.url)
    assert engine.client().version()["Version"]
    again = engine.discover()
    assert again.url == found.url and engine.service_record() == record  # reused, not a second one
    assert engine.stop_service()
    assert not engine.answers(found.url) and engine.service_record() is None
    assert not engine.stop_service()  # nothing of ours is left to stop


@pytest.mark.integration
def test_rootless_socket_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _isolate_sockets(monkeypatch, tmp_path)
    # the user's own containers.conf (so the system sockets are eligible on a restricted host)
    conf = tmp_path / "containers.conf"
    conf.write_text(engine.RESTRICTED_CONF)
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    sock = runtime / "podman" / "podman.sock"
    sock.parent.mkdir()
    proc = subprocess.Popen(engine.podman_cli("system", "service", "--time=60", f"unix://{sock}"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not engine.answers(f"unix://{sock}") and time.monotonic() < deadline:
            time.sleep(0.05)
        rootful = engine.default_sockets()[0]
        if rootful.source == "rootful" and engine.answers(rootful.url):
            pytest.skip("a rootful podman service answers here and comes first")
        found = engine.discover()
        assert (found.source, found.url, found.started_by_apirctl) == ("rootless", f"unix://{sock}", False)
        assert engine.service_record() is None  # apirctl started nothing
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.integration
def test_container_host_wins_and_a_dead_one_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _isolate_sockets(monkeypatch, tmp_path)
    monkeypatch.setenv("CONTAINER_HOST", f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(ApirctlError, match="CONTAINER_HOST=unix://.*does not answer"):
        engine.discover()
    monkeypatch.delenv("CONTAINER_HOST")
    url = engine.discover().url
    try:
        monkeypatch.setenv("CONTAINER_HOST", url)
        assert engine.discover().source == "CONTAINER_HOST"
    finally:
        engine.stop_service()


@pytest.mark.integration
def test_run_once_returns_exit_code_and_output(llama_image: str) -> None:
    name = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []
    ok = containers.run_once(containers.ContainerSpec(image=llama_image, name=name, command=["--version"],
                                              network_mode="none"), timeout=120, on_line=lines.append)
    assert ok.exit_code == 0 and "version" in ok.output
    assert any("version" in line for line in lines)
    bad = containers.run_once(containers.ContainerSpec(image=llama_image, name=name, command=["--no-such-flag"],
                                               network_mode="none"), timeout=120)
    assert bad.exit_code != 0 and "--no-such-flag" in bad.output
    assert not engine.client().containers.exists(name)  # always removed


@pytest.mark.integration
def test_missing_image_is_one_line() -> None:
    with pytest.raises(ApirctlError, match="image localhost/apirctl/no-such-image:0 not found"):
        containers.connect().create(containers.ContainerSpec(image="localhost/apirctl/no-such-image:0"))


def _fake_macos_podman(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running: bool) -> None:
    """The faithful fake of macOS `podman machine` from tests/support/fakes (see its README) first on PATH."""
    from tests.support import fake_tools

    fake_tools.install(tmp_path / "fake-bin", monkeypatch)
    machine = {"name": "podman-machine-default", "provider": "libkrun", "default": True,
               "state": "running" if running else "stopped", "created": "2026-11-01T10:00:00Z"}
    fake_tools.machine_state(tmp_path / "fake-state.json", monkeypatch, "libkrun", [machine])
    monkeypatch.setenv("APIRCTL_PLATFORM", "macos")
    monkeypatch.delenv("CONTAINER_HOST", raising=False)


def test_macos_socket_comes_from_podman_machine_inspect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_macos_podman(tmp_path, monkeypatch, running=True)
    assert host.is_macos()
    assert engine.machine_socket() == "unix:///var/folders/xx/T/podman/podman-machine-default-api.sock"
    assert engine.machine_socket("no-such-machine") is None
    # The fake has no API socket behind the path, so discovery says what to do instead of guessing.
    with pytest.raises(ApirctlError, match="podman machine is not running") as err:
        engine.discover()
    assert err.value.hint and "machine restart" in err.value.hint
    assert engine.service_record() is None  # never a local service on macOS
    assert not engine.runtime_decision().restricted  # and no probe: containers run in the VM


@pytest.mark.integration
def test_concurrent_commands_start_one_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _isolate_sockets(monkeypatch, tmp_path)
    rootful = engine.default_sockets()[0]
    if rootful.source == "rootful" and engine.answers(rootful.url) and not engine.runtime_decision().restricted:
        pytest.skip("a rootful podman service answers here; discovery rightly uses it")
    engine.runtime_decision()  # probe once up front, so the three children only race for the service
    code = "from apirctl.podman import engine; print(engine.discover().url)"
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    urls = {child.communicate(timeout=120)[0].strip() for child in children}
    record = engine.service_record()
    assert record is not None and urls == {record.url}
    services = subprocess.run(["pgrep", "-f", f"system service --time=.* {record.url}$"], capture_output=True,
                              text=True).stdout.split()
    assert services == [str(record.pid)]
