"""This host's remoting machine: the one place that picks the platform's implementation of
`apirctl.machine.Platform` (the libkrun machine on macOS, the host RPC backend on Linux).

The implementation is imported when chosen, the one deliberate late import of the library: the
macOS machine brings the APIR driver and the bundle code, which a Linux `serve` (measured against
`podman run`, docs/performance.md) must not pay for, and the other way round.
"""

from __future__ import annotations

from apirctl import host
from apirctl.machine import Platform


def current() -> Platform:
    """The implementation for this host (`APIRCTL_PLATFORM` overrides it, see `apirctl.host`)."""
    if host.is_macos():
        from apirctl.macos import machine

        return machine
    from apirctl.remoting import rpc_server

    return rpc_server
