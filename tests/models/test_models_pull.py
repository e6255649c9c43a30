"""Pulling from Hugging Face, Ollama and plain URLs against the local registry: store, dedup, resume."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from apirctl import models
from apirctl.cli.output import download_bars
from apirctl.errors import ApirctlError
from apirctl.paths import dirs
from tests.support.model_sources import Registry, store_files


def test_hf_file_pull_is_stored_by_digest(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("hf-one")
    digest = registry.add_hf("org/repo", "model-Q4_K_M.gguf", data)
    model = models.resolve("hf://org/repo/model-Q4_K_M.gguf")
    assert model.path == dirs().models / "blobs" / f"sha256-{digest}.gguf"
    assert model.path.read_bytes() == data
    assert (model.source, model.digest, model.size) == ("hf", f"sha256:{digest}", len(data))
    assert model.filename == "model-Q4_K_M.gguf"
    # the download followed the resolve redirect to the CDN
    assert registry.gets(f"/cdn/{digest}")


def test_second_resolve_uses_the_store_without_network(registry: Registry,
                                                         gguf_factory: Callable[..., bytes]) -> None:
    registry.add_hf("org/repo", "m.gguf", gguf_factory("again"))
    first = models.resolve("hf://org/repo/m.gguf")
    before = len(registry.requests)
    second = models.resolve("huggingface://org/repo/m.gguf")
    assert second.path == first.path
    assert len(registry.requests) == before


def test_resolve_without_pull_refuses_to_download(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    registry.add_hf("org/repo", "m.gguf", gguf_factory())
    with pytest.raises(ApirctlError, match="not downloaded") as info:
        models.resolve("hf://org/repo/m.gguf", pull=False)
    assert info.value.hint and "models pull" in info.value.hint
    assert registry.requests == []


def test_hf_renamed_repository_redirect_keeps_the_digest(registry: Registry,
                                                         gguf_factory: Callable[..., bytes]) -> None:
    digest = registry.add_hf("new-org/repo", "m.gguf", gguf_factory("renamed"))
    registry.renamed["old-org/repo"] = "new-org/repo"
    model = models.resolve("hf://old-org/repo/m.gguf")
    assert model.digest == f"sha256:{digest}"
    assert model.name == "hf://old-org/repo/m.gguf"


def test_hf_quant_tag_picks_the_matching_file(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    q4 = registry.add_hf("org/repo-GGUF", "repo-Q4_K_M.gguf", gguf_factory("q4"))
    q8 = registry.add_hf("org/repo-GGUF", "repo-Q8_0.gguf", gguf_factory("q8"))
    registry.hf_plain[("org/repo-GGUF", "main", "README.md")] = b"# readme"
    assert models.resolve("hf.co/org/repo-GGUF:Q8_0").digest == f"sha256:{q8}"
    assert models.resolve("hf.co/org/repo-GGUF:q4_k_m").digest == f"sha256:{q4}"
    # no tag: the usual default, Q4_K_M
    assert models.resolve("huggingface.co/org/repo-GGUF").digest == f"sha256:{q4}"


def test_hf_quant_tag_without_match_names_the_files(registry: Registry,
                                                      gguf_factory: Callable[..., bytes]) -> None:
    registry.add_hf("org/repo", "repo-Q4_K_M.gguf", gguf_factory())
    with pytest.raises(ApirctlError, match="no file matches 'Q2_K'") as info:
        models.resolve("hf.co/org/repo:Q2_K")
    assert info.value.hint and "repo-Q4_K_M.gguf" in info.value.hint
    assert store_files() == []


def test_ollama_pull_follows_manifest_to_model_layer(registry: Registry,
                                                      gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("ollama")
    digest = registry.add_ollama("tiny", "1b", data)
    model = models.resolve("ollama://tiny:1b")
    assert model.path.read_bytes() == data
    assert (model.source, model.name, model.filename) == ("ollama", "ollama://library/tiny:1b", "tiny-1b.gguf")
    manifest_gets = registry.gets("/v2/library/tiny/manifests/1b")
    assert manifest_gets and "manifest.v2+json" in manifest_gets[0][1]["accept"]
    assert registry.gets(f"/v2/library/tiny/blobs/sha256:{digest}")


def test_bare_short_name_goes_to_ollama(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    registry.add_ollama("tiny", "latest", gguf_factory("short"))
    model = models.resolve("tiny")
    assert model.source == "ollama"
    assert model.name == "ollama://library/tiny:latest"


def test_plain_url_pull(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("url")
    url = registry.add_file("x.gguf", data)
    model = models.resolve(url)
    assert model.path.read_bytes() == data
    assert model.digest == "sha256:" + hashlib.sha256(data).hexdigest()


def test_two_names_of_one_file_share_one_blob(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("shared")
    digest = registry.add_hf("org/repo", "shared.gguf", data)
    registry.add_ollama("shared", "latest", data)
    a = models.resolve("hf://org/repo/shared.gguf")
    b = models.resolve("ollama://shared")
    assert a.path == b.path
    assert store_files().count(f"blobs/sha256-{digest}.gguf") == 1
    assert len([f for f in store_files() if f.startswith("blobs/")]) == 1
    # the second name knew the digest up front (manifest) and did not download again
    assert len(registry.gets(f"/cdn/{digest}")) == 1
    names = {m.name for m in models.list_models()}
    assert {"hf://org/repo/shared.gguf", "ollama://library/shared:latest"} <= names

    # removing one name keeps the file for the other; removing the last frees it
    assert models.remove("hf://org/repo/shared.gguf") == ("hf://org/repo/shared.gguf", False)
    assert a.path.exists()
    assert models.remove("shared") == ("ollama://library/shared:latest", True)
    assert not a.path.exists()


def test_resume_after_interrupted_download(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("resume", payload_kb=512)
    digest = registry.add_hf("org/repo", "big.gguf", data)
    cut = 200_000
    registry.cut_after[digest] = cut
    with pytest.raises(ApirctlError, match="network failure") as info:
        models.resolve("hf://org/repo/big.gguf")
    assert "model hf://org/repo/big.gguf" in info.value.message
    assert info.value.hint and "resume" in info.value.hint
    # nothing under a final name; the bytes so far wait in partial/
    files = store_files()
    assert [f for f in files if not f.startswith("partial/")] == []
    partials = list((dirs().models / "partial").glob("*.part"))
    assert len(partials) == 1 and partials[0].stat().st_size == cut

    model = models.resolve("hf://org/repo/big.gguf")
    assert model.path.read_bytes() == data
    ranged = [h.get("range") for _, h in registry.gets(f"/cdn/{digest}")]
    assert ranged == [None, f"bytes={cut}-"]
    assert not any(f.startswith("partial/") for f in store_files())


def test_resume_when_the_server_ignores_ranges(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("norange", payload_kb=512)
    digest = registry.add_ollama("norange", "latest", data)
    registry.cut_after[digest] = 100_000
    with pytest.raises(ApirctlError, match="network failure"):
        models.resolve("ollama://norange")
    registry.ignore_range = True
    model = models.resolve("ollama://norange")
    assert model.path.read_bytes() == data  # started over instead of appending a second copy


def test_resume_of_a_changed_url_starts_over(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    old, new = gguf_factory("v1", payload_kb=512), gguf_factory("v2", payload_kb=512)
    url = registry.add_file("moving.gguf", old)
    registry.cut_after["moving.gguf"] = 150_000
    with pytest.raises(ApirctlError, match="network failure"):
        models.resolve(url)
    registry.files["moving.gguf"] = new  # the file changed on the server before the resume
    model = models.resolve(url)
    assert model.path.read_bytes() == new  # not the first 150 kB of v1 spliced onto v2
    resume = registry.gets("/files/moving.gguf")[-1][1]
    assert resume["range"] == "bytes=150000-" and resume["if-range"].startswith('"')
    assert not any(f.startswith("partial/") for f in store_files())


def test_concurrent_pull_of_one_file_is_refused(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    import fcntl

    from apirctl.models.store import Store

    digest = registry.add_ollama("busy", "latest", gguf_factory("busy"))
    partial = Store().partial_path(digest)
    partial.parent.mkdir(parents=True)
    with partial.open("ab") as other:  # another process's download in progress
        other.write(b"GGUF")
        other.flush()
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ApirctlError, match="another apirctl is downloading"):
            models.resolve("ollama://busy")
        assert partial.read_bytes() == b"GGUF"  # the other download's bytes are untouched
    assert models.resolve("ollama://busy").digest == f"sha256:{digest}"


def test_progress_reaches_the_callback_and_the_cli_draws_it(registry: Registry, gguf_factory: Callable[..., bytes],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    data = gguf_factory("progress")
    registry.add_hf("org/repo", "p.gguf", data)
    seen: list[tuple[str, int, int | None]] = []
    models.resolve("hf://org/repo/p.gguf", progress=lambda label, done, total: seen.append((label, done, total)))
    assert {label for label, _, _ in seen} == {"model hf://org/repo/p.gguf"}
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen) and seen[-1][1] == len(data)
    assert capsys.readouterr().err == ""  # the library draws nothing itself
    models.remove("hf://org/repo/p.gguf")
    with download_bars() as bars:
        models.resolve("hf://org/repo/p.gguf", progress=bars)
    err = capsys.readouterr().err
    assert "model hf://org/repo/p.gguf" in err
    assert "kB" in err or "KB" in err
