"""GGUF inspection: header facts, the quantization fallback, and a cache that notices changes."""

from __future__ import annotations

import os
from pathlib import Path

from apirctl import models
from apirctl.models.ggufinfo import params_label
from tests.support.model_sources import write_gguf


def test_header_facts(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", name="facts", payload_kb=64, chat_template=False)
    info = models.inspect(path)
    assert (info.name, info.architecture, info.quantization) == ("facts", "llama", "F32")
    assert (info.context_length, info.vocab_size, info.block_count) == (512, 32, 1)
    assert info.chat_template is False
    assert info.tensor_count == 2
    assert info.parameters == 32 * 16 + (64 * 1024 // 64) * 16
    assert info.size == path.stat().st_size


def test_quantization_from_tensors_without_file_type(tmp_path: Path) -> None:
    info = models.inspect(write_gguf(tmp_path / "m.gguf", name="nofiletype", file_type=False))
    assert info.quantization == "F32"


def test_cache_notices_a_rewritten_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, name="first")
    assert models.inspect(path).name == "first"
    write_gguf(path, name="second-version")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert models.inspect(path).name == "second-version"


def test_params_label() -> None:
    assert [params_label(n) for n in (999, 135_000_000, 1_235_814_400, 7_241_732_096, 70_553_706_496)] == [
        "999", "135M", "1.24B", "7.24B", "70.6B"]
