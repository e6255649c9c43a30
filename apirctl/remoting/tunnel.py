"""SSH tunnels to remote llama.cpp RPC backends.

Why: the RPC protocol has no authentication and lets a client read and write memory on the
backend's host, so a backend on another machine must stay bound to that machine's loopback and be
reached through SSH, which authenticates and encrypts (the approach of the Lima seed). A tunnel
is `ssh -N -L 127.0.0.1:LOCAL:TARGET USER@HOST` run in the background; the container then
reaches its local end through the host-loopback mapping like the local backend. A tunnel counts as
open only when an RPC HELLO answers through it, so a wrong target fails here, not in llama-server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, ValidationError

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, ensure
from apirctl.remoting import rpc_client

OPEN_TIMEOUT = 30.0


class Tunnel(BaseModel):
    """One background SSH forward, remembered in the state directory."""

    pid: int
    local_port: int
    target: str  # HOST:PORT as the SSH host sees it
    via: str  # USER@HOST[:PORT]
    log: str
    started_at: float


def _state_dir() -> Path:
    return dirs().state / "tunnels"


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def split_via(via: str) -> tuple[str, list[str]]:
    """`USER@HOST[:PORT]` -> (destination, extra ssh arguments)."""
    dest, sep, port = via.rpartition(":")
    if sep and port.isdigit() and "@" in dest and not dest.endswith("]"):
        return dest, ["-p", port]
    if "@" not in via or via.startswith("@") or via.endswith("@"):
        raise ApirctlError(f"--via-ssh {via!r}: expected USER@HOST or USER@HOST:PORT")
    return via, []


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def open_tunnel(via: str, target_host: str, target_port: int, ssh_args: list[str] | None = None,
                timeout: float = OPEN_TIMEOUT) -> Tunnel:
    """Start the forward and wait until an RPC server answers through it; raise a clear error if not."""
    dest, via_args = split_via(via)
    local = _free_loopback_port()
    log = ensure(dirs().logs) / f"ssh-tunnel-{local}.log"
    target = f"{target_host}:{target_port}"
    args = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=15",
            "-L", f"127.0.0.1:{local}:{target}", *via_args, *(ssh_args or []), dest]
    with log.open("ab") as fh:
        try:
            child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        except FileNotFoundError:
            raise ApirctlError("--via-ssh needs the `ssh` client", hint="install OpenSSH's client") from None
    tunnel = Tunnel(pid=child.pid, local_port=local, target=target, via=via, log=str(log), started_at=time.time())
    deadline = time.monotonic() + timeout
    problem = ""
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise ApirctlError(f"ssh to {dest} failed (exit {child.returncode}): {tail(log, default='no output')}",
                               hint="check that `ssh " + " ".join([*via_args, dest]) + "` logs in without a password")
        try:
            rpc_client.probe("127.0.0.1", local, timeout=2.0)
            ensure(_state_dir())
            (_state_dir() / f"{child.pid}.json").write_text(tunnel.model_dump_json())
            return tunnel
        except (OSError, rpc_client.RpcError) as exc:
            problem = str(exc) or type(exc).__name__
        time.sleep(0.2)
    _stop(child.pid)
    child.wait()
    raise ApirctlError(f"no RPC backend answered at {target} through ssh {dest} within {timeout:.0f}s ({problem})",
                       hint=f"on {dest.split('@', 1)[1]}, start it with "
                            "`apirctl machine restart --remoting --listen tcp`")


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def tunnels() -> list[Tunnel]:
    """The tunnels apirctl opened that still run (stale records are removed)."""
    found = []
    folder = _state_dir()
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            tunnel = Tunnel.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            continue
        if _alive(tunnel.pid):
            found.append(tunnel)
        else:
            path.unlink(missing_ok=True)
    return found


def close(pids: list[int], timeout: float = 10.0) -> None:
    """Stop tunnels by pid (only those apirctl recorded), waiting until they are gone."""
    known = {t.pid for t in tunnels()}
    for pid in pids:
        if pid not in known:
            continue
        _stop(pid)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        (_state_dir() / f"{pid}.json").unlink(missing_ok=True)
