"""Models other tools already downloaded: Podman AI Lab, RamaLama and Ollama. Found, never copied.

- Podman AI Lab keeps each model in `<extension storage>/redhat.ai-lab/models/<id>/<file>.gguf`
  (`<id>` like `hf.org.name`; a `.tmp` file is a download in progress). Override the folder
  with `APIRCTL_AILAB_DIR`.
- RamaLama's store is `<base>/store/<source>/<path>/<name>/` with `refs/<tag>.json`
  (`{"hash": …, "files": [{"hash", "name", "type"}]}`), `snapshots/<hash>/<name>` and
  `blobs/`. The base is `RAMALAMA_STORE`, else `~/.local/share/ramalama` (and `/var/lib/ramalama`
  for root). Override with `APIRCTL_RAMALAMA_STORE`.
- Ollama's store is `OLLAMA_MODELS`, else `~/.ollama/models`: `manifests/<host>/<namespace>/<name>/<tag>`
  (a v2 manifest) and `blobs/sha256-<hex>`. The model layer is the GGUF; a projector layer is the
  vision model's `--mmproj`; the params layer holds default sampling settings.

Names: an AI Lab model is `ailab://<id>` (or just `<id>`); a RamaLama model is named as
RamaLama lists it (`ollama://library/tinyllama:latest`), so the same name used with
apirctl finds RamaLama's copy instead of downloading it again. An Ollama model answers to
`ollama://library/llama3.2:1b` and to the names Ollama prints (`llama3.2:1b`, `hf.co/org/repo:Q4_K_M`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apirctl.errors import ApirctlError
from apirctl.models import ollama

AILAB_SUBDIR = Path(".local/share/containers/podman-desktop/extensions-storage/redhat.ai-lab/models")


@dataclass(frozen=True)
class Discovered:
    """A GGUF file another tool owns."""

    name: str
    source: str  # "ailab", "ramalama" or "ollama-local"
    path: Path
    size: int
    names: tuple[str, ...] = field(default=())  # every name it answers to, `name` first
    mmproj: Path | None = None
    params: dict[str, Any] = field(default_factory=dict)
    parts: tuple[Path, ...] = field(default=())  # parts 2..N of a split GGUF, beside `path`


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


def ollama_dir() -> Path:
    override = os.environ.get("OLLAMA_MODELS")
    return Path(override).expanduser() if override else Path.home() / ".ollama" / "models"


def _ollama_names(host: str, namespace: str, name: str, tag: str) -> tuple[str, ...]:
    """The canonical reference first, then what `ollama list` prints."""
    if host == "registry.ollama.ai":
        short = f"{name}:{tag}" if namespace == "library" else f"{namespace}/{name}:{tag}"
        return (f"ollama://{namespace}/{name}:{tag}", short)
    if host in ("hf.co", "huggingface.co"):
        label = f"hf.co/{namespace}/{name}" + ("" if tag == "latest" else f":{tag}")
        canonical = f"hf://{namespace}/{name}" + ("" if tag == "latest" else f":{tag}")
        return (label, canonical, f"{label}:{tag}") if tag == "latest" else (label, canonical)
    return (f"{host}/{namespace}/{name}:{tag}",)


def _ollama_model(root: Path, manifest_file: Path) -> Discovered | None:
    parts = manifest_file.relative_to(root / "manifests").parts
    if len(parts) != 4:
        return None
    try:
        found = ollama.parse_manifest(json.loads(manifest_file.read_text()), str(manifest_file))
    except (OSError, ValueError, ApirctlError):
        return None  # a manifest Ollama is writing, or one of another kind: not a model to offer

    def blob(hexdigest: str) -> Path:
        return root / "blobs" / f"sha256-{hexdigest}"

    model = blob(found.model.hexdigest)
    if not model.is_file():
        return None
    mmproj = blob(found.projector.hexdigest) if found.projector else None
    params: dict[str, Any] = {}
    if found.params:
        with contextlib.suppress(OSError):
            params = ollama.parse_params(blob(found.params.hexdigest).read_bytes()[:ollama.PARAMS_LIMIT])
    names = _ollama_names(*parts)
    return Discovered(names[0], "ollama-local", model, model.stat().st_size, names,
                      mmproj=mmproj if mmproj and mmproj.is_file() else None, params=params)


def _ollama() -> list[Discovered]:
    root = ollama_dir()
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    found = (_ollama_model(root, path) for path in sorted(manifests.glob("*/*/*/*")) if path.is_file())
    return [model for model in found if model]


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
    """Every GGUF that AI Lab, RamaLama and Ollama hold now (a missing store is simply empty)."""
    return _ailab() + _ramalama() + _ollama()


def find(name: str) -> Discovered | None:
    """The discovered model a name (or a canonical reference) points at."""
    for model in discover():
        if name in model.names:
            return model
    return None
