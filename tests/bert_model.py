"""A tiny BERT-shaped GGUF, written with `gguf`: an embedding model, or with a classifier head a reranker.

Real models of their kind as far as llama.cpp can tell: the `bert` architecture
(bidirectional attention, position and token-type embeddings, layer norms with biases),
a WordPiece vocabulary (`tokenizer.ggml.model = bert`) and the pooling its header names:
mean for the embedding model, rank with a `cls` and `cls.output` head for the reranker.
Random seeded weights, so the numbers mean nothing, but they are the numbers a real
model's kernels compute (vectors of the width it says, one score per document).
"""

from __future__ import annotations

import logging
import string
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, PoolingType, TokenType

WIDTH, LAYERS, HEADS, FEED_FORWARD, CONTEXT = 32, 2, 2, 64, 512
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PHANTOM = "\u2581"  # llama.cpp's WordPiece marks a word's start with it
CHARACTERS = string.ascii_lowercase + string.digits + string.punctuation


def vocabulary() -> list[str]:
    return [*SPECIALS, PHANTOM, *(PHANTOM + c for c in CHARACTERS), *CHARACTERS]


def write_bert(path: Path, rerank: bool = False, seed: int = 1234) -> Path:
    """An embedding model (mean pooling) or, with `rerank`, a reranker (rank pooling and a classifier head)."""
    rng = np.random.default_rng(seed)
    tokens = vocabulary()

    def weight(*shape: int):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "bert")
    writer.add_name("llmgw-test-reranker" if rerank else "llmgw-test-embedder")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(WIDTH)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType.RANK if rerank else PoolingType.MEAN)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    writer.add_token_type_count(2)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(1)
    writer.add_bos_token_id(2)  # [CLS]
    writer.add_sep_token_id(3)
    writer.add_eos_token_id(3)
    writer.add_mask_token_id(4)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    if rerank:
        writer.add_classifier_output_labels(["score"])

    ones, zeros = np.ones(WIDTH, dtype=np.float32), np.zeros(WIDTH, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(len(tokens), WIDTH))
    writer.add_tensor("token_types.weight", weight(2, WIDTH))
    writer.add_tensor("position_embd.weight", weight(CONTEXT, WIDTH))
    writer.add_tensor("token_embd_norm.weight", ones)
    writer.add_tensor("token_embd_norm.bias", zeros)
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weight(WIDTH, WIDTH))
            writer.add_tensor(f"{block}.{name}.bias", zeros)
        writer.add_tensor(f"{block}.attn_output_norm.weight", ones)
        writer.add_tensor(f"{block}.attn_output_norm.bias", zeros)
        writer.add_tensor(f"{block}.ffn_up.weight", weight(FEED_FORWARD, WIDTH))
        writer.add_tensor(f"{block}.ffn_up.bias", np.zeros(FEED_FORWARD, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(WIDTH, FEED_FORWARD))
        writer.add_tensor(f"{block}.ffn_down.bias", zeros)
        writer.add_tensor(f"{block}.layer_output_norm.weight", ones)
        writer.add_tensor(f"{block}.layer_output_norm.bias", zeros)
    if rerank:
        writer.add_tensor("cls.weight", weight(WIDTH, WIDTH))
        writer.add_tensor("cls.bias", zeros)
        writer.add_tensor("cls.output.weight", weight(1, WIDTH))
        writer.add_tensor("cls.output.bias", np.zeros(1, dtype=np.float32))

    writer_log = logging.getLogger("gguf.gguf_writer")
    level = writer_log.level
    writer_log.setLevel(logging.WARNING)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    finally:
        writer_log.setLevel(level)
    return path
