"""The records of host processes apirctl started (RPC backends, apir-hosts): one JSON file each in a
state folder, so any later apirctl command can find, check and stop them.

A record is written whole (through a temporary file and a rename), so a reader never sees half of
one; a file that cannot be read or validated is no record, never an error: `clean` removes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError

from apirctl.paths import ensure

Record = TypeVar("Record", bound=BaseModel)


class RecordStore(Generic[Record]):
    """Records of one kind, keyed by an alphanumeric id. The folder is asked for on each use: it
    follows APIRCTL_HOME as it is when called."""

    def __init__(self, model: type[Record], folder: Callable[[], Path]) -> None:
        self._model = model
        self._folder = folder

    @property
    def folder(self) -> Path:
        return self._folder()

    def path(self, record_id: str, suffix: str = ".json") -> Path:
        """The record's file (or a file kept beside it, by `suffix`)."""
        return self.folder / f"{record_id}{suffix}"

    def write(self, record_id: str, record: Record) -> None:
        path = self.path(record_id)
        ensure(path.parent)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json(indent=2))
        tmp.replace(path)

    def get(self, record_id: str) -> Record | None:
        """The record, or None for an unknown id, one that is not alphanumeric (never a path), or a
        damaged file."""
        if not record_id or not record_id.isalnum():
            return None
        try:
            return self._model.model_validate_json(self.path(record_id).read_text())
        except (OSError, ValidationError):
            return None

    def all(self) -> list[Record]:
        """Every readable record, in the order of their ids."""
        folder = self.folder
        if not folder.exists():
            return []
        return [r for r in (self.get(p.stem) for p in sorted(folder.glob("*.json"))) if r is not None]

    def remove(self, record_id: str) -> None:
        self.path(record_id).unlink(missing_ok=True)
