"""Weights the tests write: GGUF and safetensors files of a chosen shape, random or zero."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def write_gqa_gguf(path: Path, layers=3, heads=8, kv_heads=2, width=128, context=4096) -> int:
    """A GGUF shaped like a grouped-query model, its matrices Q8_0; returns the bytes of its tensors."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(7)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(context)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_feed_forward_length(width * 2)
    head = width // heads
    expected = 0
    for layer in range(layers):
        norm = np.ones(width, dtype=np.float32)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", norm)
        expected += norm.nbytes
        for name, rows in (("attn_q", width), ("attn_k", kv_heads * head), ("attn_v", kv_heads * head)):
            q8 = quantize(rng.standard_normal((rows, width)).astype(np.float32), GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"blk.{layer}.{name}.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
            expected += q8.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A safetensors file of zeros with these (dtype, shape)s; returns the bytes of its tensors."""
    sizes = {"BF16": 2, "F32": 4, "I8": 1}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        size = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset
