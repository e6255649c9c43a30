"""Another user against apirctl's sockets: the host RPC backend's socket (which gives access to this
user's GPU and memory) and its runtime folder. Run as the throw-away user `nobody` by `setpriv`
(root gets through any file permission, so the cases need a user who does not). The resident
process's socket has its case in `test_resident_faults.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sweep import NOBODY, REPO, as_user, sweep

LINUX = {"APIRCTL_PLATFORM": "linux"}
PROBE = "from apirctl.remoting import rpc_client; import sys; rpc_client.probe(sys.argv[1], None, timeout=10)"


def probe_as(uid: int, sock: str) -> subprocess.CompletedProcess[str]:
    """`rpc_client.probe` of the socket in a process of `uid`: exit 0 only if the backend answered."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
                           PROBE, f"unix:{sock}"], capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture
def unix_backend(llama_build, elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    """The host RPC backend on its Unix socket, in a runtime folder under `elsewhere` (so that only
    the folder's own mode keeps others out); its socket path."""
    from apirctl.remoting import rpc_server

    runtime = elsewhere / "run"
    monkeypatch.setenv("APIRCTL_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("APIRCTL_LLAMA_BUILD", str(llama_build.root))
    sweep("machine", "restart", "--remoting", "--listen", "unix", "--no-cache", env=LINUX, timeout=300).succeeds()
    record = rpc_server.read_record()
    assert record is not None and record.socket
    yield Path(record.socket)
    runtime.chmod(0o700)


@pytest.mark.integration
def test_another_user_cannot_use_the_backend_even_through_an_open_socket(unix_backend: Path) -> None:
    folder = unix_backend.parent
    refused = probe_as(NOBODY, str(unix_backend))
    assert refused.returncode != 0 and "PermissionError" in refused.stderr  # the folder is 0700

    # a mistake opens the folder and the socket: the backend itself refuses a peer of another uid
    folder.chmod(0o755)
    unix_backend.chmod(0o666)
    refused = probe_as(NOBODY, str(unix_backend))
    assert refused.returncode != 0 and "dropped the connection during HELLO" in refused.stderr, refused.stderr
    # and apirctl says the folder is open, in one line, instead of using it
    sweep("machine", "restart", "--remoting", "--listen", "unix", "--no-cache", env=LINUX).fails_cleanly(
        code=1, says="is open to other users")

    folder.chmod(0o700)
    unix_backend.chmod(0o600)
    ready = sweep("machine", "status", "--json", env=LINUX)
    assert ready.code == 0, ready.stdout + ready.stderr  # the owner's backend is unharmed
    assert probe_as(os.getuid(), str(unix_backend)).returncode == 0


def test_another_users_runtime_folder_is_refused(elsewhere: Path) -> None:
    """A user pointed at root's runtime folder gets one line and a hint, and nothing is made there."""
    runtime = elsewhere / "root-run"
    runtime.mkdir(mode=0o700)
    env = {**as_user(elsewhere), **LINUX, "APIRCTL_RUNTIME_DIR": str(runtime)}
    out = sweep("machine", "restart", "--remoting", "--listen", "unix", env=env, user=NOBODY)
    out.fails_cleanly(code=1, says=f"{runtime} belongs to uid 0, not to this user (uid {NOBODY})")
    assert out.error_lines[1].startswith("hint:")
    assert list(runtime.iterdir()) == []
