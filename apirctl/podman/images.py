"""Image pulls through the Podman service, with Podman's refusals as one line that says what to do.

podman-py's pull stream serves here (the pull is long; its import cost does not matter), reached
through `apirctl.podman.containers.PodmanApi.pull` like every other Podman call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from apirctl.errors import ApirctlError
from apirctl.podman import engine

# Podman's pull errors that mean "this registry speaks plain HTTP (or TLS we cannot verify)":
# registries.conf's `insecure = true` for that registry is the fix.
_NOT_TLS = re.compile(
    r"server gave HTTP response to HTTPS client|does not look like a TLS handshake|x509: |tls: ", re.IGNORECASE
)
_AUTH = re.compile(r"unauthorized|authentication required|requested access to the resource is denied", re.IGNORECASE)
_UNREACHABLE = re.compile(
    r"connection refused|no such host|i/o timeout|network is unreachable|no route to host|connection reset",
    re.IGNORECASE,
)


def registry_of(ref: str) -> str:
    """The registry host of an image reference (`docker.io` when the reference names none)."""
    first, sep, _ = ref.partition("/")
    return first if sep and ("." in first or ":" in first or first == "localhost") else "docker.io"


def pull_failure(ref: str, error: str) -> ApirctlError:
    """Podman's pull error as one line naming the image, with what to do about it."""
    reason = " ".join(error.split())
    reason = re.sub(r"^initializing source \S+: ", "", reason)  # podman repeats the reference
    host = registry_of(ref)
    if re.search(r"manifest unknown", reason, re.IGNORECASE):
        repo = ref.split("@", 1)[0]
        if ":" in repo.rsplit("/", 1)[-1]:
            repo = repo.rsplit(":", 1)[0]
        return ApirctlError(f"cannot pull {ref}: the registry has no such tag or digest (manifest unknown)",
                            hint=f"check the tag: `podman search --list-tags {repo}` lists them")
    if re.search(r"name unknown|repository name not known", reason, re.IGNORECASE):
        return ApirctlError(f"cannot pull {ref}: the registry has no such repository (name unknown)")
    if _AUTH.search(reason):
        return ApirctlError(f"cannot pull {ref}: {reason}", hint=f"log in first: `podman login {host}`")
    if _NOT_TLS.search(reason):
        return ApirctlError(
            f"cannot pull {ref}: {host} does not speak verifiable HTTPS ({reason.rsplit(': ', 1)[-1]})",
            hint=f'for a plain-HTTP or self-signed private registry add `[[registry]] location = "{host}" '
            "insecure = true` to the registries.conf the Podman service reads (/etc/containers/, "
            "~/.config/containers/ rootless, or $CONTAINERS_REGISTRIES_CONF; in the podman machine on macOS)",
        )
    if _UNREACHABLE.search(reason):
        return ApirctlError(f"cannot pull {ref}: the registry {host} does not answer "
                            f"({reason.rsplit(': ', 1)[-1]})",
                            hint="check the registry address and that it is up and reachable from the Podman service")
    return ApirctlError(f"cannot pull {ref}: {reason}")


def _pull_once(ref: str, on_status: Callable[[str], None] | None) -> str | None:
    """One pull through the Podman service; None when it worked, else Podman's error text."""
    from podman.errors import APIError

    try:
        # tls_verify=None leaves tlsVerify out of the request (requests drops None parameters):
        # podman-py's default, an explicit tlsVerify=true, overrides a registries.conf entry's
        # `insecure = true`, so a private plain-HTTP registry could never be pulled from.
        # compatMode=False asks every Podman version for libpod's own stream: {"stream": line}...,
        # then {"id": ...} or {"error": ...}.
        stream: Any = engine.client().images.pull(ref, stream=True, decode=True, tls_verify=None, compatMode=False)
        for line in stream:
            if not isinstance(line, dict):
                continue
            if line.get("error"):
                return str(line["error"])
            status = str(line.get("stream") or line.get("status") or "").strip()
            if on_status and status:
                on_status(status)
    except APIError as exc:
        return engine.api_error_message(exc)
    return None


def pull(ref: str, on_status: Callable[[str], None] | None = None) -> None:
    """Pull a remote image through the Podman service, reporting Podman's progress lines.

    TLS follows the registries.conf of the service, as `podman pull` does. When a registry is
    refused for speaking plain HTTP and the service is apirctl's own, it is restarted once (it may
    predate the registries.conf entry that allows it) and the pull is tried again.
    """
    error = _pull_once(ref, on_status)
    if error is not None and _NOT_TLS.search(error) and engine.restart_own_service():
        if on_status:
            on_status("restarted apirctl's Podman service to read registries.conf again")
        error = _pull_once(ref, on_status)
    if error is not None:
        raise pull_failure(ref, error)
