"""The host side of remoting, one interface over two platforms.

On macOS the "machine" is the libkrun Podman machine whose krunkit loads the
API-remoting virglrenderer (`apirctl.macos.machine`); on Linux it is llama.cpp's
RPC server running on the host GPU, owned by apirctl (`apirctl.remoting.rpc_server`).
Both report the same states, whose numbers are the exit codes of
`apirctl machine status` (the upstream status script's and extension's codes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import IntEnum
from typing import Any, Protocol

from pydantic import BaseModel, Field

from apirctl.podman.servers import Server


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
    port: int | None = None  # implies listen tcp
    listen: str | None = None  # unix (default) or tcp; None: tcp with a port, else the rpc_listen setting
    cache: bool | None = None
    # macOS
    krunkit: str | None = None
    selftest: bool = True


class Platform(Protocol):
    """What `apirctl machine` drives; `apirctl.remoting.machines.current()` gives this host's."""

    def status(self, name: str | None = None, *, gpu_memory: bool = False) -> MachineStatus:
        """The state; with `gpu_memory`, what each container's backend holds of the GPU (asks the driver's
        tool: `machine status` wants it, serve's planning does not)."""
        ...

    def restart(self, options: RestartOptions, progress: Callable[[str], None] | None = None) -> MachineStatus:
        """`progress(step)` is told each step as it starts (`apirctl machine restart` shows them)."""
        ...

    def stop(self, name: str | None = None) -> MachineStatus:
        """Refuses while inference servers use the machine (`servers`); `--force` stops those first."""
        ...

    def servers(self, name: str | None = None) -> list[Server]: ...

    def stale_servers(self) -> list[Server]:
        """Servers whose link to the machine died with a restart under them (they need a restart)."""
        ...

    def logs(self, follow: bool = False, tail: int = 50) -> Iterator[str]: ...
