"""A tiny llama-architecture GGUF, split into three files, that llama.cpp loads and runs.

Real weights cannot be downloaded here and would be gigabytes; what the tests need,
and what a newcomer needs to see llmgw answer, is a model llama.cpp accepts as a
llama and generates tokens from. The weights are random (seeded, so every run
writes the same bytes), the vocabulary is the 256 bytes plus three specials, so any
text tokenizes by byte fallback and nothing needs a trained tokenizer. It answers
with random text.

`make run` puts it into the mirror as `tiny-demo/v1/` (`seed_mirror`); the tests
write it wherever they need it (`write_tiny_llama`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

from mirror import disk

WIDTH = 64
LAYERS = 2
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 256
SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = len(SPECIALS) + 256
EOS_TOKEN_ID = 2


def write_tiny_llama(directory: Path, name: str = "tiny", files: int = 3) -> list[Path]:
    """Write the model into `directory` as `files` parts; returns them sorted by name."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", weight(VOCAB, WIDTH))]
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        tensors += [
            (f"{block}.attn_norm.weight", np.ones(WIDTH, dtype=np.float32)),
            (f"{block}.attn_q.weight", weight(WIDTH, WIDTH)),
            (f"{block}.attn_k.weight", weight(WIDTH, WIDTH)),
            (f"{block}.attn_v.weight", weight(WIDTH, WIDTH)),
            (f"{block}.attn_output.weight", weight(WIDTH, WIDTH)),
            (f"{block}.ffn_norm.weight", np.ones(WIDTH, dtype=np.float32)),
            (f"{block}.ffn_gate.weight", weight(FEED_FORWARD, WIDTH)),
            (f"{block}.ffn_up.weight", weight(FEED_FORWARD, WIDTH)),
            (f"{block}.ffn_down.weight", weight(WIDTH, FEED_FORWARD)),
        ]
    tensors += [("output_norm.weight", np.ones(WIDTH, dtype=np.float32)), ("output.weight", weight(VOCAB, WIDTH))]

    # Tensors per file so that the model comes out in exactly `files` parts.
    per_file = -(-len(tensors) // files)
    writer = GGUFWriter(directory / f"{name}.gguf", "llama", split_max_tensors=per_file)
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
    writer.add_file_type(0)  # all F32

    writer.add_tokenizer_model("llama")
    tokens = [s.encode() for s in SPECIALS] + [f"<0x{b:02X}>".encode() for b in range(256)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_TOKEN_ID)

    for tensor_name, data in tensors:
        writer.add_tensor(tensor_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    written = sorted(directory.glob(f"{name}*.gguf"))
    if len(written) != files:
        raise RuntimeError(f"the GGUF writer made {len(written)} files, not {files}: {written}")
    return written


DEMO_MODEL = "tiny-demo"
DEMO_VERSION = "v1"


def seed_mirror(mirror_root: Path) -> Path | None:
    """Put the demo model at `mirror_root/tiny-demo/v1/` unless `tiny-demo` is there already.

    Returns the version's directory when it was written now, None when anything
    of that name was already there: an operator may have replaced or removed
    files in it, and it is theirs from then on.

    Written into a hidden directory and renamed into place, so that a scan or a
    node fetching never sees a version with only some of its three parts: the scan
    and the byte listener ignore hidden names, and the rename is one step.
    """
    target = mirror_root / DEMO_MODEL
    if target.exists() or target.is_symlink():
        return None
    staging = mirror_root / f".{DEMO_MODEL}.tmp"
    # Left over from a start that was stopped halfway; it is ours and never shown.
    shutil.rmtree(staging, ignore_errors=True)
    # The writer logs each part it plans at INFO; in `make run`'s output that is noise.
    writer_log = logging.getLogger("gguf.gguf_writer")
    level = writer_log.level
    writer_log.setLevel(logging.WARNING)
    try:
        write_tiny_llama(staging / DEMO_VERSION)
        # Whole when it appears: not held back as "still being written" (docs/mirror.md).
        disk.mark_settled(staging)
        try:
            staging.rename(target)
        except OSError:
            # Something of that name appeared while we wrote, with files in it.
            return None
    finally:
        writer_log.setLevel(level)
        shutil.rmtree(staging, ignore_errors=True)
    return target / DEMO_VERSION


if __name__ == "__main__":
    import sys

    for path in write_tiny_llama(Path(sys.argv[1])):
        print(path, path.stat().st_size)
