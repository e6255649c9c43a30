"""Each bad input gets one line naming the model and the cause, and leaves the store as it was."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from apirctl import models
from apirctl.errors import ApirctlError
from apirctl.paths import dirs
from tests.support.model_sources import Registry, store_files
from tests.support.ports import free_port


@pytest.fixture
def previous(registry: Registry, gguf_factory: Callable[..., bytes]) -> list[str]:
    """A store that already holds one model: failures must leave exactly this."""
    registry.add_hf("org/kept", "kept.gguf", gguf_factory("kept"))
    models.resolve("hf://org/kept/kept.gguf")
    return store_files()


def fails(ref: str, match: str) -> ApirctlError:
    with pytest.raises(ApirctlError, match=match) as info:
        models.resolve(ref)
    assert "\n" not in info.value.message
    return info.value


def test_not_gguf_by_url(registry: Registry, previous: list[str]) -> None:
    url = registry.add_file("notes.gguf", b"this is not a model at all\n" * 100)
    err = fails(url, "not a GGUF file")
    assert url in err.message
    assert store_files() == previous


def test_not_gguf_local_file(tmp_path: Path, previous: list[str]) -> None:
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file")
    err = fails(str(path), "not a GGUF file")
    assert str(path) in err.message
    assert store_files() == previous


def test_missing_local_file(tmp_path: Path, previous: list[str]) -> None:
    fails(str(tmp_path / "absent.gguf"), "no such file")
    assert store_files() == previous


def test_truncated_gguf(registry: Registry, gguf_factory: Callable[..., bytes], previous: list[str]) -> None:
    data = gguf_factory("truncated")
    url = registry.add_file("half.gguf", data[: len(data) // 2])
    err = fails(url, "truncated")
    assert "half.gguf" in err.message
    assert store_files() == previous


def test_truncated_gguf_inspect(tmp_path: Path, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("truncated-local")
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-1000])
    with pytest.raises(ApirctlError, match="truncated"):
        models.inspect(path)


def test_digest_mismatch(registry: Registry, gguf_factory: Callable[..., bytes], previous: list[str]) -> None:
    digest = registry.add_ollama("liar", "latest", gguf_factory("liar"))
    registry.corrupt.add(digest)
    err = fails("ollama://liar", "digest mismatch")
    assert "ollama://library/liar:latest" in err.message and digest in err.message
    assert store_files() == previous  # the bad bytes were discarded, not kept for a resume


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ("ollama://ghost", "no such model or tag"),
        ("hf://org/kept/ghost.gguf", "not found \\(HTTP 404"),
        ("hf.co/org/ghost-repo:Q4_K_M", "not found \\(HTTP 404"),
    ],
)
def test_not_found(registry: Registry, previous: list[str], ref: str, match: str) -> None:
    fails(ref, match)
    assert store_files() == previous


def test_not_found_plain_url(registry: Registry, previous: list[str]) -> None:
    fails(f"{registry.url}/files/ghost.gguf", "HTTP 404")
    assert store_files() == previous


def test_network_failure_mid_download(registry: Registry, gguf_factory: Callable[..., bytes],
                                      previous: list[str]) -> None:
    digest = registry.add_hf("org/flaky", "flaky.gguf", gguf_factory("flaky", payload_kb=512))
    registry.cut_after[digest] = 65_536
    err = fails("hf://org/flaky/flaky.gguf", "network failure")
    assert "hf://org/flaky/flaky.gguf" in err.message
    # only a resumable partial file was added; no final name
    added = sorted(set(store_files()) - set(previous))
    assert added and all(f.startswith("partial/") for f in added)
    assert set(previous) <= set(store_files())


def test_unreachable_registry(monkeypatch: pytest.MonkeyPatch, previous: list[str]) -> None:
    dead = free_port()
    monkeypatch.setenv("APIRCTL_OLLAMA_REGISTRY", f"http://127.0.0.1:{dead}")
    fails("ollama://anything", "network failure")
    assert store_files() == previous


@pytest.fixture
def tiny_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real 256 KiB tmpfs as the data directory, so a download really fills the disk."""
    mount = tmp_path / "tiny-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    monkeypatch.setenv("APIRCTL_HOME", str(mount))
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_disk_full(registry: Registry, gguf_factory: Callable[..., bytes], tiny_disk: Path) -> None:
    small = registry.add_hf("org/small", "small.gguf", gguf_factory("small", payload_kb=16))
    models.resolve("hf://org/small/small.gguf")
    before = store_files()
    assert f"blobs/sha256-{small}.gguf" in before
    registry.add_hf("org/big", "big.gguf", gguf_factory("big", payload_kb=1024))
    err = fails("hf://org/big/big.gguf", "disk full")
    assert "hf://org/big/big.gguf" in err.message
    assert store_files() == before  # the half file was removed, the space given back
    assert dirs().models.is_relative_to(tiny_disk)
