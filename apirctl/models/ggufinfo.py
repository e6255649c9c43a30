"""GGUF inspection: what a model file is, read from its header with the `gguf` package.

Also the integrity check every download passes before it gets a final name: the magic,
a header the reader can parse, and tensor data that reaches as far as the header says
(a truncated file fails here rather than deep inside llama-server).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError

MAGIC = b"GGUF"
CACHE_VERSION = 2  # bump when ModelInfo or its derivation changes


class ModelInfo(BaseModel):
    """The facts a user picks a model by, from the GGUF header."""

    path: Path
    size: int = Field(description="file size in bytes")
    gguf_version: int
    name: str | None = Field(None, description="general.name")
    architecture: str | None = None
    parameters: int = Field(description="total elements of all tensors")
    parameters_label: str = Field(description="parameters, human-readable (135M, 7.2B)")
    quantization: str | None = Field(None, description="file type, e.g. Q4_K_M")
    context_length: int | None = Field(None, description="training context length")
    vocab_size: int | None = None
    block_count: int | None = None
    chat_template: bool = Field(description="whether the file carries a chat template")
    tensor_count: int


def check_magic(path: Path, label: str) -> None:
    """Fail fast, with a clear message, on anything that is not a GGUF file."""
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except IsADirectoryError:
        raise ApirctlError(f"{label}: {path} is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ApirctlError(f"{label}: cannot read {path}: {exc.strerror or exc}") from None
    if head != MAGIC:
        raise ApirctlError(
            f"{label}: not a GGUF file (magic {head!r}, expected {MAGIC!r})",
            hint="llama.cpp needs a .gguf file; convert other formats with llama.cpp's convert scripts",
        )


def params_label(count: int) -> str:
    """135M, 1.2B: the way model cards write sizes."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.3g}{unit}"
    return str(count)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def _quantization(reader: Any) -> str | None:
    import gguf

    file_type = _field(reader, "general.file_type")
    if isinstance(file_type, int):
        try:
            return str(gguf.LlamaFileType(file_type).name).removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    # No (known) file type: name the type most weight matrices use.
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return kinds.most_common(1)[0][0] if kinds else None


def _read(path: Path, label: str) -> ModelInfo:
    import gguf

    check_magic(path, label)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise ApirctlError(f"{label}: truncated or corrupt GGUF file ({exc})") from None
    data_end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if data_end > size:
        raise ApirctlError(f"{label}: truncated GGUF file ({size} bytes, the header needs {data_end})")
    arch = _field(reader, "general.architecture")
    arch = arch if isinstance(arch, str) else None

    def arch_int(key: str) -> int | None:
        value = _field(reader, f"{arch}.{key}") if arch else None
        return int(value) if isinstance(value, int) else None

    vocab = arch_int("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    params = sum(int(t.n_elements) for t in reader.tensors)
    name = _field(reader, "general.name")
    version = _field(reader, "GGUF.version")
    return ModelInfo(
        path=path,
        size=size,
        gguf_version=int(version) if isinstance(version, int) else 0,
        name=name if isinstance(name, str) else None,
        architecture=arch,
        parameters=params,
        parameters_label=params_label(params),
        quantization=_quantization(reader),
        context_length=arch_int("context_length"),
        vocab_size=vocab,
        block_count=arch_int("block_count"),
        chat_template="tokenizer.chat_template" in reader.fields,
        tensor_count=len(reader.tensors),
    )


def validate(path: Path, label: str) -> ModelInfo:
    """Read the whole header now, uncached: the check a download passes before it is kept."""
    return _read(path, label)


def _cache_file(path: Path) -> Path:
    from apirctl.paths import dirs

    st = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    return dirs().cache / "gguf-info" / f"{key}.json"


def inspect(path: Path | str, label: str | None = None) -> ModelInfo:
    """Describe a GGUF file; cached by (path, size, mtime) because parsing a vocabulary takes seconds."""
    path = Path(path).expanduser()
    label = label or str(path)
    if not path.exists():
        raise ApirctlError(f"{label}: no such file {path}")
    cache = _cache_file(path)
    try:
        return ModelInfo.model_validate_json(cache.read_text())
    except (OSError, ValueError):
        pass
    info = _read(path, label)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(info.model_dump(mode="json")))
        tmp.replace(cache)
    except OSError:
        pass  # a cache we cannot write only costs time
    return info
