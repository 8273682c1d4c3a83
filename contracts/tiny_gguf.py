"""The one writer of the tiny llama-shaped GGUF models llama.cpp loads: the demo's and the self-test's.

Both are llamas of the same shape (64 wide, two layers, four heads, a vocabulary of
the 256 bytes and three specials, so any text tokenizes by byte fallback and nothing
needs a trained tokenizer) with seeded random weights, so a run writes the same bytes
each time. They differ in the types of their matrices and in how they are written:

- the demo model (`launcher.demo_model`, and most tests) is all F32, in parts;
- the agent's engine self-test (`agent.selftest`) has Q4_0 and Q8_0 matrices, the
  types that take llama.cpp's quantized kernels, in one file.

Here, in `contracts`, because both sides of the fleet write one: the node's agent may
import only `contracts` and its own package, and the control plane never the agent.
It needs `gguf` and `numpy` (requirements/node.txt, which every machine installs), and
imports them only when a model is written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

WIDTH, LAYERS, HEADS, FEED_FORWARD, CONTEXT = 64, 2, 4, 128, 256
SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = len(SPECIALS) + 256
EOS_TOKEN_ID = 2
# gguf's file types: what most of the matrices are.
ALL_F32, MOSTLY_Q8_0 = 0, 7

# The writer logs what it plans at INFO (from its constructor on); in an agent's log or
# `make run`'s output that is noise, whoever writes the file.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)


def write_llama(
    path: Path,
    name: str,
    seed: int,
    layer_types: tuple[str, ...] | None = None,
    files: int = 1,
) -> list[Path]:
    """Write the model at `path` and return its files, sorted by name.

    `layer_types` gives each layer's matrices a gguf quantization type by name ("Q4_0",
    "Q8_0"), every matrix 32 wide or a multiple of it as those kernels need; None keeps
    them F32. With `files` above 1 the model is split into that many parts beside
    `path` (`NAME-00001-of-0000N.gguf`, ...). One file is written to a temporary name
    and renamed, so a reader never loads half of it.
    """
    from gguf import GGUFWriter

    tensors = _tensors(seed, layer_types)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if files > 1:
        # Tensors per file so that the model comes out in exactly `files` parts.
        target = path
        writer = GGUFWriter(path, "llama", split_max_tensors=-(-len(tensors) // files))
    else:
        target = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        writer = GGUFWriter(target, "llama")
    _add_metadata(writer, name, quantized=bool(layer_types))
    for tensor_name, (data, qtype) in tensors:
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if files == 1:
            os.replace(target, path)
    finally:
        if files == 1:
            target.unlink(missing_ok=True)
    if files == 1:
        return [path]
    written = sorted(path.parent.glob(f"{path.stem}*.gguf"))
    if len(written) != files:
        raise RuntimeError(f"the GGUF writer made {len(written)} files, not {files}: {written}")
    return written


def _tensors(seed: int, layer_types: tuple[str, ...] | None) -> list:
    """[(name, (data, quantization type or None))] of the model, its weights drawn from `seed`."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    qtypes = [GGMLQuantizationType[t] for t in layer_types] if layer_types else [None] * LAYERS

    def weight(*shape: int):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def matrix(data, qtype):
        return (data, None) if qtype is None else (quantize(data, qtype), qtype)

    def norm():
        return np.ones(WIDTH, dtype=np.float32), None

    tensors = [("token_embd.weight", (weight(VOCAB, WIDTH), None))]
    for layer, qtype in enumerate(qtypes[:LAYERS]):
        block = f"blk.{layer}"
        tensors += [
            (f"{block}.attn_norm.weight", norm()),
            (f"{block}.attn_q.weight", matrix(weight(WIDTH, WIDTH), qtype)),
            (f"{block}.attn_k.weight", matrix(weight(WIDTH, WIDTH), qtype)),
            (f"{block}.attn_v.weight", matrix(weight(WIDTH, WIDTH), qtype)),
            (f"{block}.attn_output.weight", matrix(weight(WIDTH, WIDTH), qtype)),
            (f"{block}.ffn_norm.weight", norm()),
            (f"{block}.ffn_gate.weight", matrix(weight(FEED_FORWARD, WIDTH), qtype)),
            (f"{block}.ffn_up.weight", matrix(weight(FEED_FORWARD, WIDTH), qtype)),
            (f"{block}.ffn_down.weight", matrix(weight(WIDTH, FEED_FORWARD), qtype)),
        ]
    tensors += [("output_norm.weight", norm()), ("output.weight", (weight(VOCAB, WIDTH), None))]
    return tensors


def _add_metadata(writer, name: str, quantized: bool) -> None:
    """The llama's shape and its byte-level vocabulary."""
    from gguf import TokenType

    writer.add_name(name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(MOSTLY_Q8_0 if quantized else ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([s.encode() for s in SPECIALS] + [f"<0x{b:02X}>".encode() for b in range(256)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_TOKEN_ID)
