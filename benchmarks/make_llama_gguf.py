#!/usr/bin/env python3
"""Write a random-weight, Llama-shaped F16 GGUF for speed measurements.

Why: a benchmark of the transport needs the real tensor shapes and the real
tokenizer of a model family, not its trained weights (nothing downloadable is
needed, and the bytes moved per token are the same). The tokenizer is copied
from any GGUF that carries one, e.g. the pinned llama.cpp source's
`models/ggml-vocab-llama-bpe.gguf` (Llama 3's vocabulary). Quantize the result
with `llama-quantize OUT.gguf OUT-Q4_K_M.gguf Q4_K_M`.

Weights are normal with a small deviation (never zeros: zeros can run faster
than real data), norms are ones, so activations stay finite.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """The hyper-parameters that decide tensor sizes (the published Llama 3.2 configs)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    rope_theta: float = 500000.0
    ctx: int = 131072


SHAPES = {
    "1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),
    "3b": Shape(n_embd=3072, n_layer=28, n_head=24, n_head_kv=8, n_ff=8192),
    "tiny": Shape(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512),
}


def _copy_tokenizer(reader: object, writer: object) -> int:
    """Copy every `tokenizer.*` key; returns the vocabulary size."""
    import gguf

    vocab = 0
    for field in reader.fields.values():  # type: ignore[attr-defined]
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(field.name, value, vtype, sub)  # type: ignore[attr-defined]
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise SystemExit("the tokenizer source has no tokenizer.ggml.tokens")
    return vocab


def main(argv: list[str] | None = None) -> int:
    import gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="a GGUF holding tokenizer.* keys")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)

    s = SHAPES[args.shape]
    head_dim = s.n_embd // s.n_head
    rng = np.random.default_rng(args.seed)
    reader = gguf.GGUFReader(args.tokenizer_from)
    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name(f"random-llama-{args.shape}")
    n_vocab = _copy_tokenizer(reader, writer)
    writer.add_context_length(s.ctx)
    writer.add_embedding_length(s.n_embd)
    writer.add_block_count(s.n_layer)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def rand(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    kv = s.n_head_kv * head_dim
    params = 0
    # tied embeddings (as Llama 3.2 1B/3B): no output.weight, llama.cpp reuses token_embd
    tensors: list[tuple[str, object]] = [("token_embd.weight", lambda: rand(n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", lambda: ones(s.n_embd)),
            (p + "attn_q.weight", lambda: rand(s.n_embd, s.n_embd)),
            (p + "attn_k.weight", lambda: rand(kv, s.n_embd)),
            (p + "attn_v.weight", lambda: rand(kv, s.n_embd)),
            (p + "attn_output.weight", lambda: rand(s.n_embd, s.n_embd)),
            (p + "ffn_norm.weight", lambda: ones(s.n_embd)),
            (p + "ffn_gate.weight", lambda: rand(s.n_ff, s.n_embd)),
            (p + "ffn_up.weight", lambda: rand(s.n_ff, s.n_embd)),
            (p + "ffn_down.weight", lambda: rand(s.n_embd, s.n_ff)),
        ]
    tensors.append(("output_norm.weight", lambda: ones(s.n_embd)))
    for name, make in tensors:
        data = make()  # type: ignore[operator]
        params += data.size
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {params / 1e9:.2f} B parameters, vocab {n_vocab}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
