"""Models other tools already downloaded: Podman AI Lab and RamaLama. Found, never copied.

- Podman AI Lab keeps each model in `<extension storage>/redhat.ai-lab/models/<id>/<file>.gguf`
  (`<id>` like `hf.org.name`; a `.tmp` file is a download in progress). Override the folder
  with `APIRCTL_AILAB_DIR`.
- RamaLama's store is `<base>/store/<source>/<path>/<name>/` with `refs/<tag>.json`
  (`{"hash": …, "files": [{"hash", "name", "type"}]}`), `snapshots/<hash>/<name>` and
  `blobs/`. The base is `RAMALAMA_STORE`, else `~/.local/share/ramalama` (and `/var/lib/ramalama`
  for root). Override with `APIRCTL_RAMALAMA_STORE`.

Names: an AI Lab model is `ailab://<id>` (or just `<id>`); a RamaLama model is named as
RamaLama lists it (`ollama://library/tinyllama:latest`), so the same name used with
apirctl finds RamaLama's copy instead of downloading it again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

AILAB_SUBDIR = Path(".local/share/containers/podman-desktop/extensions-storage/redhat.ai-lab/models")


@dataclass(frozen=True)
class Discovered:
    """A GGUF file another tool owns."""

    name: str
    source: str  # "ailab" or "ramalama"
    path: Path
    size: int
    names: tuple[str, ...] = field(default=())  # every name it answers to, `name` first


def ailab_dir() -> Path:
    override = os.environ.get("APIRCTL_AILAB_DIR")
    return Path(override).expanduser() if override else Path.home() / AILAB_SUBDIR


def ramalama_stores() -> list[Path]:
    override = os.environ.get("APIRCTL_RAMALAMA_STORE") or os.environ.get("RAMALAMA_STORE")
    if override:
        return [Path(override).expanduser() / "store"]
    bases = [Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share") / "ramalama"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        bases.append(Path("/var/lib/ramalama"))
    return [base / "store" for base in bases]


def _ailab() -> list[Discovered]:
    root = ailab_dir()
    found: list[Discovered] = []
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return found
    for folder in folders:
        files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
        for path in files:
            if len(files) == 1:
                names: tuple[str, ...] = (f"ailab://{folder.name}", folder.name)
            else:
                names = (f"ailab://{folder.name}/{path.name}",)
            found.append(Discovered(names[0], "ailab", path, path.stat().st_size, names))
    return found


def _ramalama_model(store: Path, model_dir: Path, ref_file: Path) -> Discovered | None:
    try:
        ref = json.loads(ref_file.read_text())
    except (OSError, ValueError):
        return None  # an old-format ref file or a broken one: not ours to judge
    if not isinstance(ref, dict) or not isinstance(ref.get("files"), list):
        return None
    snapshot = str(ref.get("hash", "")).replace(":", "-")
    for entry in ref["files"]:
        if not isinstance(entry, dict) or entry.get("type") != "gguf":
            continue
        name = str(entry.get("name", ""))
        candidates = [model_dir / "snapshots" / snapshot / name,
                      model_dir / "blobs" / str(entry.get("hash", "")).replace(":", "-")]
        for path in candidates:
            if name and path.is_file():
                rel = model_dir.relative_to(store).parts
                source, rest = rel[0], "/".join(rel[1:])
                sep = ":///" if source == "file" else "://"
                label = f"{source}{sep}{rest}:{ref_file.stem}"
                names = [label]
                if source != "ollama" and ref_file.stem == "latest":
                    names.append(f"{source}{sep}{rest}")  # how apirctl spells an untagged hf/URL name
                return Discovered(label, "ramalama", path.resolve(), path.stat().st_size, tuple(names))
    return None


def _ramalama() -> list[Discovered]:
    found: list[Discovered] = []
    for store in ramalama_stores():
        if not store.is_dir():
            continue
        for refs in sorted(store.glob("**/refs")):
            if not refs.is_dir():
                continue
            for ref_file in sorted(refs.glob("*.json")):
                model = _ramalama_model(store, refs.parent, ref_file)
                if model:
                    found.append(model)
    return found


def discover() -> list[Discovered]:
    """Every GGUF that AI Lab and RamaLama hold now (a missing store is simply empty)."""
    return _ailab() + _ramalama()


def find(name: str) -> Discovered | None:
    """The discovered model a name (or a canonical reference) points at."""
    for model in discover():
        if name in model.names:
            return model
    return None
