"""The backend cannot be reached from another network namespace with its own address.

A veth pair joins a fresh namespace to the host, as a bridged container or a neighbour on the
network would be. A control listener bound to all addresses IS reachable over that link, so the
refusal of the backend's port is the loopback binding's doing, not a broken link.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 to make a network namespace"),
]

HOST_IP, NS_IP = "10.213.77.1", "10.213.77.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def neighbour() -> Iterator[str]:
    """A network namespace linked to the host by a veth pair; yields its name."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"apirctl-t{tag}", f"apt{tag}h", f"apt{tag}n"
    ip("netns", "add", ns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{HOST_IP}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", ns, "addr", "add", f"{NS_IP}/30", "dev", ns_if)
        ip("-n", ns, "link", "set", ns_if, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def connect_from(ns: str, host: str, port: int) -> subprocess.CompletedProcess[str]:
    code = ("import socket,sys\n"
            f"s=socket.socket(); s.settimeout(5)\n"
            f"sys.exit(s.connect_ex(({host!r},{port})))\n")
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_backend_is_unreachable_from_another_namespace(backend: int, neighbour: str) -> None:
    with socket.create_server(("0.0.0.0", 0)) as control:
        control_port = int(control.getsockname()[1])
        reached = connect_from(neighbour, HOST_IP, control_port)
        assert reached.returncode == 0, f"the veth link itself does not work: {reached.stderr}"
    refused = connect_from(neighbour, HOST_IP, backend)
    assert refused.returncode != 0, "the RPC backend answered on a routable address"
    from apirctl.remoting import rpc_client

    assert rpc_client.probe("127.0.0.1", backend).devices, "while the host's loopback reaches it"
