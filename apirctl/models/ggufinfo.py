"""GGUF inspection: what a model file is, read from its header with the `gguf` package.

Also the integrity check every download passes before it gets a final name: the magic,
a header the reader can parse, and tensor data that reaches as far as the header says
(a truncated file fails here rather than deep inside llama-server).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError
from apirctl.paths import dirs

MAGIC = b"GGUF"
CACHE_VERSION = 3  # bump when ModelInfo or its derivation changes
#: Architectures that are encoders only: they embed text, they do not generate it.
ENCODER_ARCHITECTURES = frozenset({"bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
                                   "jina-bert-v3", "eurobert", "t5encoder"})
POOLING_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: a reranker's score head

Kind = Literal["chat", "embedding", "reranking"]


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
    kind: Kind = Field("chat", description="what the model serves: chat (text generation), embedding or reranking")
    split_count: int = Field(1, description="the number of files of a split GGUF (this is the first)")


def check_magic(path: Path, label: str) -> None:
    """Fail fast, with a clear message, on anything that is not a GGUF file."""
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except IsADirectoryError:
        raise ApirctlError(f"{label}: {path} is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ApirctlError(f"{label}: cannot read {path}: {exc.strerror or exc}",
                           hint="check its permissions (apirctl reads it as the user who runs it)") from None
    if head != MAGIC:
        raise ApirctlError(
            f"{label}: not a GGUF file (magic {head!r}, expected {MAGIC!r})",
            hint="llama.cpp needs a .gguf file; convert other formats with llama.cpp's convert scripts",
        )


# Sizes of the GGUF header's scalar value types (gguf_type); 8 is a string, 9 an array.
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size} bytes"


def check_complete(path: Path, label: str) -> None:
    """Fail fast when a GGUF file ends before its tensor data does (a cut download or copy).

    Reads only the header, with the standard library (serve calls this for a local file before any
    container starts; the `gguf` reader would import numpy and parse the whole vocabulary). The last
    tensor must at least begin inside the file: a file cut anywhere before it is caught."""
    import mmap
    import struct

    check_magic(path, label)
    size = path.stat().st_size
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
            pos = 24
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            if n_tensors > 1 << 24 or n_kv > 1 << 24:
                raise ValueError(f"{n_tensors} tensors and {n_kv} keys: not a real header")
            alignment = 32

            def string(at: int) -> tuple[bytes, int]:
                (length,) = struct.unpack_from("<Q", data, at)
                if at + 8 + length > size:
                    raise ValueError("a string runs past the end")
                return data[at + 8:at + 8 + length], at + 8 + length

            def skip(kind: int, at: int) -> int:
                if kind in _SCALAR:
                    return at + _SCALAR[kind]
                if kind == 8:
                    return string(at)[1]
                if kind == 9:
                    item, count = struct.unpack_from("<IQ", data, at)
                    at += 12
                    if item in _SCALAR:
                        return at + count * _SCALAR[item]
                    for _ in range(count):
                        at = skip(item, at)
                    return at
                raise ValueError(f"unknown value type {kind}")

            for _ in range(n_kv):
                key, pos = string(pos)
                (kind,) = struct.unpack_from("<I", data, pos)
                if key == b"general.alignment" and kind == 4:
                    (alignment,) = struct.unpack_from("<I", data, pos + 4)
                pos = skip(kind, pos + 4)
            last = -1
            for _ in range(n_tensors):
                _name, pos = string(pos)
                (dims,) = struct.unpack_from("<I", data, pos)
                pos += 4 + 8 * dims
                _kind, offset = struct.unpack_from("<IQ", data, pos)
                pos += 12
                last = max(last, offset)
    except (ValueError, struct.error, OSError) as exc:
        if size < 24 or "past the end" in str(exc) or isinstance(exc, struct.error):
            raise ApirctlError(f"{label}: truncated GGUF file: its header is cut off ({_mb(size)})",
                               hint="download or copy the file again") from None
        raise ApirctlError(f"{label}: corrupt GGUF file ({exc})", hint="download or copy the file again") from None
    start = pos + (-pos % max(alignment, 1))
    need = start + last + 1 if last >= 0 else start
    if need > size:
        raise ApirctlError(f"{label}: truncated: its tensors need more than {_mb(need)}, the file has {_mb(size)}",
                           hint="download or copy the file again")


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


def model_kind(arch: str | None, pooling: Any, causal: Any, has_labels: bool) -> Kind:
    """What a model serves, from its header: llama-server needs --embeddings or --reranking for the others.

    A reranker declares the rank pooling (or classifier labels); an embedding model declares a
    pooling, has non-causal attention, or is an encoder-only architecture."""
    if pooling == POOLING_RANK or has_labels:
        return "reranking"
    if (isinstance(pooling, int) and pooling > 0) or causal is False or arch in ENCODER_ARCHITECTURES:
        return "embedding"
    return "chat"


# GGUF value types and the sizes of the fixed-size ones (the format's own numbering).
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class Header(BaseModel):
    """The few header facts serving needs, read without parsing the vocabulary."""

    architecture: str | None = None
    kind: Kind = "chat"
    split_count: int = 1


def header(path: Path) -> Header:
    """What `serve` needs from a GGUF header, cached like `inspect` (by path, size and mtime)."""
    cache = _cache_file(path, "gguf-header")
    try:
        return Header.model_validate_json(cache.read_text())
    except (OSError, ValueError):
        pass
    found = _scan_header(path)
    with contextlib.suppress(OSError):  # a cache we cannot write only costs time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(found.model_dump_json())
        tmp.replace(cache)
    return found


def _scan_header(path: Path) -> Header:
    """Scan a GGUF's key/value section: a tenth of a second where a full inspect takes seconds.

    Values are skipped by their declared sizes; a string array (the vocabulary) costs one read of
    each length. Anything malformed gives the defaults: the full check is `validate`'s job."""
    import struct

    wanted: dict[str, Any] = {}
    has_labels = False
    try:
        limit = path.stat().st_size
        with path.open("rb") as fh:

            def take(fmt: str) -> Any:
                size = struct.calcsize("<" + fmt)
                return struct.unpack("<" + fmt, fh.read(size))[0]

            def length() -> int:
                """A length or count: never more than the file has bytes (garbage must not loop or allocate)."""
                value = int(take("Q"))
                if value > limit:
                    raise ValueError("a length beyond the end of the file")
                return value

            def text() -> str:
                return fh.read(length()).decode("utf-8", "replace")

            def skip(kind: int, count: int = 1) -> None:
                if count > limit:
                    raise ValueError("a count beyond the end of the file")
                if kind in _GGUF_FIXED:
                    fh.seek(struct.calcsize("<" + _GGUF_FIXED[kind]) * count, 1)
                elif kind == _GGUF_STRING:
                    for _ in range(count):
                        fh.seek(length(), 1)
                elif kind == _GGUF_ARRAY:
                    for _ in range(count):
                        inner = take("I")
                        skip(inner, length())
                else:
                    raise ValueError(f"GGUF value type {kind}")

            if fh.read(4) != MAGIC:
                return Header()
            version = take("I")
            fh.seek(8 if version >= 2 else 4, 1)  # the tensor count
            count = take("Q") if version >= 2 else take("I")
            for _ in range(min(count, limit)):
                key, kind = text(), take("I")
                arch = wanted.get("general.architecture")
                interesting = key in ("general.architecture", "split.count") or (
                    arch and key in (f"{arch}.pooling_type", f"{arch}.attention.causal"))
                if arch and key == f"{arch}.classifier.output_labels":
                    has_labels = True
                if interesting and kind == _GGUF_STRING:
                    wanted[key] = text()
                elif interesting and kind in _GGUF_FIXED:
                    wanted[key] = take(_GGUF_FIXED[kind])
                else:
                    skip(kind)
    except (OSError, ValueError, OverflowError, struct.error):
        return Header()
    arch = wanted.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    pooling, causal = (wanted.get(f"{arch}.pooling_type"), wanted.get(f"{arch}.attention.causal")) if arch else (
        None, None)
    split_count = wanted.get("split.count")
    return Header(architecture=arch, kind=model_kind(arch, pooling, causal, has_labels),
                  split_count=split_count if isinstance(split_count, int) and split_count > 0 else 1)


def _read(path: Path, label: str) -> ModelInfo:
    import gguf

    check_complete(path, label)  # a cut file: one clear line, not the reader's array-reshape text
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
    kind = model_kind(arch, _field(reader, f"{arch}.pooling_type") if arch else None,
                      _field(reader, f"{arch}.attention.causal") if arch else None,
                      f"{arch}.classifier.output_labels" in reader.fields)
    split_count = _field(reader, "split.count")
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
        kind=kind,
        split_count=int(split_count) if isinstance(split_count, int) and split_count > 0 else 1,
    )


def validate(path: Path, label: str) -> ModelInfo:
    """Read the whole header now, uncached: the check a download passes before it is kept."""
    return _read(path, label)


def _cache_file(path: Path, folder: str = "gguf-info") -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    return dirs().cache / folder / f"{key}.json"


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
