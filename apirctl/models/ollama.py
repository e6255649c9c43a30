"""The Ollama registry: an OCI-style v2 manifest whose model layer is a GGUF blob.

The registry is `APIRCTL_OLLAMA_REGISTRY` (default the public one), so tests and
mirrors can stand in for it. Blob digests are sha256 and always verified.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from apirctl.errors import ApirctlError
from apirctl.models.download import Remote, http_error, network_error

if TYPE_CHECKING:
    import httpx

DEFAULT_REGISTRY = "https://registry.ollama.ai"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
MANIFEST_TYPES = (
    "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"
)
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


def registry() -> str:
    return (os.environ.get("APIRCTL_OLLAMA_REGISTRY") or DEFAULT_REGISTRY).rstrip("/")


def remote(http: httpx.Client, namespace: str, name: str, tag: str, label: str) -> Remote:
    """Read the manifest and point at its model layer."""
    import httpx

    base = f"{registry()}/v2/{namespace}/{name}"
    try:
        response = http.get(f"{base}/manifests/{tag}", headers={"Accept": MANIFEST_TYPES})
    except httpx.HTTPError as exc:
        raise network_error(label, exc) from None
    if response.status_code == 404:
        raise ApirctlError(f"{label}: no such model or tag in the Ollama registry ({registry()})",
                           hint="check the name on ollama.com/library; tags look like llama3.2:1b")
    if response.status_code >= 400:
        raise http_error(label, response)
    try:
        manifest = response.json()
        layers = manifest["layers"]
    except (ValueError, KeyError, TypeError):
        raise ApirctlError(f"{label}: the registry's manifest is not a v2 image manifest") from None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == MODEL_MEDIA_TYPE:
            match = _DIGEST.match(str(layer.get("digest", "")))
            if not match:
                raise ApirctlError(f"{label}: the model layer has no sha256 digest")
            size = layer.get("size")
            return Remote(
                url=f"{base}/blobs/{layer['digest']}",
                sha256=match.group(1),
                size=size if isinstance(size, int) else None,
            )
    raise ApirctlError(f"{label}: the manifest has no model layer ({MODEL_MEDIA_TYPE})")
