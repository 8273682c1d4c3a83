"""What an engine is, once: one spec per engine that every part reads.

The serve planning (which files it reads, its default GPUs, whether it has slots), the
catalog (which engines exist, the arguments a profile may give, `catalog/config.py` for
the configuration file), placement (the GPUs a profile asks for by default) and the
node's agent (the command, the weights it is handed, the switches for a model's kind,
where its secret goes, how it says it is ready) all take it from here, so adding or
changing an engine is one row. Free of Django: both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineSpec:
    name: str
    label: str
    # The executable a node runs (found by agent/engine_binary.py for llama.cpp, on PATH for vLLM).
    command: str
    # The weights files it reads, by suffix; the serve page offers a version to the engine that reads it.
    reads: tuple[str, ...]
    # "first file": handed the first file of a set by name, finds the rest beside it;
    # "directory": handed the set's directory.
    weights: str
    # GPUs a profile asks for unless it says: vLLM without a card is not a setup anyone runs.
    default_gpus: int
    # flag -> whether it takes a value (as the next argument or after "="): the allow-list.
    allowed_args: dict[str, bool]
    # The model kinds it serves, each with the switches it is started with for it (chat needs none).
    kinds: dict[str, list[str]]
    # Flags that name the model it serves; the first is the one the agent adds.
    served_name_flags: tuple[str, ...]
    # The variable it reads its API key from: never argv, which every user of the host can read.
    secret_variable: str
    # What answers 200 once the model is loaded, and keeps answering while it generates.
    health_path: str
    # Whether it serves several requests at once in slots (`--parallel N`) over one context
    # pool (`--ctx-size`), which the slots share: each gets the pool divided by their number.
    slots: bool = False
    slots_flag: str = ""
    pool_flag: str = ""
    # Flags that set its threads; the agent chooses them (and says so) unless a profile does.
    threads_flags: tuple[str, ...] = field(default_factory=tuple)


REMOTE_CODE = "--trust-remote-code"


def _flags(value: bool, *names: str) -> dict[str, bool]:
    return dict.fromkeys(names, value)


# llama.cpp's llama-server. Left out on purpose: whatever names a file or an address on the
# node (`--model`, `--lora`, `--chat-template-file`, `--log-file`, `--ssl-*`, `--path`,
# `--hf-repo`, `--slot-save-path`), where it listens (`--host`, `--port`: the agent chooses),
# `--api-key` (the replica's secret is the agent's to set), and what would take away what the
# fleet reads or relies on: `--no-slots`, `--no-cache-prompt`, `--kv-unified` (slots would no
# longer get the pool divided among them, which is what the serve page tells a client).
LLAMACPP_ARGS: dict[str, bool] = {
    **_flags(True, "--ctx-size", "-c", "--n-gpu-layers", "-ngl", "--gpu-layers", "--threads", "-t"),
    **_flags(True, "--threads-batch", "-tb", "--threads-http", "--batch-size", "-b", "--ubatch-size", "-ub"),
    **_flags(True, "--parallel", "-np", "--n-predict", "-n", "--keep", "--seed", "-s"),
    **_flags(True, "--cache-type-k", "-ctk", "--cache-type-v", "-ctv", "--flash-attn", "-fa"),
    **_flags(True, "--rope-scaling", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx"),
    **_flags(True, "--split-mode", "-sm", "--tensor-split", "-ts", "--main-gpu", "-mg", "--numa"),
    **_flags(True, "--chat-template", "--alias", "-a", "--pooling", "--reasoning-format"),
    **_flags(True, "--reasoning-budget", "--cache-reuse", "--defrag-thold", "--timeout", "-to"),
    **_flags(True, "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n"),
    **_flags(True, "--slot-prompt-similarity", "-sps", "--cache-ram", "-cram"),
    **_flags(False, "--cont-batching", "-cb", "--no-cont-batching", "-nocb", "--mlock", "--no-mmap"),
    **_flags(False, "--jinja", "--embedding", "--embeddings", "--metrics", "--no-warmup", "--swa-full"),
    **_flags(False, "--cache-prompt"),
    **_flags(False, "--no-kv-offload", "-nkvo", "--no-webui", "--verbose", "-v", "--reranking", "--rerank"),
}

VLLM_ARGS: dict[str, bool] = {
    **_flags(True, "--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size", "-tp"),
    **_flags(True, "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp", "--dtype"),
    **_flags(True, "--quantization", "-q", "--kv-cache-dtype", "--max-num-seqs"),
    **_flags(True, "--max-num-batched-tokens", "--block-size", "--swap-space", "--cpu-offload-gb"),
    **_flags(True, "--seed", "--served-model-name", "--max-logprobs", "--tool-call-parser"),
    **_flags(True, "--reasoning-parser", "--tokenizer-mode", "--rope-theta", "--max-seq-len-to-capture"),
    **_flags(True, "--distributed-executor-backend", "--uvicorn-log-level", "--guided-decoding-backend"),
    **_flags(True, "--limit-mm-per-prompt", "--rope-scaling", "--compilation-config", "-O"),
    **_flags(True, "--task", "--runner", "--convert"),
    **_flags(False, "--enforce-eager", "--enable-prefix-caching", "--no-enable-prefix-caching"),
    **_flags(False, "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-auto-tool-choice"),
    **_flags(False, "--disable-log-requests", "--disable-log-stats", "--disable-custom-all-reduce"),
    **_flags(False, "--disable-sliding-window", "--enable-expert-parallel"),
    # Only when LLMGW_ALLOW_REMOTE_CODE is set; see engine_args.args_problem.
    REMOTE_CODE: False,
}

LLAMACPP = EngineSpec(
    name="llamacpp",
    label="llama.cpp",
    command="llama-server",
    reads=(".gguf",),
    weights="first file",
    default_gpus=0,
    allowed_args=LLAMACPP_ARGS,
    # llama-server reads --embedding as --embeddings.
    kinds={"chat": [], "embedding": ["--embedding"], "rerank": ["--reranking"]},
    served_name_flags=("--alias", "-a"),
    secret_variable="LLAMA_API_KEY",
    # /health is 503 while the model loads and 200 once it can answer, key or no key.
    health_path="/health",
    slots=True,
    slots_flag="--parallel",
    pool_flag="--ctx-size",
    threads_flags=("--threads", "-t"),
)

VLLM = EngineSpec(
    name="vllm",
    label="vLLM",
    command="vllm",
    reads=(".safetensors", ".bin"),
    weights="directory",
    default_gpus=1,
    allowed_args=VLLM_ARGS,
    # `--task` is what vLLM 0.9-0.10 read; from 0.11 `--runner pooling` replaces it (docs/engines.md).
    kinds={"chat": [], "embedding": ["--task", "embed"], "rerank": ["--task", "score"]},
    served_name_flags=("--served-model-name",),
    secret_variable="VLLM_API_KEY",
    health_path="/v1/models",
)

SPECS: dict[str, EngineSpec] = {spec.name: spec for spec in (LLAMACPP, VLLM)}
NAMES: tuple[str, ...] = tuple(SPECS)


def spec(engine: str) -> EngineSpec | None:
    return SPECS.get(engine)


def no_such_engine(engine: str) -> str:
    return f"no engine called {engine!r}; llmgw runs {' and '.join(NAMES)}"


def engine_reading(file_name: str) -> str:
    """The engine that reads this kind of weights file, or "" when none does."""
    lowered = file_name.lower()
    return next((s.name for s in SPECS.values() if any(lowered.endswith(suffix) for suffix in s.reads)), "")


def _given(args: list[str] | tuple[str, ...]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args}


# llama-server's switches for a model kind, each with the other spelling it takes
# (--embeddings for --embedding, --rerank for --reranking).
KIND_SWITCH_SPELLINGS = {
    "--embedding": frozenset({"--embedding", "--embeddings"}),
    "--reranking": frozenset({"--reranking", "--rerank"}),
}


def kind_args(engine: str, kind: str, args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What to add to a profile's `args` to start `engine` for a model of `kind`; none it already has.

    Added by the control plane when it sends a start, and so signed with the rest.
    """
    found = SPECS.get(engine)
    wanted = found.kinds.get(kind, []) if found else []
    if not wanted:
        return []
    spellings = KIND_SWITCH_SPELLINGS.get(wanted[0], frozenset()) | {wanted[0]}
    return [] if spellings & _given(args) else list(wanted)


def slot_args(engine: str, parallel: int, args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`--parallel N` for an engine with slots, unless the profile's own args say it.

    Always written, 1 included: left out, llama-server picks 4 slots over one unified pool,
    which is not the division the serve page promised a client.
    """
    found = SPECS.get(engine)
    if not found or not found.slots or _given(args) & {found.slots_flag, "-np"}:
        return []
    return [found.slots_flag, str(max(1, parallel))]


def pool_size(args: list[str] | tuple[str, ...]) -> int:
    """The context pool a llama.cpp profile's args give (`--ctx-size N`), 0 when they give none."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--ctx-size", "-c"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else 0
    return 0
