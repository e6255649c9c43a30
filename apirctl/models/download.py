"""Resumable, verified HTTP downloads into the store's `partial/` folder.

A download appends to a partial file; the next attempt asks the server for the rest
(an HTTP range) instead of starting over. The caller gives the file its final name
only after the digest (when the source publishes one) and the GGUF check pass.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from apirctl import __version__
from apirctl.errors import ApirctlError

if TYPE_CHECKING:
    import httpx

CHUNK = 1 << 20
#: Told how far a download got, as bytes arrive: (label, bytes held, total bytes or None when unknown).
#: The CLI draws a bar with it; library callers pass nothing.
DownloadProgress = Callable[[str, int, "int | None"], None]


@dataclass
class Remote:
    """One file to fetch: its URL, and the digest and size when the source tells them."""

    url: str
    sha256: str | None = None
    size: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


def client() -> httpx.Client:
    """The HTTP client every source uses: redirects followed, patient reads, a user agent."""
    import httpx

    return httpx.Client(
        follow_redirects=True,
        timeout=httpx.Timeout(30.0, read=120.0),
        headers={"User-Agent": f"apirctl/{__version__}"},
    )


def http_error(label: str, response: httpx.Response) -> ApirctlError:
    """One line for an HTTP failure, with the hint a user can act on."""
    code = response.status_code
    url = str(response.url)
    if code == 404:
        return ApirctlError(f"{label}: not found (HTTP 404 at {url})",
                            hint="check the name, tag and file; `apirctl models aliases` lists short names")
    if code in (401, 403):
        return ApirctlError(f"{label}: access denied (HTTP {code} at {url})",
                            hint="gated Hugging Face repositories need HF_TOKEN set to an access token")
    return ApirctlError(f"{label}: HTTP {code} at {url}")


def network_error(label: str, exc: Exception) -> ApirctlError:
    return ApirctlError(f"{label}: network failure ({type(exc).__name__}: {exc or 'connection lost'})",
                        hint="run the same command again: the download resumes where it stopped")


def disk_error(label: str, exc: OSError, where: Path) -> ApirctlError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ApirctlError(f"{label}: disk full while writing {where.parent} ({exc.strerror})",
                            hint="free some space (or move APIRCTL_HOME to a larger disk) and pull again")
    return ApirctlError(f"{label}: cannot write {where}: {exc.strerror or exc}")


@contextmanager
def locked(path: Path, label: str) -> Iterator[IO[bytes]]:
    """Open a partial file for appending, exclusively: two pulls of one file must not interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ApirctlError(f"{label}: another apirctl is downloading this file right now") from None
        yield fh


def _hash_existing(path: Path) -> hashlib._Hash:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest


def _reset(fh: IO[bytes]) -> None:
    fh.seek(0)
    fh.truncate(0)


def validator_path(partial: Path) -> Path:
    """Beside a partial file: the ETag or Last-Modified of the version its bytes came from."""
    return partial.with_suffix(".validator")


def _stream_into(http: httpx.Client, remote: Remote, fh: IO[bytes], validator: Path, *, label: str,
                 progress: DownloadProgress | None) -> int:
    """Append the rest of the file to `fh` (positioned at its end); return the bytes now held.

    A resume carries `If-Range`, so a server whose file changed since sends all of the new one.
    Returns -1 when the server rejects our range (416): the caller starts over.
    """
    have = fh.tell()
    headers = {**remote.headers, "Accept-Encoding": "identity"}  # ranges count bytes of the file itself
    if have:
        headers["Range"] = f"bytes={have}-"
        if validator.is_file():
            headers["If-Range"] = validator.read_text().strip()
    with http.stream("GET", remote.url, headers=headers) as response:
        if response.status_code == 416 and have:
            return -1
        if response.status_code >= 400:
            raise http_error(label, response)
        if response.status_code != 206 and have:
            _reset(fh)  # the server ignored the range, or the file changed: it sends the whole file
            have = 0
        if response.status_code == 200:
            etag = response.headers.get("ETag", "")
            stamp = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified", "")
            if stamp:
                validator.write_text(stamp)
            else:
                validator.unlink(missing_ok=True)
        length = response.headers.get("Content-Length")
        total = remote.size or (have + int(length) if length and length.isdigit() else None)
        if progress:
            progress(label, have, total)
        for chunk in response.iter_raw():  # as bytes arrive: a cut connection keeps what came
            fh.write(chunk)
            have += len(chunk)
            if progress:
                progress(label, have, total)
    fh.flush()
    return have


def discard(partial: Path) -> None:
    """Remove a partial download and its validator."""
    partial.unlink(missing_ok=True)
    validator_path(partial).unlink(missing_ok=True)


def _drop_if_empty(path: Path) -> None:
    """A failed first attempt leaves nothing behind; a partial file with bytes stays to resume."""
    try:
        if path.stat().st_size == 0:
            discard(path)
    except OSError:
        pass


def fetch(http: httpx.Client, remote: Remote, partial: Path, *, label: str,
          progress: DownloadProgress | None = None) -> str:
    """Download `remote` into `partial`, resuming what is there; return the sha256 hex digest.

    On a network failure the partial file stays for the next attempt; on a digest
    mismatch or a full disk it is removed. Nothing here writes a final name.
    """
    import httpx

    validator = validator_path(partial)
    with locked(partial, label) as fh:
        try:
            if remote.size is not None and fh.tell() > remote.size:
                _reset(fh)
            have = fh.tell()
            if remote.size is None or have < remote.size:
                have = _stream_into(http, remote, fh, validator, label=label, progress=progress)
                if have < 0:  # our partial file does not fit the server's file: start over
                    _reset(fh)
                    have = _stream_into(http, remote, fh, validator, label=label, progress=progress)
        except httpx.HTTPError as exc:
            fh.flush()
            _drop_if_empty(partial)
            raise network_error(label, exc) from None
        except OSError as exc:
            discard(partial)
            raise disk_error(label, exc, partial) from None
        except BaseException:
            _drop_if_empty(partial)
            raise
        if remote.size is not None and have < remote.size:
            raise network_error(label, ConnectionError(f"got {have} of {remote.size} bytes"))
    validator.unlink(missing_ok=True)  # complete: nothing left to resume
    hexdigest = _hash_existing(partial).hexdigest()
    if remote.sha256 and hexdigest != remote.sha256:
        partial.unlink(missing_ok=True)
        raise ApirctlError(
            f"{label}: digest mismatch (expected sha256:{remote.sha256}, got sha256:{hexdigest}); "
            "the download was discarded",
            hint="run the pull again; if it fails the same way the server is serving a different file",
        )
    return hexdigest
