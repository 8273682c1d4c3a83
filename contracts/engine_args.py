"""Which engine arguments a profile may give, per engine: an allow-list, checked on both sides.

The catalog refuses anything else with a sentence (API, admin, configuration file, serve
page), and a node checks again before it starts an engine, because what arrives on its
queue is not trusted for having been stored. A deny-list lost to spellings the engines
accept: `--trust_remote_code` (vLLM reads `_` as `-`), `--trust-remote-cod` (argparse
takes a prefix) and `--config x.yaml` (a file of any other arguments). Here a flag is
allowed only when written exactly as listed.

Left out on purpose: whatever names a file or an address on the node (`--model`,
`--lora`, `--chat-template-file`, `--config`, `--log-file`, `--ssl-*`, `--path`,
`--download-dir`, `--hf-repo`), where the engine listens (`--host`, `--port`: the agent
chooses), and `--api-key` (the gateway's replica secret is the agent's to set).
"""

from __future__ import annotations

import re

REMOTE_CODE = "--trust-remote-code"

# flag -> whether it takes a value (as the next argument or after "=").
LLAMACPP: dict[str, bool] = {
    # llama-server's spellings, the ones the serve page and the docs write
    **dict.fromkeys(["--ctx-size", "-c", "--n-gpu-layers", "-ngl", "--gpu-layers", "--threads", "-t"], True),
    **dict.fromkeys(["--threads-batch", "-tb", "--batch-size", "-b", "--ubatch-size", "-ub"], True),
    **dict.fromkeys(["--parallel", "-np", "--n-predict", "-n", "--keep", "--seed", "-s"], True),
    **dict.fromkeys(["--cache-type-k", "-ctk", "--cache-type-v", "-ctv", "--flash-attn", "-fa"], True),
    **dict.fromkeys(["--rope-scaling", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx"], True),
    **dict.fromkeys(["--split-mode", "-sm", "--tensor-split", "-ts", "--main-gpu", "-mg", "--numa"], True),
    **dict.fromkeys(["--chat-template", "--alias", "-a", "--pooling", "--reasoning-format"], True),
    **dict.fromkeys(["--reasoning-budget", "--cache-reuse", "--defrag-thold", "--timeout", "-to"], True),
    **dict.fromkeys(["--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n"], True),
    **dict.fromkeys(["--cont-batching", "-cb", "--no-cont-batching", "-nocb", "--mlock", "--no-mmap"], False),
    **dict.fromkeys(["--jinja", "--embedding", "--embeddings", "--metrics", "--no-warmup", "--swa-full"], False),
    **dict.fromkeys(["--no-kv-offload", "-nkvo", "--no-webui", "--verbose", "-v", "--reranking", "--rerank"], False),
    # PyPI's llama-cpp-python server, which the agent translates the spellings above into
    **dict.fromkeys(["--n_ctx", "--n_gpu_layers", "--n_threads", "--n_threads_batch", "--n_batch"], True),
    **dict.fromkeys(["--n_ubatch", "--chat_format", "--model_alias", "--flash_attn", "--use_mlock"], True),
    **dict.fromkeys(["--use_mmap", "--seed", "--split_mode", "--main_gpu", "--tensor_split"], True),
    # Off unless a profile says otherwise: on, a new request cuts the one streaming (docs/engines.md).
    "--interrupt_requests": True,
}

VLLM: dict[str, bool] = {
    **dict.fromkeys(["--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size", "-tp"], True),
    **dict.fromkeys(["--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp", "--dtype"], True),
    **dict.fromkeys(["--quantization", "-q", "--kv-cache-dtype", "--max-num-seqs"], True),
    **dict.fromkeys(["--max-num-batched-tokens", "--block-size", "--swap-space", "--cpu-offload-gb"], True),
    **dict.fromkeys(["--seed", "--served-model-name", "--max-logprobs", "--tool-call-parser"], True),
    **dict.fromkeys(["--reasoning-parser", "--tokenizer-mode", "--rope-theta", "--max-seq-len-to-capture"], True),
    **dict.fromkeys(["--distributed-executor-backend", "--uvicorn-log-level", "--guided-decoding-backend"], True),
    **dict.fromkeys(["--limit-mm-per-prompt", "--rope-scaling", "--compilation-config", "-O"], True),
    **dict.fromkeys(["--task", "--runner", "--convert"], True),
    **dict.fromkeys(["--enforce-eager", "--enable-prefix-caching", "--no-enable-prefix-caching"], False),
    **dict.fromkeys(["--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-auto-tool-choice"], False),
    **dict.fromkeys(["--disable-log-requests", "--disable-log-stats", "--disable-custom-all-reduce"], False),
    **dict.fromkeys(["--disable-sliding-window", "--enable-expert-parallel"], False),
    # Only when LLMGW_ALLOW_REMOTE_CODE is set; see args_problem.
    REMOTE_CODE: False,
}

ALLOWED: dict[str, dict[str, bool]] = {"llamacpp": LLAMACPP, "vllm": VLLM}

# The arguments that start an engine for a model's kind (chat needs none), added by the
# control plane to the profile's when it sends a start, and so signed with the rest.
# vLLM: `--task` is what 0.9-0.10 read; from 0.11 `--runner pooling` replaces it (docs/engines.md).
KIND_ARGS: dict[str, dict[str, list[str]]] = {
    "llamacpp": {"embedding": ["--embedding"], "rerank": ["--reranking"]},
    "vllm": {"embedding": ["--task", "embed"], "rerank": ["--task", "score"]},
}


def kind_args(engine: str, kind: str, args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What to add to a profile's `args` to start `engine` for a model of `kind`; none it already has."""
    wanted = KIND_ARGS.get(engine, {}).get(kind, [])
    given = {arg.split("=", 1)[0] for arg in args}
    return [] if wanted and wanted[0] in given else list(wanted)


# A value given as its own argument may start with "-" only as a negative number
# (`-ngl -1`): anything else there is a flag smuggled in as a value.
_NEGATIVE_NUMBER = re.compile(r"-\d[\d.]*")


def args_problem(engine: str, args: list[str], allow_remote_code: bool = False) -> str | None:
    """Why these arguments may not be given to this engine, or None.

    `allow_remote_code` is LLMGW_ALLOW_REMOTE_CODE, which lets vLLM have --trust-remote-code.
    """
    allowed = ALLOWED.get(engine)
    if allowed is None:
        return f"no engine called {engine!r}; llmgw runs {' and '.join(ALLOWED)}"
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, _ = arg.partition("=")
        if not arg.startswith("-"):
            return f"{arg!r} is not an engine flag: every argument is a flag (like --ctx-size) or the value after one"
        if flag == REMOTE_CODE and flag in allowed and not allow_remote_code:
            return (
                f"{arg} makes the engine run code that came with the weights; "
                "it is refused unless LLMGW_ALLOW_REMOTE_CODE is set"
            )
        if flag not in allowed:
            return (
                f"{flag} is not an argument llmgw gives {engine}: engine arguments are an allow-list "
                "(docs/engines.md lists them), written exactly as there"
            )
        # A value glued on with "=" cannot be a second flag; the engine says if it objects to it.
        if allowed[flag] and not eq:
            if i + 1 >= len(args):
                return f"{flag} needs a value after it"
            value = args[i + 1]
            if value.startswith("-") and not _NEGATIVE_NUMBER.fullmatch(value):
                return f"{flag} needs a value after it, not the flag {value}"
            i += 1
        i += 1
    return None
