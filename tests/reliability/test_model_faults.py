"""Bad models: `serve` refuses each with one line (and a hint) before any container exists; `models
inspect` says the same; paths with spaces and other scripts work. The demo model is the real one."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.sweep import NOBODY, as_user, sweep

pytestmark = pytest.mark.integration


NAME = "rel-never"


@pytest.fixture
def no_new_containers(podman: str) -> Iterator[None]:
    """No container of the refused serve exists afterwards (other suites may run beside this one, so
    the check is by the name the serve asked for)."""
    from apirctl.podman import engine

    yield
    assert not engine.client().containers.exists(NAME), "a container was left behind"


def _truncated(demo_model: Path, tmp_path: Path, size: int) -> Path:
    path = tmp_path / "cut.gguf"
    with demo_model.open("rb") as src:
        path.write_bytes(src.read(size))
    return path


def serve_refuses(model: str, says: str) -> None:
    out = sweep("serve", model, "--transport", "none", "--port", str(free_port()), "--name", NAME)
    out.fails_cleanly(code=1, says=says)


def test_truncated_model_is_refused_before_any_container(demo_model: Path, tmp_path: Path,
                                                          no_new_containers: None) -> None:
    path = _truncated(demo_model, tmp_path, 5_000_000)
    serve_refuses(str(path), "truncated: its tensors need more than 98 MB, the file has 5 MB")


def test_model_cut_inside_its_header(demo_model: Path, tmp_path: Path, no_new_containers: None) -> None:
    serve_refuses(str(_truncated(demo_model, tmp_path, 200)), "its header is cut off")


@pytest.mark.parametrize(("content", "says"), [
    (b"", "not a GGUF file"),
    (b"PK\x03\x04 a zip, not a model", "not a GGUF file"),
    (b"GGUF" + b"\xff" * 20, "corrupt GGUF file"),
    (b"GGUF\x09\x00\x00\x00" + b"\x00" * 40, "unsupported GGUF version"),
], ids=["empty", "zip", "garbage-header", "future-version"])
def test_not_a_model(tmp_path: Path, content: bytes, says: str, no_new_containers: None) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    serve_refuses(str(path), says)


def test_a_directory(tmp_path: Path, no_new_containers: None) -> None:
    (tmp_path / "dir.gguf").mkdir()
    serve_refuses(str(tmp_path / "dir.gguf"), "is a directory")


def test_a_missing_file(tmp_path: Path, no_new_containers: None) -> None:
    serve_refuses(str(tmp_path / "nowhere.gguf"), "no such file")


def test_an_unreadable_file(demo_model: Path, elsewhere: Path, no_new_containers: None) -> None:
    """As a user who may not read it (root reads any file): a copy of the demo model, mode 0600 and
    root's; serve and `models inspect` refuse it in one line before any container."""
    env = as_user(elsewhere)
    path = elsewhere / "locked.gguf"
    shutil.copy(demo_model, path)
    path.chmod(0o600)
    for out in (sweep("serve", str(path), "--transport", "none", "--port", str(free_port()), "--name", NAME, env=env,
                      user=NOBODY),
                sweep("models", "inspect", str(path), env=env, user=NOBODY)):
        out.fails_cleanly(code=1, says=f"cannot read {path}: Permission denied")
        assert out.error_lines[-1].startswith("hint: check its permissions"), out.stderr
    assert sweep("models", "inspect", str(path), "--json").succeeds()  # its owner still reads it


@pytest.mark.parametrize("ref", ["no-such-model-anywhere", "hf://", "ollama://", "hf://owner",
                                 "https://", "pypi://", "::::", "hf://a/b/c/d/e/f.gguf:xx:yy"])
def test_unknown_or_malformed_references(ref: str) -> None:
    out = sweep("models", "inspect", ref, timeout=60)
    out.fails_cleanly()


@pytest.mark.parametrize("folder", ["with space", "ünïcødé 模型", "emoji 😀"])
def test_paths_with_spaces_and_other_scripts(demo_model: Path, tmp_path: Path, folder: str) -> None:
    path = tmp_path / folder / "my model.gguf"
    path.parent.mkdir()
    os.symlink(demo_model, path)
    out = sweep("models", "inspect", str(path), "--json").succeeds()
    assert "llama" in out.stdout
