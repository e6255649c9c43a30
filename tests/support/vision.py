"""A vision projector (mmproj) and a picture, made in the test: what `serve` mounts with `--mmproj` and
what `chat --image` sends, without a real vision model's download.

The projector is a LLaVA-style one (`clip.projector_type` "mlp") with random weights: a tiny ViT (a
convolution cutting the picture into patches, two transformer blocks) and a two-layer MLP whose output
has the text model's embedding size, which llama.cpp's multimodal loader checks against the model it
serves. The picture is resized to the projector's square `image_size`, and each patch becomes one token
of the prompt, so an image adds `image_tokens()` tokens: a number the test can see in the usage.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Projector:
    """The geometry of the projector written; the text embedding size comes from the model it serves."""

    text_embd: int
    image_size: int = 64
    patch_size: int = 16
    embd: int = 32  # the ViT's width
    heads: int = 2
    ff: int = 64  # not equal to `embd`: the loader swaps up/down of old files whose down takes `embd`
    blocks: int = 2
    hidden: int = 64  # the MLP's inner width

    def image_tokens(self) -> int:
        """Tokens one image takes in the prompt: one per patch (this projector has no class token)."""
        return (self.image_size // self.patch_size) ** 2


def text_embedding_length(model: Path) -> int:
    """The embedding size of a GGUF text model (`<arch>.embedding_length`), which the projector's output must match."""
    import gguf

    fields = gguf.GGUFReader(str(model)).fields
    arch = fields["general.architecture"].contents()
    return int(fields[f"{arch}.embedding_length"].contents())


def write_projector(path: Path, geometry: Projector, *, seed: int = 5) -> Path:
    """A random-weight multimodal projector GGUF that llama-server's `--mmproj` loads and runs."""
    import gguf

    g = geometry
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("tiny-random-vision")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("mlp")
    writer.add_vision_image_size(g.image_size)
    writer.add_vision_patch_size(g.patch_size)
    writer.add_vision_embedding_length(g.embd)
    writer.add_vision_feed_forward_length(g.ff)
    writer.add_vision_block_count(g.blocks)
    writer.add_vision_head_count(g.heads)
    writer.add_vision_projection_dim(g.text_embd)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_use_gelu(True)
    rng = np.random.default_rng(seed)

    # numpy shapes are ggml's dimensions reversed: a matrix (out, in) multiplies a vector of `in`
    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def norm(name: str) -> None:
        writer.add_tensor(f"{name}.weight", np.ones(g.embd, dtype=np.float32))
        writer.add_tensor(f"{name}.bias", np.zeros(g.embd, dtype=np.float32))

    tensor("v.patch_embd.weight", g.embd, 3, g.patch_size, g.patch_size)  # a convolution kernel, RGB in
    tensor("v.patch_embd.bias", g.embd)
    tensor("v.position_embd.weight", g.image_tokens(), g.embd)
    for i in range(g.blocks):
        for part in ("q", "k", "v", "out"):
            tensor(f"v.blk.{i}.attn_{part}.weight", g.embd, g.embd)
            tensor(f"v.blk.{i}.attn_{part}.bias", g.embd)
        norm(f"v.blk.{i}.ln1")
        norm(f"v.blk.{i}.ln2")
        tensor(f"v.blk.{i}.ffn_up.weight", g.ff, g.embd)
        tensor(f"v.blk.{i}.ffn_up.bias", g.ff)
        tensor(f"v.blk.{i}.ffn_down.weight", g.embd, g.ff)
        tensor(f"v.blk.{i}.ffn_down.bias", g.embd)
    norm("v.post_ln")
    tensor("mm.0.weight", g.hidden, g.embd)
    tensor("mm.0.bias", g.hidden)
    tensor("mm.2.weight", g.text_embd, g.hidden)
    tensor("mm.2.bias", g.text_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_png(path: Path, width: int = 48, height: int = 32) -> Path:
    """An RGB gradient as a PNG, written with zlib (no imaging library needed)."""
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (x * 255 // width, y * 255 // height, 128))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                     + chunk(b"IEND", b""))
    return path
