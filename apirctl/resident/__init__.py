"""A warm apirctl process that runs commands in forks of itself, so a command starts in milliseconds.

Why: every `apirctl` process pays for the interpreter, typer, pydantic and apirctl's own modules
(0.25-0.4 s on a small machine) before it does anything, which is most of the difference between
`apirctl serve` and `podman run` (docs/performance.md). The resident process imports all of that
once; each command then runs in a `fork()` of it, with the caller's arguments, environment,
working directory and terminal (its stdin, stdout and stderr are passed over a unix socket with
SCM_RIGHTS), so it behaves as if it had been started directly.

The client half (`run`) is what `apirctl` does first: it needs only the standard library's socket
layer. When no resident process answers, the command runs in the calling process as before, and a
resident process is started in the background for the next command (`spawn`). It exits after
`IDLE_SECONDS` without a command, and at once when apirctl's code or installed packages changed
since it started (so an upgrade or an edit is never served by stale code). It is off unless turned
on (`APIRCTL_RESIDENT=1` or `resident = true` in the config file; docs/resident.md says why);
`apirctl resident status|stop` shows and stops it.

Security: the socket lives in a directory only the user can enter (mode 0700), and on Linux each
connection's peer uid is checked (SO_PEERCRED) before anything runs.
"""

from __future__ import annotations

from apirctl.resident.client import Interrupted, Lost, run, spawn, status, stop
from apirctl.resident.shared import config_path, enabled, identity, runtime_dir, socket_path, suitable

__all__ = ["Interrupted", "Lost", "config_path", "enabled", "identity", "run", "runtime_dir", "socket_path", "spawn",
           "status", "stop", "suitable"]
