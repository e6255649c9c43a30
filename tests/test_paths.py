"""apirctl's directories: the runtime directory that holds sockets must be this user's alone."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl import paths
from apirctl.errors import ApirctlError


def test_runtime_dir_follows_the_home_and_its_own_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APIRCTL_RUNTIME_DIR")
    assert paths.dirs().runtime == Path(os.environ["APIRCTL_HOME"]).resolve() / "run"
    monkeypatch.setenv("APIRCTL_RUNTIME_DIR", str(tmp_path / "r"))
    assert paths.dirs().runtime == tmp_path / "r"


def test_a_missing_runtime_dir_is_created_private(tmp_path: Path) -> None:
    made = paths.private_dir(tmp_path / "a" / "run")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_a_runtime_dir_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ApirctlError, match=f"open to other users \\(mode {mode:04o}\\)") as caught:
        paths.private_dir(folder)
    assert caught.value.hint == f"make it private with `chmod 700 {folder}`"
    assert (folder.stat().st_mode & 0o777) == mode, "refused, not repaired behind the user's back"


def test_a_link_or_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ApirctlError, match="is not a directory"):
        paths.private_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(ApirctlError, match="is not a directory"):
        paths.private_dir(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_runtime_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    os.chown(folder, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(ApirctlError, match="belongs to uid .*not to this user"):
        paths.private_dir(folder)


def test_a_socket_path_too_long_for_the_kernel_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ApirctlError, match="longer than the 107") as caught:
        paths.socket_path(deep, "rpc.sock")
    assert caught.value.hint and "APIRCTL_RUNTIME_DIR" in caught.value.hint
    assert paths.socket_path(Path("/run/x"), "rpc.sock") == Path("/run/x/rpc.sock")


def test_machine_restart_refuses_an_open_runtime_dir(tmp_path: Path) -> None:
    """Before anything starts (even before a build is looked for): one error line, a hint, exit 1."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    result = subprocess.run([sys.executable, "-m", "apirctl", "machine", "restart", "--remoting"],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, APIRCTL_PLATFORM="linux", APIRCTL_RUNTIME_DIR=str(folder)))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "open to other users (mode 0755)" in lines[0] and "chmod 700" in lines[1]


def test_doctor_names_an_open_runtime_dir_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from apirctl.diagnose import doctor

    monkeypatch.setenv("APIRCTL_PLATFORM", "linux")
    assert doctor._runtime_dir().status == "ok"
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o775)
    monkeypatch.setenv("APIRCTL_RUNTIME_DIR", str(folder))
    monkeypatch.setattr(doctor, "CHECKS", [c for c in doctor.CHECKS if c[0] == "runtime directory"])
    [check] = doctor.run().checks
    assert check.status == "fail" and "mode 0775" in check.detail
    assert check.fix == f"make it private with `chmod 700 {folder}`"
