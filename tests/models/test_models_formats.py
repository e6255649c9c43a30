"""Models as users of Ollama, RamaLama and Hugging Face's tools already have them, run as a user types it.

Ollama's own store (made here the way Ollama lays it out: manifests, blobs, a projector and
params), `ollama://` pulls that keep the projector and params, split GGUFs made with the build's
`llama-gguf-split`, model kinds read from the GGUF header, and Hugging Face's stored login and cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from apirctl import models
from tests.support.model_sources import Registry, ollama_store, store_files, write_bert_gguf, write_gguf

PARAMS = {"temperature": 0.2, "stop": ["<|end|>"], "num_ctx": 4096}


def apirctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "250", **(env or {})}, timeout=120, check=False)


def ok_json(*args: str, env: dict[str, str] | None = None) -> object:
    done = apirctl(*args, "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_ollama_store_is_listed_and_used_in_place(tmp_path: Path, gguf_factory: Callable[..., bytes]) -> None:
    root = Path(os.environ["OLLAMA_MODELS"])
    vision = ollama_store(root, "registry.ollama.ai", "library", "tiny", "1b", {
        "model": gguf_factory("ollama-model"), "projector": gguf_factory("ollama-proj", 16),
        "params": json.dumps(PARAMS).encode(), "template": b"{{ .Prompt }}", "license": b"MIT"})
    hf_made = ollama_store(root, "hf.co", "org", "repo-GGUF", "Q4_K_M", {"model": gguf_factory("ollama-hf")})
    (root / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir(parents=True)
    (root / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest").write_text("{not json")

    listed = {row["name"]: row for row in ok_json("list")}  # type: ignore[union-attr]
    assert set(listed) == {"ollama://library/tiny:1b", "hf.co/org/repo-GGUF:Q4_K_M"}
    assert listed["ollama://library/tiny:1b"]["source"] == "ollama-local"
    assert listed["ollama://library/tiny:1b"]["owned"] is False
    assert "tiny:1b" in listed["ollama://library/tiny:1b"]["aliases"]

    for name in ("tiny:1b", "ollama://tiny:1b", "ollama://library/tiny:1b"):
        model = ok_json("inspect", name)["model"]  # type: ignore[index]
        assert model["path"] == str(vision["model"]) and model["source"] == "ollama-local"
        assert model["mmproj"]["path"] == str(vision["projector"])
        assert model["params"] == PARAMS
    assert ok_json("inspect", "hf.co/org/repo-GGUF:Q4_K_M")["model"]["path"] == str(hf_made["model"])  # type: ignore[index]
    assert store_files() == []  # found, not copied

    refused = apirctl("rm", "tiny:1b")
    assert refused.returncode == 1 and "belongs to Ollama" in refused.stderr and "ollama rm" in refused.stderr
    assert vision["model"].exists()


def test_ollama_default_folder_is_under_home(tmp_path: Path, gguf_factory: Callable[..., bytes]) -> None:
    home = tmp_path / "user"
    blob = ollama_store(home / ".ollama" / "models", "registry.ollama.ai", "library", "homed", "latest",
                        {"model": gguf_factory("homed")})["model"]
    env = {k: v for k, v in os.environ.items() if k != "OLLAMA_MODELS"}
    done = subprocess.run([sys.executable, "-m", "apirctl", "inspect", "homed", "--json"], capture_output=True,
                          text=True, env={**env, "HOME": str(home)}, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"]["path"] == str(blob)


def test_ollama_pull_keeps_projector_and_params(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    model, projector = gguf_factory("pulled-vision"), gguf_factory("pulled-proj", 16)
    registry.add_ollama("vision", "2b", model, projector=projector, params=json.dumps(PARAMS).encode())
    pulled = ok_json("pull", "ollama://vision:2b")
    assert Path(pulled["path"]).read_bytes() == model  # type: ignore[index]
    assert Path(pulled["mmproj"]["path"]).read_bytes() == projector  # type: ignore[index]
    assert pulled["mmproj"]["filename"].endswith(".gguf")  # type: ignore[index]
    assert pulled["params"] == PARAMS  # type: ignore[index]
    assert len([f for f in store_files() if f.startswith("blobs/")]) == 2
    # Known now: no second download, and removing the name frees both files.
    before = len(registry.gets("/cdn/"))
    assert ok_json("pull", "vision:2b")["mmproj"] == pulled["mmproj"]  # type: ignore[index]
    assert len(registry.gets("/cdn/")) == before
    assert ok_json("rm", "vision:2b") == {"name": "ollama://library/vision:2b", "file_deleted": True}
    assert [f for f in store_files() if f.startswith("blobs/")] == []


def test_projector_with_a_wrong_digest_records_nothing(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    projector = gguf_factory("bad-proj", 16)
    registry.add_ollama("broken", "1", gguf_factory("broken-model"), projector=projector)
    registry.corrupt.add(hashlib.sha256(projector).hexdigest())
    done = apirctl("pull", "ollama://broken:1")
    assert done.returncode == 1 and "digest mismatch" in done.stderr and "Traceback" not in done.stderr
    assert not [f for f in store_files() if f.startswith("refs/")]


@pytest.mark.parametrize(("writer", "kind"), [
    (lambda p: write_gguf(p), "chat"),
    (lambda p: write_bert_gguf(p), "embedding"),
    (lambda p: write_bert_gguf(p, reranking=True), "reranking"),
])
def test_kind_comes_from_the_header(tmp_path: Path, writer: Callable[[Path], Path], kind: str) -> None:
    path = writer(tmp_path / "m.gguf")
    assert models.inspect(path).kind == kind
    shown = apirctl("inspect", str(path))
    assert shown.returncode == 0 and kind in shown.stdout


def hf_cached(root: Path, repo: str, filename: str, data: bytes) -> Path:
    """A file as `hf download` leaves it: a blob, a snapshot symlink, refs/main."""
    repo_dir = root / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "c" * 40
    blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    link = repo_dir / "snapshots" / commit / filename
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return link


def test_hf_token_from_the_stored_login(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    registry.add_hf("org/gated", "gated-F32.gguf", gguf_factory("gated"))
    hf_home = Path(os.environ["HF_HOME"])
    hf_home.mkdir(parents=True)
    (hf_home / "token").write_text("hf_stored_login_token\n")  # what `hf auth login` writes
    ok_json("pull", "hf://org/gated/gated-F32.gguf")
    asked = [h.get("authorization") for m, p, h in registry.requests if p.startswith("/org/gated/resolve")]
    assert asked and set(asked) == {"Bearer hf_stored_login_token"}
    # HF_TOKEN, when set, wins over the stored login.
    registry.add_hf("org/gated", "other-F32.gguf", gguf_factory("gated-2"))
    ok_json("pull", "hf://org/gated/other-F32.gguf", env={"HF_TOKEN": "hf_from_env"})
    asked = [h.get("authorization") for m, p, h in registry.requests if p.startswith("/org/gated/resolve/main/other")]
    assert asked and set(asked) == {"Bearer hf_from_env"}


def test_hf_cache_is_used_in_place_and_offline(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("hf-cached")
    link = hf_cached(Path(os.environ["HF_HOME"]), "org/cached-GGUF", "cached.Q4_K_M.gguf", data)
    for ref in ("hf://org/cached-GGUF/cached.Q4_K_M.gguf", "hf.co/org/cached-GGUF:Q4_K_M"):
        model = ok_json("pull", ref, env={"HF_HUB_OFFLINE": "1"})
        assert (model["path"], model["source"]) == (str(link), "hf-cache")  # type: ignore[index]
    assert registry.requests == [] and store_files() == []
    missing = apirctl("pull", "hf://org/cached-GGUF/other.Q8_0.gguf", env={"HF_HUB_OFFLINE": "1"})
    assert missing.returncode == 1 and "HF_HUB_OFFLINE" in missing.stderr and "Traceback" not in missing.stderr
    assert registry.requests == []


@pytest.fixture(scope="module")
def split_parts(llama_build, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:  # type: ignore[no-untyped-def]
    """A model split into three files by the build's own llama-gguf-split."""
    folder = tmp_path_factory.mktemp("split")
    whole = write_gguf(folder / "whole.gguf", name="split-me", payload_kb=64)
    # Two tensors, one per file, and a first file of metadata only: three parts.
    done = subprocess.run([str(llama_build.binary("llama-gguf-split")), "--split", "--split-max-tensors", "1",
                           "--no-tensor-first-split", str(whole), str(folder / "big-Q4_K_M")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted(folder.glob("big-Q4_K_M-*-of-*.gguf"))
    assert [p.name for p in parts] == [f"big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return parts


def merged_tensors(llama_build, files: list[dict[str, str]], where: Path) -> int:  # type: ignore[no-untyped-def]
    """Put the files side by side under their names, merge them with llama-gguf-split, count the tensors."""
    where.mkdir()
    for entry in files:
        (where / entry["filename"]).symlink_to(entry["path"])
    out = where / "merged.gguf"
    done = subprocess.run([str(llama_build.binary("llama-gguf-split")), "--merge",
                           str(where / files[0]["filename"]), str(out)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return models.inspect(out).tensor_count


@pytest.mark.integration
def test_split_gguf_pulled_and_kept_whole(registry: Registry, split_parts: list[Path], llama_build,  # type: ignore[no-untyped-def]
                                          tmp_path: Path) -> None:
    for part in split_parts:
        registry.add_hf("org/big-GGUF", part.name, part.read_bytes())
    registry.add_hf("org/big-GGUF", "mmproj-big-f16.gguf", write_gguf(tmp_path / "p.gguf", name="proj",
                                                                       payload_kb=8).read_bytes())
    model = ok_json("pull", "hf.co/org/big-GGUF:Q4_K_M")
    files = [{"path": model["path"], "filename": model["filename"]}, *model["parts"]]  # type: ignore[index]
    assert [f["filename"] for f in files] == [p.name for p in split_parts]
    assert [Path(f["path"]).read_bytes() for f in files] == [p.read_bytes() for p in split_parts]
    assert model["mmproj"]["filename"] == "mmproj-big-f16.gguf"  # type: ignore[index]
    assert model["size"] == sum(p.stat().st_size for p in split_parts)  # type: ignore[index]
    assert merged_tensors(llama_build, files, tmp_path / "merge") == 2

    # Naming any part by its file fetches the same set; the local first part finds its siblings.
    again = ok_json("pull", f"hf://org/big-GGUF/{split_parts[2].name}")
    assert [p["filename"] for p in again["parts"]] == [p.name for p in split_parts[1:]]  # type: ignore[index]
    local = ok_json("inspect", str(split_parts[0]))
    assert local["gguf"]["split_count"] == 3  # type: ignore[index]
    assert [Path(p["path"]) for p in local["model"]["parts"]] == split_parts[1:]  # type: ignore[index]
    wrong = apirctl("inspect", str(split_parts[1]))
    assert wrong.returncode == 1 and "not the first part" in wrong.stderr and split_parts[0].name in wrong.stderr


def test_top_level_commands_are_the_models_ones(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    from apirctl import __version__

    registry.add_ollama("top", "1", gguf_factory("top-level"))
    pulled = ok_json("pull", "top:1")
    assert ok_json("ls") == ok_json("list") == ok_json("models", "list")
    assert [row["name"] for row in ok_json("ls")] == ["ollama://library/top:1"]  # type: ignore[union-attr]
    assert ok_json("inspect", "top:1")["model"] == ok_json("models", "inspect", "top:1")["model"] == pulled  # type: ignore[index]
    assert ok_json("rm", "top:1")["file_deleted"] is True  # type: ignore[index]
    version = apirctl("version")
    assert (version.returncode, version.stdout) == (0, f"apirctl {__version__}\n")


def test_header_scan_of_garbage_gives_defaults_at_once(tmp_path: Path) -> None:
    """serve reads the kind with a quick scan: garbage after the magic (huge lengths and counts) must
    neither allocate nor loop; llama-server then gives the real error."""
    import random

    from apirctl.models.ggufinfo import _scan_header

    rng = random.Random(5)
    path = tmp_path / "garbage.gguf"
    for _ in range(200):
        path.write_bytes(b"GGUF" + rng.randbytes(rng.randrange(0, 2048)))
        assert _scan_header(path).kind == "chat"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\xff" * 8)  # 2^64-1 keys
    assert _scan_header(path).architecture is None
    bert = write_bert_gguf(tmp_path / "b.gguf")
    assert (_scan_header(bert).kind, models.header(bert).kind) == ("embedding", "embedding")
