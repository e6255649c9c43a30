"""Hugging Face: resolve URLs, the LFS digest of a file, picking a GGUF by quantization tag, the shared cache.

The endpoint is `APIRCTL_HF_ENDPOINT` (or the `HF_ENDPOINT` that Hugging Face's own tools
read), so tests and mirrors can stand in for the public service. The token is the one
`huggingface_hub` finds (`HF_TOKEN`, else the file `hf auth login` wrote under `HF_HOME`), sent
for gated repositories; the HTTP client drops it on a redirect to another host. A file already
in Hugging Face's own cache (`HF_HUB_CACHE`) is used where it lies; `HF_HUB_OFFLINE=1` uses
only that cache. `huggingface_hub` is imported only on these paths (half a second of start-up).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import TYPE_CHECKING, Any

from apirctl.errors import ApirctlError
from apirctl.models import split
from apirctl.models.download import Remote, http_error, network_error

if TYPE_CHECKING:
    import httpx

DEFAULT_ENDPOINT = "https://huggingface.co"
PREFERRED_QUANTS = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q8_0")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def endpoint() -> str:
    return (os.environ.get("APIRCTL_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> str | None:
    """The access token as Hugging Face's own tools find it: `HF_TOKEN`, else the stored login."""
    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()


def _headers() -> dict[str, str]:
    value = token()
    return {"Authorization": f"Bearer {value}"} if value else {}


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached(repo: str, filename: str | None, quant: str | None, revision: str) -> str | None:
    """The path of the file this reference names in Hugging Face's cache, picked as a download would pick."""
    from pathlib import Path

    from huggingface_hub import constants, try_to_load_from_cache

    if filename:
        found = try_to_load_from_cache(repo, filename, revision=revision)
        return found if isinstance(found, str) else None
    repo_dir = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    try:
        commit = (repo_dir / "refs" / revision).read_text().strip()
    except OSError:
        commit = revision
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    files = [{"path": str(p.relative_to(snapshot))} for p in snapshot.rglob("*.gguf")]
    try:
        name = pick(files, quant, "")
    except ApirctlError:
        return None
    return str(snapshot / name)


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

    def first_parts(tag: str | None) -> list[str]:
        """The first part of each split model (matching the tag, when one is given)."""
        firsts = {split.parts(p)[0] for p in ggufs if _SHARD.search(p) and "mmproj" not in p.lower()}
        if tag is None:
            return sorted(firsts)
        pattern = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(tag)}([^A-Za-z0-9]|$)", re.IGNORECASE)
        return sorted(p for p in firsts if pattern.search(p))

    if quant:
        found = matching(quant) or first_parts(quant)
        if len(found) == 1:
            return found[0]
        if not found:
            raise ApirctlError(f"{label}: no file matches {quant!r}",
                               hint="files: " + ", ".join(sorted(single)[:12]))
        raise ApirctlError(f"{label}: {len(found)} files match {quant!r}: {', '.join(sorted(found))}",
                           hint="name the file: hf://ORG/REPO/FILE.gguf")
    if len(single) == 1:
        return single[0]
    if not single and len(first_parts(None)) == 1:
        return first_parts(None)[0]
    for tag in PREFERRED_QUANTS:
        found = matching(tag) or first_parts(tag)
        if len(found) == 1:
            return found[0]
    raise ApirctlError(f"{label}: the repository has {len(single)} GGUF files; say which",
                       hint="add a quantization (hf.co/ORG/REPO:Q4_K_M) or name the file; files: "
                       + ", ".join(sorted(single)[:12]))


def pick_mmproj(files: list[dict[str, Any]]) -> str | None:
    """The vision projector a repository ships beside its models (F16 when there are several), if any."""
    found = sorted(str(f["path"]) for f in files
                   if str(f["path"]).lower().endswith(".gguf") and "mmproj" in str(f["path"]).lower())
    if len(found) > 1:
        preferred = [p for p in found if "f16" in p.lower()]
        found = preferred or found
    return found[0] if found else None


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
