"""Models Podman AI Lab and RamaLama downloaded: listed, usable by name, never copied or deleted.

The folders are laid out as those tools write them (see apirctl/models/discovery.py and
docs/models.md): AI Lab's `models/<id>/<file>.gguf`; RamaLama's `store/<source>/<path>/<name>/`
with `refs/<tag>.json`, `snapshots/<hash>/<file>` symlinks and `blobs/`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from apirctl import models
from apirctl.errors import ApirctlError
from apirctl.paths import dirs
from tests.support.model_sources import store_files
from tests.support.ports import free_port


def ailab_model(tmp_path: Path, model_id: str, data: bytes, filename: str = "model.Q4_K_M.gguf") -> Path:
    folder = Path(os.environ["APIRCTL_AILAB_DIR"]) / model_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_bytes(data)
    return path


def ramalama_model(source: str, path: str, tag: str, filename: str, data: bytes) -> Path:
    model_dir = Path(os.environ["APIRCTL_RAMALAMA_STORE"]) / "store" / source / path
    digest = "sha256-" + hashlib.sha256(data).hexdigest()
    (model_dir / "blobs").mkdir(parents=True)
    (model_dir / "blobs" / digest).write_bytes(data)
    snapshot = model_dir / "snapshots" / digest
    snapshot.mkdir(parents=True)
    (snapshot / filename).symlink_to(Path("..") / ".." / "blobs" / digest)
    (model_dir / "refs").mkdir()
    ref = {"hash": digest.replace("-", ":", 1), "path": "", "version": "v1.0.1",
           "files": [{"hash": digest.replace("-", ":", 1), "name": filename, "type": "gguf"},
                     {"hash": "sha256:" + "0" * 64, "name": "chat_template", "type": "chat_template"}]}
    (model_dir / "refs" / f"{tag}.json").write_text(json.dumps(ref))
    return model_dir / "blobs" / digest


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registries on a port nobody listens on: a test passes only if nothing is downloaded."""
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("APIRCTL_OLLAMA_REGISTRY", dead)
    monkeypatch.setenv("APIRCTL_HF_ENDPOINT", dead)


def test_ailab_models_are_listed_and_usable(tmp_path: Path, gguf_factory: Callable[..., bytes],
                                            offline: None) -> None:
    path = ailab_model(tmp_path, "hf.org.tiny-GGUF", gguf_factory("ailab"))
    (path.parent / "other.gguf.tmp").write_bytes(b"download in progress")
    rows = [r for r in models.list_models() if r.source == "ailab"]
    assert [(r.name, r.where, r.owned, r.quantization) for r in rows] == [
        ("ailab://hf.org.tiny-GGUF", path, False, "F32")
    ]
    for name in ("hf.org.tiny-GGUF", "ailab://hf.org.tiny-GGUF"):
        model = models.resolve(name)
        assert (model.path, model.source) == (path, "ailab")
    assert store_files() == []  # found, not copied


def test_alias_may_name_a_discovered_model(tmp_path: Path, gguf_factory: Callable[..., bytes],
                                           offline: None) -> None:
    path = ailab_model(tmp_path, "hf.org.team", gguf_factory("team"))
    config = dirs().config_file
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[model_aliases]\nteam = "ailab://hf.org.team"\n')
    model = models.resolve("team")
    assert (model.name, model.path, model.source) == ("team", path, "ailab")


def test_ramalama_model_answers_to_its_ollama_name(gguf_factory: Callable[..., bytes], offline: None) -> None:
    data = gguf_factory("ramalama")
    blob = ramalama_model("ollama", "library/tiny", "latest", "tiny", data)
    for name in ("ollama://tiny", "tiny", "ollama://library/tiny:latest"):
        model = models.resolve(name)
        assert (model.path, model.source) == (blob.resolve(), "ramalama")
    listed = [r for r in models.list_models() if r.source == "ramalama"]
    assert [(r.name, r.size) for r in listed] == [("ollama://library/tiny:latest", len(data))]
    assert store_files() == []


def test_ramalama_hf_model(gguf_factory: Callable[..., bytes], offline: None) -> None:
    blob = ramalama_model("huggingface", "org/repo", "latest", "m.gguf", gguf_factory("rl-hf"))
    assert models.resolve("huggingface://org/repo:latest").path == blob.resolve()


def test_foreign_models_are_never_removed(tmp_path: Path, gguf_factory: Callable[..., bytes],
                                          offline: None) -> None:
    path = ailab_model(tmp_path, "hf.org.keep", gguf_factory("keep"))
    blob = ramalama_model("ollama", "library/keep", "latest", "keep", gguf_factory("keep2"))
    with pytest.raises(ApirctlError, match="belongs to Podman AI Lab"):
        models.remove("hf.org.keep")
    with pytest.raises(ApirctlError, match="belongs to RamaLama"):
        models.remove("ollama://keep")
    local = tmp_path / "mine.gguf"
    local.write_bytes(gguf_factory("mine"))
    with pytest.raises(ApirctlError, match="local file"):
        models.remove(str(local))
    assert path.exists() and blob.exists() and local.exists()


def test_broken_foreign_refs_are_skipped(gguf_factory: Callable[..., bytes], offline: None) -> None:
    ramalama_model("ollama", "library/good", "latest", "good", gguf_factory("good"))
    bad = Path(os.environ["APIRCTL_RAMALAMA_STORE"]) / "store" / "ollama" / "library" / "bad" / "refs"
    bad.mkdir(parents=True)
    (bad / "latest.json").write_text("{not json")
    (bad / "old.json").write_text(json.dumps({"hash": "x", "files": [{"name": "gone", "type": "gguf"}]}))
    names = [r.name for r in models.list_models()]
    assert names == ["ollama://library/good:latest"]
