"""The host side of remoting, one interface over two platforms.

On macOS the "machine" is the libkrun Podman machine whose krunkit loads the
API-remoting virglrenderer (`apirctl.machine.macos`); on Linux it is llama.cpp's
RPC server running on the host GPU, owned by apirctl (`apirctl.machine.linux`).
Both report the same states, whose numbers are the exit codes of
`apirctl machine status` (the upstream status script's and extension's codes).
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any, Protocol

from pydantic import BaseModel, Field


class MachineState(IntEnum):
    """Remoting states; the value is `apirctl machine status`'s exit code."""

    READY = 0  # running with remoting
    SERVING = 1  # a remoting inference server is running
    VFKIT = 10  # macOS: the machine runs with vfkit, which cannot do remoting
    NOT_RUNNING = 11  # the machine (macOS) or the host backend (Linux) is not running
    NO_REMOTING = 12  # macOS: running, but krunkit did not load the remoting virglrenderer
    UNKNOWN_VERSION = 20  # macOS: the bundle version cannot be read
    NOT_INSTALLED = 127  # no bundle (macOS) or no llama.cpp build (Linux)


class MachineStatus(BaseModel):
    """What `machine status` prints; `details` holds platform facts (device, memory, port, pid...)."""

    platform: str
    state: MachineState
    summary: str
    next_step: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class RestartOptions(BaseModel):
    """Options of `machine restart`; each platform reads the ones that apply to it."""

    name: str | None = None  # macOS: podman machine name
    remoting: bool = False
    # Linux (RPC backend)
    device: str | None = None
    threads: int | None = None
    port: int | None = None
    cache: bool | None = None
    # macOS
    krunkit: str | None = None
    selftest: bool = True


class Platform(Protocol):
    def status(self, name: str | None = None) -> MachineStatus: ...

    def restart(self, options: RestartOptions) -> MachineStatus: ...

    def stop(self, name: str | None = None, force: bool = False) -> MachineStatus: ...


def platform() -> Platform:
    """The implementation for this host; `APIRCTL_PLATFORM=macos|linux` overrides it (tests use it
    to drive the macOS code on Linux against the fakes in tests/fakes)."""
    import os

    chosen = os.environ.get("APIRCTL_PLATFORM", "").strip().lower()
    if chosen and chosen not in ("macos", "darwin", "linux"):
        from apirctl.errors import ApirctlError

        raise ApirctlError(f"APIRCTL_PLATFORM={chosen} is not a platform", hint="use macos or linux")
    if chosen in ("macos", "darwin") or (not chosen and sys.platform == "darwin"):
        from apirctl.machine import macos

        return macos
    from apirctl.machine import linux

    return linux
