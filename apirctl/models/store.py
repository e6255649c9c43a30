"""The content-addressed store under the data directory.

Layout (`paths.dirs().models`):

    blobs/sha256-<hex>.gguf   the files, named by their digest: two names of one file share it
    refs/<key>.json           one per model name: name, source, digest, size, original file name,
                              and the files that belong with it (split parts, a projector) and params
    partial/                  downloads in progress (resumable); never read as a model

A blob gets its final name only by an atomic rename of a complete, verified file, and a
ref is written (atomically) only after its blob exists, so an interrupted pull never
leaves a half file under a final name.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from apirctl.errors import ApirctlError
from apirctl.paths import dirs


class StoredFile(BaseModel):
    """A file that belongs with a model: a later part of a split GGUF, or a vision projector."""

    digest: str  # "sha256:<hex>"
    size: int
    filename: str  # the name llama.cpp must see (split parts find each other by name)

    @property
    def hexdigest(self) -> str:
        return self.digest.split(":", 1)[1]


class StoredRef(BaseModel):
    """What the store knows about one model name."""

    name: str
    source: str
    digest: str  # "sha256:<hex>"; of the first part for a split model
    size: int
    filename: str
    origin: str = ""  # where it came from (URL, wheel), for humans
    pulled_at: str = ""
    parts: list[StoredFile] = Field(default_factory=list, description="parts 2..N of a split GGUF")
    mmproj: StoredFile | None = Field(default=None, description="the multimodal projector (vision models)")
    params: dict[str, Any] = Field(default_factory=dict, description="the source's default parameters")

    @property
    def hexdigest(self) -> str:
        return self.digest.split(":", 1)[1]

    def hexdigests(self) -> list[str]:
        """Every blob this name needs: the model (all parts) and its projector."""
        extra = [*self.parts, *([self.mmproj] if self.mmproj else [])]
        return [self.hexdigest, *(f.hexdigest for f in extra)]


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Store:
    """Blobs and refs under one root; every path is computed, nothing is cached in memory."""

    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            root = dirs().models
        self.root = root

    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def refs_dir(self) -> Path:
        return self.root / "refs"

    @property
    def partial(self) -> Path:
        return self.root / "partial"

    def blob_path(self, hexdigest: str) -> Path:
        return self.blobs / f"sha256-{hexdigest}.gguf"

    def has_blob(self, hexdigest: str) -> bool:
        return self.blob_path(hexdigest).is_file()

    def _ref_path(self, name: str) -> Path:
        return self.refs_dir / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json"

    def partial_path(self, key: str) -> Path:
        """Where a download in progress for `key` (a URL or digest) accumulates its bytes."""
        return self.partial / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.part"

    def get(self, name: str) -> StoredRef | None:
        """The ref for a name, if its blob is present."""
        path = self._ref_path(name)
        try:
            ref = StoredRef.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            return None
        return ref if ref.name == name and self._complete(ref) else None

    def _complete(self, ref: StoredRef) -> bool:
        return all(self.has_blob(h) for h in ref.hexdigests())

    def refs(self) -> list[StoredRef]:
        """Every name whose blob is present, sorted by name."""
        found = []
        for path in sorted(self.refs_dir.glob("*.json")) if self.refs_dir.is_dir() else []:
            try:
                ref = StoredRef.model_validate_json(path.read_text())
            except (OSError, ValidationError):
                continue
            if self._complete(ref):
                found.append(ref)
        return sorted(found, key=lambda r: r.name)

    def adopt(self, tmp: Path, hexdigest: str) -> Path:
        """Give a complete, verified file its final name (or drop it if the blob already exists)."""
        final = self.blob_path(hexdigest)
        if final.is_file():
            tmp.unlink(missing_ok=True)
            return final
        self.blobs.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
        return final

    def put(self, ref: StoredRef) -> None:
        """Record a name for a blob that is already in place."""
        if not self._complete(ref):
            raise ApirctlError(f"{ref.name}: internal error: a blob of {ref.digest} is missing")
        self.refs_dir.mkdir(parents=True, exist_ok=True)
        previous = self.get(ref.name)
        path = self._ref_path(ref.name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(ref.model_dump_json(indent=2))
        os.replace(tmp, path)
        if previous and previous.hexdigests() != ref.hexdigests():
            self._drop_unused(previous)

    def _drop_unused(self, ref: StoredRef) -> bool:
        """Delete the blobs no name uses any more (a re-pointed or removed name's old files).

        Returns whether the model's own file went."""
        used = {h for other in self.refs() for h in other.hexdigests()}
        for hexdigest in ref.hexdigests():
            if hexdigest not in used:
                self.blob_path(hexdigest).unlink(missing_ok=True)
        return ref.hexdigest not in used

    def remove(self, name: str) -> tuple[StoredRef, bool] | None:
        """Drop a name; drop its blob when no other name uses it. Returns (ref, blob removed)."""
        ref = self.get(name)
        if ref is None:
            return None
        self._ref_path(name).unlink()
        return ref, self._drop_unused(ref)
