"""Test helpers for the model store: real GGUF files, a local Hugging Face / Ollama registry, the store's files.

The server answers like the public services do: Hugging Face's tree API and `resolve` URLs (a
302 to a CDN carrying the LFS sha256 in `X-Linked-Etag` and the size in `X-Linked-Size`), the
Ollama registry's v2 manifests and blobs (a 307 to a CDN), and a CDN that honours HTTP ranges.
Faults are switched on per test: cut the connection after N bytes, serve wrong bytes, ignore ranges.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import numpy as np

OLLAMA_PREFIX = "application/vnd.ollama.image."
OLLAMA_MODEL = OLLAMA_PREFIX + "model"


def write_gguf(path: Path, *, name: str = "tiny", payload_kb: int = 256, chat_template: bool = True,
               file_type: bool = True) -> Path:
    """A small but complete llama-architecture GGUF (header, vocabulary, tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(512)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    if file_type:
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = [f"tok{i}".encode() for i in range(32)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    if chat_template:
        writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rng = np.random.default_rng(len(name))
    writer.add_tensor("token_embd.weight", rng.random((32, 16), dtype=np.float32))
    rows = max(1, payload_kb * 1024 // (16 * 4))
    writer.add_tensor("blk.0.ffn_up.weight", rng.random((rows, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_bert_gguf(path: Path, *, reranking: bool = False, embd: int = 32, layers: int = 2) -> Path:
    """A small random-weight BERT that llama-server loads: an embedding model, or with a score head a reranker."""
    import gguf

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
             "the", "gpu", "cat", "dog", "##s", "##ing", "hello", "world", ".", ",", "?"]
    ctx, ff = 128, embd * 2
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("tiny-reranker" if reranking else "tiny-embedder")
    writer.add_context_length(ctx)
    writer.add_embedding_length(embd)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK if reranking else gguf.PoolingType.MEAN)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("bert")
    writer.add_token_list([w.encode() for w in words])
    writer.add_token_types([3 if w.startswith("[") else 1 for w in words])
    writer.add_token_type_count(2)
    writer.add_unk_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(2)  # BERT: [CLS] opens, [SEP] closes
    writer.add_eos_token_id(3)
    writer.add_sep_token_id(3)
    writer.add_mask_token_id(4)
    rng = np.random.default_rng(7)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32))

    def ones(name: str) -> None:
        writer.add_tensor(name, np.ones((embd,), dtype=np.float32))

    tensor("token_embd.weight", len(words), embd)
    tensor("token_types.weight", 2, embd)
    tensor("position_embd.weight", ctx, embd)
    ones("token_embd_norm.weight")
    tensor("token_embd_norm.bias", embd)
    for i in range(layers):
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", embd, embd)
            tensor(f"blk.{i}.attn_{part}.bias", embd)
        ones(f"blk.{i}.attn_output_norm.weight")
        tensor(f"blk.{i}.attn_output_norm.bias", embd)
        tensor(f"blk.{i}.ffn_up.weight", ff, embd)
        tensor(f"blk.{i}.ffn_up.bias", ff)
        tensor(f"blk.{i}.ffn_down.weight", embd, ff)
        tensor(f"blk.{i}.ffn_down.bias", embd)
        ones(f"blk.{i}.layer_output_norm.weight")
        tensor(f"blk.{i}.layer_output_norm.bias", embd)
    if reranking:
        tensor("cls.weight", embd, embd)
        tensor("cls.bias", embd)
        tensor("cls.output.weight", 1, embd)
        tensor("cls.output.bias", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ollama_store(root: Path, host: str, namespace: str, name: str, tag: str,
                 layers: dict[str, bytes | Path]) -> dict[str, Path]:
    """An Ollama store entry: each layer a blob named by its digest, and the tag's manifest. A layer given
    as a file is linked into the store (copied where a link cannot be made), not read into memory."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    paths, entries = {}, []
    for kind, data in layers.items():
        if isinstance(data, Path):
            hasher = hashlib.sha256()
            with data.open("rb") as source:
                while block := source.read(1 << 20):
                    hasher.update(block)
            digest = hasher.hexdigest()
            size = data.stat().st_size
        else:
            digest, size = sha(data), len(data)
        paths[kind] = blobs / f"sha256-{digest}"
        if isinstance(data, Path):
            try:
                os.link(data, paths[kind])
            except OSError:
                shutil.copyfile(data, paths[kind])
        else:
            paths[kind].write_bytes(data)
        entries.append({"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}",
                        "size": size})
    manifest = root / "manifests" / host / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    config = {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "3" * 64,
              "size": 2}
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": config, "layers": entries}))
    return paths


@dataclass
class Registry:
    """What the server holds, what it was asked, and the faults to inject."""

    url: str = ""
    blobs: dict[str, bytes] = field(default_factory=dict)
    hf: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (repo, revision, path) -> sha
    hf_plain: dict[tuple[str, str, str], bytes] = field(default_factory=dict)  # non-LFS files
    ollama: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (ns, name, tag) -> sha
    ollama_extra: dict[tuple[str, str, str], list[tuple[str, str]]] = field(default_factory=dict)  # media type, sha
    files: dict[str, bytes] = field(default_factory=dict)  # plain URLs: /files/<name>
    renamed: dict[str, str] = field(default_factory=dict)  # old repo -> new repo (relative 307)
    cut_after: dict[str, int] = field(default_factory=dict)  # sha -> bytes sent before the cut (once)
    corrupt: set[str] = field(default_factory=set)
    ignore_range: bool = False
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def add_hf(self, repo: str, path: str, data: bytes, revision: str = "main") -> str:
        digest = sha(data)
        self.blobs[digest] = data
        self.hf[(repo, revision, path)] = digest
        return digest

    def add_ollama(self, name: str, tag: str, data: bytes, namespace: str = "library", *,
                   projector: bytes | None = None, params: bytes | None = None) -> str:
        digest = sha(data)
        self.blobs[digest] = data
        self.ollama[(namespace, name, tag)] = digest
        for kind, extra in (("projector", projector), ("params", params)):
            if extra is not None:
                self.blobs[sha(extra)] = extra
                self.ollama_extra.setdefault((namespace, name, tag), []).append((OLLAMA_PREFIX + kind, sha(extra)))
        return digest

    def add_file(self, name: str, data: bytes) -> str:
        self.files[name] = data
        return f"{self.url}/files/{name}"

    def gets(self, prefix: str) -> list[tuple[str, dict[str, str]]]:
        return [(path, headers) for method, path, headers in self.requests
                if method == "GET" and path.startswith(prefix)]


class Handler(BaseHTTPRequestHandler):
    registry: Registry  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _record(self) -> None:
        self.registry.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, data: Any) -> None:
        self._send(code, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._record()
        path = self.path.split("?", 1)[0]
        reg = self.registry
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
            repo, rev = m.groups()
            entries: list[dict[str, Any]] = [
                {"type": "file", "path": p, "size": len(reg.blobs[d]), "oid": d[:40],
                 "lfs": {"oid": d, "size": len(reg.blobs[d]), "pointerSize": 134}}
                for (r, v, p), d in reg.hf.items() if r == repo and v == rev
            ]
            entries += [{"type": "file", "path": p, "size": len(b), "oid": sha(b)[:40]}
                        for (r, v, p), b in reg.hf_plain.items() if r == repo and v == rev]
            if not entries:
                return self._json(404, {"error": "Repository not found"})
            return self._json(200, entries)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, rev, file = m.groups()
            if repo in reg.renamed:
                return self._send(307, b"", {"Location": f"/{reg.renamed[repo]}/resolve/{rev}/{file}"})
            digest = reg.hf.get((repo, rev, file))
            if digest is None:
                return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
            return self._send(302, b"", {
                "Location": f"{reg.url}/cdn/{digest}",
                "X-Linked-Etag": f'"{digest}"',
                "X-Linked-Size": str(len(reg.blobs[digest])),
                "ETag": f'"{digest[:40]}"',
                "X-Repo-Commit": "0" * 40,
            })
        if m := re.fullmatch(r"/v2/([^/]+)/([^/]+)/manifests/([^/]+)", path):
            ns, name, tag = m.groups()
            digest = reg.ollama.get((ns, name, tag))
            if digest is None:
                return self._json(404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]})
            config = b'{"model_format":"gguf"}'
            return self._json(200, {
                "schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": f"sha256:{sha(config)}", "size": len(config)},
                "layers": [
                    {"mediaType": "application/vnd.ollama.image.license", "digest": f"sha256:{'1' * 64}",
                     "size": 10},
                    {"mediaType": OLLAMA_MODEL, "digest": f"sha256:{digest}", "size": len(reg.blobs[digest])},
                    {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'2' * 64}",
                     "size": 20},
                    *({"mediaType": kind, "digest": f"sha256:{d}", "size": len(reg.blobs[d])}
                      for kind, d in reg.ollama_extra.get((ns, name, tag), [])),
                ],
            })
        if m := re.fullmatch(r"/v2/([^/]+)/([^/]+)/blobs/sha256:([0-9a-f]{64})", path):
            digest = m.group(3)
            if digest not in reg.blobs:
                return self._json(404, {"errors": [{"code": "BLOB_UNKNOWN"}]})
            return self._send(307, b"", {"Location": f"{reg.url}/cdn/{digest}"})
        if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
            digest = m.group(1)
            if digest not in reg.blobs:
                return self._send(404, b"NoSuchKey")
            data = reg.blobs[digest]
            if digest in reg.corrupt:
                data = data[:-16] + b"\x00" * 16
            return self._serve(data, digest)
        if m := re.fullmatch(r"/files/(.+)", path):
            if m.group(1) not in reg.files:
                return self._send(404, b"not found")
            return self._serve(reg.files[m.group(1)], m.group(1))
        return self._send(404, b"no such endpoint")

    def _serve(self, data: bytes, key: str) -> None:
        """A CDN: ETag, ranges (206 + Content-Range), If-Range, 416 past the end, an optional cut."""
        start = 0
        etag = f'"{sha(data)[:20]}"'
        ranged = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if if_range is not None and if_range != etag:
            ranged = None  # the file changed since the client's first bytes: send all of it
        if ranged and not self.registry.ignore_range:
            m = re.fullmatch(r"bytes=(\d+)-", ranged)
            if not m:
                return self._send(400, b"bad range")
            start = int(m.group(1))
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
        body = data[start:]
        cut = self.registry.cut_after.pop(key, None)
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut is not None:
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)


def store_files() -> list[str]:
    """Every file under the store, relative: the "store as it was" that failures must leave."""
    from apirctl.paths import dirs

    root = dirs().models
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
