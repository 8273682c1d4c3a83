#!/usr/bin/env python
"""The memory estimate against what llama.cpp really holds, on GGUFs shaped like real models.

    .venv/bin/python bench/memory.py [--models 0.5b-q8_0,1.5b-q4_k] [--pools 2048,16384]
                                     [--dir ~/.cache/llmgw/bench-memory] [--json out.json]

Writes each model once (real dimensions, random weights, a vocabulary of the real size,
embeddings tied to the output as the real ones are) into --dir, reads its header the
way the mirror does (mirror.headers), and for each context pool starts it the way a
node's agent does (agent.engines.command and spawn), sends one chat request whose
prompt fills a micro-batch (so the compute buffers are used, as under load), and reads
the engine's resident memory (agent.memory: RSS and PSS of its process tree). Printed
per case: the header estimate (catalog.memory.estimate) with its parts, the seed's
rule (size × 1.5 + 2 GB), the measured RSS, and each ratio. Only loopback is used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import requests
from harness import ROOT, Goal, Servers, report, table

sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

import django  # noqa: E402

django.setup()

from agent import engines  # noqa: E402
from agent import memory as measuring  # noqa: E402
from catalog.memory import GB, MB, estimate  # noqa: E402

# name -> (layers, embedding, heads, kv heads, feed-forward, vocab, trained context, matrix type)
# The dimensions of Qwen2.5-0.5B and 1.5B (their config.json), as a llama-architecture GGUF.
SHAPES = {
    # the engine's own footprint: nothing of the model's to speak of
    "tiny-q8_0": (2, 64, 4, 4, 128, 259, 4096, "Q8_0"),
    # SmolLM2-135M's dimensions: a smaller vocabulary
    "0.1b-q8_0": (30, 576, 9, 3, 1536, 49152, 8192, "Q8_0"),
    "0.5b-q8_0": (24, 896, 14, 2, 4864, 151936, 32768, "Q8_0"),
    "1.5b-q4_k": (28, 1536, 12, 2, 8960, 151936, 32768, "Q4_K"),
    "3b-q4_k": (36, 2048, 16, 2, 11008, 151936, 32768, "Q4_K"),
}
SPECIALS = ["<unk>", "<s>", "</s>"]

GOALS = [Goal("the estimate within 10% of the measured RSS in every case", lambda worst: worst <= 0.10)]


def _blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random but well-formed quantized blocks: small scales, random quants (no NaN from random halves)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    data[:, 0:2] = scale
    if qtype == GGMLQuantizationType.Q4_K:
        data[:, 2:4] = np.frombuffer(np.float16(0.0).tobytes(), dtype=np.uint8)
    return data.reshape(rows, cols // block * size)


def add_byte_vocabulary(writer, vocab: int) -> None:
    """A llama tokenizer of `vocab` tokens: the specials, the 256 bytes, and made-up words."""
    from gguf import TokenType

    writer.add_tokenizer_model("llama")
    bytes_tokens = [f"<0x{b:02X}>".encode() for b in range(256)]
    rest = [f"t{i}".encode() for i in range(vocab - len(SPECIALS) - 256)]
    writer.add_token_list([s.encode() for s in SPECIALS] + bytes_tokens + rest)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
        + [TokenType.BYTE] * 256
        + [TokenType.NORMAL] * len(rest)
    )
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_shaped_gguf(path: Path, shape: tuple) -> Path:
    """A llama-architecture GGUF of these dimensions, its matrices of the given type; written once."""
    if path.exists():
        return path
    from gguf import GGMLQuantizationType, GGUFWriter

    layers, width, heads, kv_heads, ff, vocab, context, type_name = shape
    qtype = GGMLQuantizationType[type_name]
    head = width // heads
    rng = np.random.default_rng(2024)
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(tmp, "llama")
    writer.add_name(path.stem)
    writer.add_context_length(context)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_file_type(7 if type_name == "Q8_0" else 15)
    add_byte_vocabulary(writer, vocab)

    def matrix(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, _blocks(rng, rows, cols, qtype), raw_dtype=qtype)

    # No output.weight: the output shares the embeddings, as Qwen2.5's small models do.
    matrix("token_embd.weight", vocab, width)
    for layer in range(layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(width, dtype=np.float32))
        matrix(f"{block}.attn_q.weight", width, width)
        matrix(f"{block}.attn_k.weight", kv_heads * head, width)
        matrix(f"{block}.attn_v.weight", kv_heads * head, width)
        matrix(f"{block}.attn_output.weight", width, width)
        matrix(f"{block}.ffn_gate.weight", ff, width)
        matrix(f"{block}.ffn_up.weight", ff, width)
        matrix(f"{block}.ffn_down.weight", width, ff)
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def seed_rule_bytes(size: int) -> int:
    """The seed's rule, in bytes as the serve page's field holds it (whole GB)."""
    return (int(size / GB * 1.5) + 2) * GB


def run_case(weights: Path, pool: int, servers: Servers) -> dict:
    """Start the engine on `weights` with this pool, send one request, and read what it holds."""
    work = servers.work
    port = engines.free_port()
    args = ["--ctx-size", str(pool)]
    argv = engines.command("llamacpp", weights, port, args, model="bench")
    log = work / f"{weights.stem}-{pool}.log"
    process = servers.adopt(engines.spawn(argv, log, env=engines.engine_env("llamacpp")))
    try:
        if not engines.wait_until_answers(process, port, timeout=600):
            raise SystemExit(f"the engine did not answer: {engines.last_lines(work / f'{weights.stem}-{pool}.log')}")
        # A prompt of more than a micro-batch (512 tokens): the compute buffers are used as under load.
        # Letters the vocabulary has no token for: one byte token each, 700 in all.
        prompt = "a" * 700
        started = time.monotonic()
        response = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=900,
        )
        if response.status_code != 200:
            raise SystemExit(f"the engine answered {response.status_code}: {response.text[:500]}")
        seconds = time.monotonic() - started
        measured = measuring.process_tree_memory(process.pid) or {}
        usage = response.json().get("usage", {})
    finally:
        servers.stop(process, grace=5)
    return {"measured": measured, "seconds": seconds, "prompt_tokens": usage.get("prompt_tokens")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.5b-q8_0,1.5b-q4_k")
    parser.add_argument("--pools", default="2048,16384")
    parser.add_argument("--dir", default=str(Path.home() / ".cache" / "llmgw" / "bench-memory"))
    parser.add_argument("--json", default="")
    options = parser.parse_args(argv)

    with Servers("llmgw-bench-memory-") as servers:
        rows = [row for name in options.models.split(",") for row in model_cases(name, options, servers)]
    if options.json:
        Path(options.json).write_text(json.dumps(rows, indent=1))
    table(
        ["model", "pool", "estimate", "seed rule", "measured RSS", "PSS", "estimate / measured", "seed / measured"],
        [
            (r["model"], r["pool"], f"{r['estimate']['total'] / MB:.0f} MB", f"{r['seed_rule'] / MB:.0f} MB")
            + (f"{r['measured'].get('rss', 0) / MB:.0f} MB", f"{r['measured'].get('pss', 0) / MB:.0f} MB")
            + (f"{r['estimate_over_measured']:.2f}", f"{r['seed_over_measured']:.2f}")
            for r in rows
        ],
    )
    worst = max(abs(r["estimate_over_measured"] - 1) for r in rows if r["estimate_over_measured"])
    print(f"largest error of the estimate: {worst:.1%}")
    report(GOALS, worst)
    return 0


def model_cases(name: str, options, servers: Servers) -> list[dict]:
    """One model written (or found) and measured at each pool: a row each."""
    from mirror.headers import read_version

    started = time.monotonic()
    path = write_shaped_gguf(Path(options.dir) / f"{name}.gguf", SHAPES[name])
    print(
        f"{name}: {path.stat().st_size / MB:,.0f} MB on disk (written or found in {time.monotonic() - started:.0f} s)"
    )
    header = read_version({path.name: path})
    rows = []
    for pool in (int(p) for p in options.pools.split(",")):
        guess = estimate(header, "llamacpp", ["--ctx-size", str(pool)])
        seed = seed_rule_bytes(path.stat().st_size)
        case = run_case(path, pool, servers)
        rss = case["measured"].get("rss", 0)
        row = {
            "model": name,
            "pool": pool,
            "estimate": guess.as_dict(),
            "seed_rule": seed,
            "measured": case["measured"],
            "estimate_over_measured": guess.total / rss if rss else None,
            "seed_over_measured": seed / rss if rss else None,
            "request_s": case["seconds"],
            "prompt_tokens": case["prompt_tokens"],
        }
        rows.append(row)
        print(
            f"  pool {pool:>6}: estimate {guess.total / MB:7.0f} MB (weights {guess.weights / MB:.0f}, "
            f"KV {guess.kv_cache / MB:.0f}, overhead {guess.overhead / MB:.0f}) | seed rule {seed / MB:6.0f} MB | "
            f"measured RSS {rss / MB:6.0f} MB, PSS {case['measured'].get('pss', 0) / MB:6.0f} MB | "
            f"estimate/measured {row['estimate_over_measured']:.2f}, seed/measured {row['seed_over_measured']:.2f} "
            f"({case['prompt_tokens']} prompt tokens in {case['seconds']:.0f} s)",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
