"""How a container reaches a service on the host's 127.0.0.1 without publishing it anywhere.

The rpc transport's backend listens on 127.0.0.1 only (its protocol has no authentication), so
each way of running containers needs its own door to the host's loopback:

- `slirp4netns` (podman's rootless network before 5.0): `allow_host_loopback=true` makes 10.0.2.2
  the host's 127.0.0.1, for every port.
- `pasta` (the passt package; podman 4.4 and later, the rootless default from 5.0): `-T PORT`
  makes pasta listen on PORT on the container's own loopback and connect each connection to the
  same port on the host's loopback; the container dials 127.0.0.1:PORT. Chosen over pasta's
  address mappings because it behaves alike in every pasta release (`--map-host-loopback ADDR`
  exists only since 2024-08; before it, only the gateway address maps to the host, and podman
  turns that off with `--no-map-gw`), opens only the named ports, and takes pasta's splice path
  instead of a translation through its tap device.
- `machine` (a podman machine: a QEMU VM networked by gvproxy): the containers run in the VM on
  their default network, and gvproxy's default NAT table turns 192.168.127.254 into the host's
  127.0.0.1.

`choose` decides from where the containers run (the Podman API apirctl talks to: `CONTAINER_HOST`
naming a machine's API socket or SSH connection means a machine; otherwise a local socket or
apirctl's own service, on this host) and, on this host, from the `rpc_network` setting, whose
default `auto` takes slirp4netns when it is installed (podman 4's wiring, the one every version
runs) and pasta otherwise (hosts of podman 5 often have only pasta).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel

from apirctl import config
from apirctl.errors import ApirctlError
from apirctl.host import is_macos
from apirctl.podman import engine
from apirctl.podman.engine import podman_version as installed

if TYPE_CHECKING:
    from apirctl.podman.engine import Endpoint

Mode = Literal["slirp4netns", "pasta", "machine"]
NETWORKS = ("auto", "slirp4netns", "pasta")
# slirp4netns with allow_host_loopback: the host's 127.0.0.1 inside the container.
SLIRP_HOST_LOOPBACK = "10.0.2.2"
# gvproxy (gvisor-tap-vsock) NATs the last address of its 192.168.127.0/24 subnet to 127.0.0.1.
GVPROXY_HOST_LOOPBACK = "192.168.127.254"
# With pasta's -T the forwarded ports listen on the container's own loopback.
PASTA_HOST_LOOPBACK = "127.0.0.1"
PASTA_MIN_PODMAN = (4, 4)  # podman gained `--network pasta` in 4.4

_HOSTS: dict[str, str] = {
    "slirp4netns": SLIRP_HOST_LOOPBACK, "pasta": PASTA_HOST_LOOPBACK, "machine": GVPROXY_HOST_LOOPBACK,
}


class HostLoopback(BaseModel):
    """One door from containers to the host's loopback, and why it was chosen."""

    mode: Mode
    why: str = ""

    @property
    def host(self) -> str:
        """The address a container dials for a port on the host's 127.0.0.1."""
        return _HOSTS[self.mode]

    def endpoint(self, port: int) -> str:
        return f"{self.host}:{port}"

    @property
    def network_mode(self) -> str | None:
        """The podman network mode (None: the container's default network)."""
        return None if self.mode == "machine" else self.mode

    def network_options(self, ports: Sequence[int]) -> dict[str, list[str]]:
        """Podman's options for that network, opening `ports` of the host's loopback."""
        if self.mode == "slirp4netns":
            return {"slirp4netns": ["allow_host_loopback=true"]}
        if self.mode == "pasta" and ports:
            return {"pasta": ["-T", ",".join(str(p) for p in sorted(set(ports)))]}
        return {}


def is_loopback(host: str) -> bool:
    """A name or address of this host's loopback (localhost, 127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def machine_api_sockets(podman: str | None = None) -> set[str]:
    """The API sockets of this user's podman machines (`podman machine inspect`), or none."""
    binary = podman or shutil.which("podman")
    if not binary:
        return set()
    try:
        listed = subprocess.run([binary, "machine", "list", "--format", "json"], capture_output=True, text=True,
                                timeout=60)
        names = [row["Name"] for row in json.loads(listed.stdout or "[]") if row.get("Name")]
        if not names:
            return set()
        inspected = subprocess.run([binary, "machine", "inspect", *names], capture_output=True, text=True,
                                   timeout=60)
        infos = json.loads(inspected.stdout or "[]")
    except (OSError, subprocess.TimeoutExpired, ValueError, TypeError, KeyError):
        return set()
    paths = {((info.get("ConnectionInfo") or {}).get("PodmanSocket") or {}).get("Path") for info in infos or []}
    return {str(Path(p)) for p in paths if p}


def where_containers_run(url: str | None, machine_sockets: Callable[[], set[str]] = machine_api_sockets,
                         ) -> Literal["here", "machine", "remote"]:
    """From a Podman API address: this host, a podman machine of this host, or another host.

    A machine's connections are its API socket, which gvproxy forwards to a `NAME-api.sock` on
    this host, and SSH to the VM's port on this host's loopback (`podman system connection`).
    """
    if not url:
        return "here"
    parts = urlsplit(url)
    if parts.scheme == "unix":
        path = str(Path(parts.path or parts.netloc))
        if Path(path).name.endswith("-api.sock") and path in machine_sockets():
            return "machine"
        return "here"
    host = parts.hostname or ""
    if parts.scheme == "ssh":
        return "machine" if is_loopback(host) else "remote"
    return "here" if is_loopback(host) else "remote"


def _endpoint_url() -> str | None:
    """The Podman API apirctl uses, as `engine.discover` finds it, when it may not be local.

    Only `CONTAINER_HOST` can name a machine or another host on Linux; without it discovery ends
    at a local socket or apirctl's own service, so nothing is pinged or started for that case.
    """
    import os

    if not os.environ.get("CONTAINER_HOST"):
        return None

    return engine.discover(start=False).url


def containers_elsewhere() -> bool:
    """Do this host's containers run in a VM (macOS, a podman machine) or on another host? Then
    this host's GPU devices cannot be handed to them (`apirctl.gpu`)."""
    return is_macos() or where_containers_run(_endpoint_url()) != "here"


def _install_hint(package: str) -> str:
    return f"install it: `sudo apt-get install {package}` (Debian, Ubuntu) or `sudo dnf install {package}` (Fedora)"


def choose(
    requested: str | None = None,
    *,
    endpoint: Endpoint | None = None,
    which: Callable[[str], str | None] | None = None,
    podman_version: Callable[[], tuple[int, ...]] | None = None,
    machine_sockets: Callable[[], set[str]] = machine_api_sockets,
) -> HostLoopback:
    """The way containers reach this host's loopback, or a one-line error saying what to install.

    `requested` is `rpc_network` (auto, slirp4netns, pasta; default: the setting). `endpoint` is
    the Podman API in use (default: as `engine.discover` would find it). `which`, `podman_version`
    and `machine_sockets` describe the host; tests replace them.
    """
    if requested is None:
        requested = config.settings().rpc_network
    if requested not in NETWORKS:
        raise ApirctlError(f"unknown rpc network {requested!r} (choose from {', '.join(NETWORKS)})")
    url = endpoint.url if endpoint is not None else _endpoint_url()
    where = where_containers_run(url, machine_sockets)
    if where == "machine":
        return HostLoopback(mode="machine", why=f"the containers run in a podman machine ({url})")
    if where == "remote":
        raise ApirctlError(
            f"the Podman API at {url} runs its containers on another host, which cannot reach this host's "
            "loopback (where the RPC backend listens)",
            hint="unset CONTAINER_HOST to use this host's podman, or run apirctl on the host that runs the containers",
        )
    which = which or shutil.which
    have_slirp, have_pasta = which("slirp4netns") is not None, which("pasta") is not None
    if requested == "slirp4netns" or (requested == "auto" and have_slirp):
        if not have_slirp:
            raise ApirctlError("rpc_network is slirp4netns, but slirp4netns is not installed",
                               hint=_install_hint("slirp4netns"))
        why = "rpc_network = slirp4netns" if requested != "auto" else "slirp4netns is installed"
        return HostLoopback(mode="slirp4netns", why=why)
    if not have_pasta:
        if requested == "pasta":
            raise ApirctlError("rpc_network is pasta, but pasta is not installed", hint=_install_hint("passt"))
        raise ApirctlError(
            "the rpc transport needs slirp4netns or pasta to reach the backend on the host's loopback, "
            "and neither is installed",
            hint=_install_hint("passt") + "; slirp4netns works too",
        )
    if podman_version is None:
        podman_version = installed
    version = podman_version()
    if version < PASTA_MIN_PODMAN:
        have = ".".join(map(str, version))
        if have_slirp:
            raise ApirctlError(f"rpc_network is pasta, but podman {have} has no pasta network (it needs 4.4 or newer)",
                               hint="`apirctl config set rpc_network auto` uses slirp4netns, which is installed")
        raise ApirctlError(
            f"podman {have} has no pasta network (it needs 4.4 or newer), and slirp4netns is not installed",
            hint=_install_hint("slirp4netns"),
        )
    why = "rpc_network = pasta" if requested != "auto" else "pasta is installed and slirp4netns is not"
    return HostLoopback(mode="pasta", why=why)
