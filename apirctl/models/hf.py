"""Hugging Face: resolve URLs, the LFS digest of a file, and picking a GGUF by quantization tag.

The endpoint is `APIRCTL_HF_ENDPOINT` (or the `HF_ENDPOINT` that Hugging Face's own tools
read), so tests and mirrors can stand in for the public service. `HF_TOKEN` is sent for
gated repositories; the HTTP client drops it on a redirect to another host.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import TYPE_CHECKING, Any

from apirctl.errors import ApirctlError
from apirctl.models.download import Remote, http_error, network_error

if TYPE_CHECKING:
    import httpx

DEFAULT_ENDPOINT = "https://huggingface.co"
PREFERRED_QUANTS = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q8_0")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def endpoint() -> str:
    return (os.environ.get("APIRCTL_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _headers() -> dict[str, str]:
    token = os.environ.get("HF_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _quote(path: str) -> str:
    return "/".join(urllib.parse.quote(part, safe="") for part in path.split("/"))


def list_files(http: httpx.Client, repo: str, revision: str, label: str) -> list[dict[str, Any]]:
    """The repository's files (path, size, LFS sha256) from the tree API."""
    import httpx

    url = f"{endpoint()}/api/models/{repo}/tree/{_quote(revision)}"
    try:
        response = http.get(url, params={"recursive": "true"}, headers=_headers())
    except httpx.HTTPError as exc:
        raise network_error(label, exc) from None
    if response.status_code >= 400:
        raise http_error(label, response)
    try:
        entries = response.json()
    except ValueError:
        raise ApirctlError(f"{label}: {url} did not answer with JSON") from None
    if not isinstance(entries, list):
        raise ApirctlError(f"{label}: unexpected answer from {url}")
    return [e for e in entries if isinstance(e, dict) and e.get("type", "file") == "file" and "path" in e]


def pick(files: list[dict[str, Any]], quant: str | None, label: str) -> str:
    """Choose one GGUF: the one matching the quantization tag, or the usual default."""
    ggufs = [f["path"] for f in files if str(f["path"]).lower().endswith(".gguf")]
    single = [p for p in ggufs if not _SHARD.search(p) and "mmproj" not in p.lower()]
    if not ggufs:
        raise ApirctlError(f"{label}: the repository has no .gguf file")

    def matching(tag: str) -> list[str]:
        pattern = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(tag)}([^A-Za-z0-9]|$)", re.IGNORECASE)
        return [p for p in single if pattern.search(p.rsplit("/", 1)[-1].removesuffix(".gguf"))]

    if quant:
        found = matching(quant)
        if len(found) == 1:
            return found[0]
        if not found:
            sharded = [p for p in ggufs if quant.lower() in p.lower() and _SHARD.search(p)]
            why = "only as a split (multi-file) GGUF, which apirctl does not fetch" if sharded else "no file"
            raise ApirctlError(f"{label}: {why} matches {quant!r}",
                               hint="files: " + ", ".join(sorted(single)[:12]))
        raise ApirctlError(f"{label}: {len(found)} files match {quant!r}: {', '.join(sorted(found))}",
                           hint="name the file: hf://ORG/REPO/FILE.gguf")
    if len(single) == 1:
        return single[0]
    for tag in PREFERRED_QUANTS:
        found = matching(tag)
        if len(found) == 1:
            return found[0]
    raise ApirctlError(f"{label}: the repository has {len(single)} GGUF files; say which",
                       hint="add a quantization (hf.co/ORG/REPO:Q4_K_M) or name the file; files: "
                       + ", ".join(sorted(single)[:12]))


def _etag_digest(headers: httpx.Headers) -> str | None:
    for name in ("X-Linked-Etag", "ETag"):
        value = headers.get(name, "").strip().removeprefix("W/").strip('"').lower()
        if _SHA256.match(value):
            return value
    return None


def remote(http: httpx.Client, repo: str, filename: str, revision: str, label: str) -> Remote:
    """The resolve URL of a file, with the sha256 and size Hugging Face puts on LFS files."""
    import httpx

    url = f"{endpoint()}/{repo}/resolve/{_quote(revision)}/{_quote(filename)}"
    try:
        head = http.head(url, headers=_headers(), follow_redirects=False)
        # A renamed repository answers with a relative redirect to its new name: follow those
        # (same host) until the answer carries the file's metadata or points at the CDN.
        for _ in range(5):
            location = head.headers.get("Location", "")
            if not head.is_redirect or "X-Linked-Etag" in head.headers or "://" in location:
                break
            url = str(head.url.join(location))
            head = http.head(url, headers=_headers(), follow_redirects=False)
    except httpx.HTTPError as exc:
        raise network_error(label, exc) from None
    if head.status_code >= 400:
        raise http_error(label, head)
    size_header = head.headers.get("X-Linked-Size") or (
        head.headers.get("Content-Length") if head.status_code == 200 else None
    )
    size = int(size_header) if size_header and size_header.isdigit() else None
    return Remote(url=url, sha256=_etag_digest(head.headers), size=size, headers=_headers())
