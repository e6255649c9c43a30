"""The Ollama registry and Ollama's own store: v2 manifests whose layers are the model, its projector, params.

The registry is `APIRCTL_OLLAMA_REGISTRY` (default the public one), so tests and mirrors can
stand in for it. Blob digests are sha256 and always verified. The layers apirctl keeps: the
GGUF model, the vision projector (llama-server's `--mmproj`) and the params (default sampling
settings, JSON). The template, system prompt and license layers are Ollama's own format.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apirctl.errors import ApirctlError
from apirctl.models.download import Remote, http_error, network_error

if TYPE_CHECKING:
    import httpx

DEFAULT_REGISTRY = "https://registry.ollama.ai"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
MANIFEST_TYPES = (
    "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"
)
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
PARAMS_LIMIT = 1 << 20  # a params layer is a few hundred bytes of JSON


@dataclass(frozen=True)
class Layer:
    hexdigest: str
    size: int | None


@dataclass(frozen=True)
class Manifest:
    """The layers of one model tag that apirctl uses."""

    model: Layer
    projector: Layer | None = None
    params: Layer | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def registry() -> str:
    return (os.environ.get("APIRCTL_OLLAMA_REGISTRY") or DEFAULT_REGISTRY).rstrip("/")


def parse_manifest(data: Any, label: str) -> Manifest:
    """Pick the model, projector and params layers out of a v2 manifest (the registry's or Ollama's store's)."""
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise ApirctlError(f"{label}: the manifest is not a v2 image manifest")
    found: dict[str, Layer] = {}
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        kind = layer.get("mediaType")
        if kind not in (MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, PARAMS_MEDIA_TYPE) or kind in found:
            continue  # the first of each kind: that is the one Ollama loads
        match = _DIGEST.match(str(layer.get("digest", "")))
        if not match:
            raise ApirctlError(f"{label}: the manifest's {kind} layer has no sha256 digest")
        size = layer.get("size")
        found[kind] = Layer(match.group(1), size if isinstance(size, int) else None)
    if MODEL_MEDIA_TYPE not in found:
        raise ApirctlError(f"{label}: the manifest has no model layer ({MODEL_MEDIA_TYPE})")
    return Manifest(found[MODEL_MEDIA_TYPE], found.get(PROJECTOR_MEDIA_TYPE), found.get(PARAMS_MEDIA_TYPE))


def parse_params(data: bytes) -> dict[str, Any]:
    """The params layer: JSON of default options (`temperature`, `stop`, `num_ctx` …); anything else is {}."""
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blob_url(namespace: str, name: str, hexdigest: str) -> str:
    return f"{registry()}/v2/{namespace}/{name}/blobs/sha256:{hexdigest}"


def manifest(http: httpx.Client, namespace: str, name: str, tag: str, label: str) -> Manifest:
    """Read a tag's manifest from the registry."""
    import httpx

    url = f"{registry()}/v2/{namespace}/{name}/manifests/{tag}"
    try:
        response = http.get(url, headers={"Accept": MANIFEST_TYPES})
    except httpx.HTTPError as exc:
        raise network_error(label, exc) from None
    if response.status_code == 404:
        raise ApirctlError(f"{label}: no such model or tag in the Ollama registry ({registry()})",
                           hint="check the name on ollama.com/library; tags look like llama3.2:1b")
    if response.status_code >= 400:
        raise http_error(label, response)
    try:
        data = response.json()
    except ValueError:
        raise ApirctlError(f"{label}: the registry's manifest is not a v2 image manifest") from None
    return parse_manifest(data, label)


def remote(namespace: str, name: str, layer: Layer) -> Remote:
    return Remote(url=_blob_url(namespace, name, layer.hexdigest), sha256=layer.hexdigest, size=layer.size)


def params(http: httpx.Client, namespace: str, name: str, layer: Layer, label: str) -> dict[str, Any]:
    """Fetch and verify the small params layer."""
    import hashlib

    import httpx

    try:
        response = http.get(_blob_url(namespace, name, layer.hexdigest))
    except httpx.HTTPError as exc:
        raise network_error(label, exc) from None
    if response.status_code >= 400:
        raise http_error(label, response)
    body = response.content[:PARAMS_LIMIT]
    if hashlib.sha256(body).hexdigest() != layer.hexdigest:
        raise ApirctlError(f"{label}: the params layer does not match its digest",
                           hint="run the pull again; if it fails the same way the registry is serving a different file")
    return parse_params(body)
