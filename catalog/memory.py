"""How much memory a profile's engine needs, from what the weights' header says (mirror.headers).

One pure function, `estimate`, over a version's header summary and a profile's engine
and arguments: the serve page pre-fills its field from it, and the replicas page
shows it beside what the agents measure. Here rather than in `serving`, because the
fleet's pages need it too and the fleet sits below serving.

llama.cpp: the weights (every tensor's bytes: the file is mapped, and a model's
matrices are all read for each token; twice for the types the CPU backend repacks), the KV cache for the context pool (layers × KV
heads × (key + value head size) × pool × bytes per element of the cache type; the pool
is shared by the slots, not multiplied by them), the host-memory prompt cache (idle
slots' prompts kept for their conversations' next turns: `--cache-ram`, bounded by the
control plane to one pool's KV cache again, `prompt_cache_args`), the compute buffers
(the activations of one micro-batch) and the engine's own footprint. vLLM: the weights plus the KV cache
for --max-model-len, or, on a card, what --gpu-memory-utilization takes of it
(vLLM reserves that share whatever the model needs).

The llama.cpp constants below were measured here by bench/memory.py (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from contracts.engines import KIND_SWITCH_SPELLINGS
from mirror.header_reader import FIELD_LIMITS, number_problem

GB = 1 << 30
MB = 1 << 20

# The llama.cpp engine's own resident memory beside weights, KV cache and compute
# buffers: `llama-server`, its libraries and its allocator. Measured on a model of no
# size (bench/memory.py, docs/benchmarks.md: 21-22 MB at both pools).
LLAMACPP_FOOTPRINT_BYTES = 21 * MB
# The compute buffers in use at the default micro-batch, fitted on llama-server at four
# shapes (vocabularies of 259, 49,152 and 151,936 tokens; 2 to 30 layers of 64 to 1,536):
# a share per token of the vocabulary (the micro-batch's logits, the tokenizer's tables)
# and a share per layer and unit of width (the activations the graph keeps).
LLAMACPP_BYTES_PER_VOCAB_TOKEN = 216
LLAMACPP_BYTES_PER_LAYER_WIDTH = 1510
# Tensor types llama.cpp's CPU backend repacks at load into its interleaved layouts
# (q4_K_8x8, q4_0_8x8, iq4_nl_4x4 on x86 with AVX2): a second copy in the engine's own
# memory, while the mapped file's pages stay resident too. Measured: a 1.5B Q4_K model
# of 828 MB held 828 MB more than one whose matrices are Q8_0 (docs/benchmarks.md).
LLAMACPP_REPACKED_TYPES = ("Q4_0", "Q4_K", "IQ4_NL")
# vLLM's beside its share of the card: CUDA context, the Python process, the graphs.
VLLM_FOOTPRINT_BYTES = 2 * GB
# llama.cpp's default micro-batch, and the pool it takes when a profile gives none.
LLAMACPP_UBATCH = 512
LLAMACPP_DEFAULT_POOL = 4096
VLLM_DEFAULT_UTILIZATION = 0.9

# Bytes per element of llama.cpp's KV cache types (a block's bytes over its elements).
CACHE_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
# vLLM's --kv-cache-dtype, and its "auto": the weights' own dtype (2 bytes for the usual bf16/f16).
VLLM_CACHE_BYTES = {"auto": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "bfloat16": 2.0, "float16": 2.0}


@dataclass(frozen=True)
class Estimate:
    """What a replica will hold, in bytes, and the parts it is made of."""

    weights: int
    kv_cache: int
    overhead: int
    pool: int
    engine: str
    # Why a part could not be worked out from the header ("" when every part could).
    missing: str = ""
    # llama-server's host-memory prompt cache, at its bound (0 for vLLM, which keeps none).
    prompt_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.prompt_cache + self.overhead

    @property
    def total_gb(self) -> int:
        """Whole GB, rounded up: what a profile's min memory field holds."""
        return -(-self.total // GB) if self.total else 0

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "total_gb": self.total_gb}


@dataclass(frozen=True)
class Shape:
    """What the estimate reads of a header: each a whole number within its bound (0 where the header is silent)."""

    weights_bytes: int
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    key_length: int = 0
    value_length: int = 0
    embedding: int = 0
    vocab: int = 0
    trained_context: int = 0
    # The bytes of the tensor types llama.cpp's CPU backend repacks (LLAMACPP_REPACKED_TYPES).
    repacked_bytes: int = 0


SHAPE_FIELDS = (
    "weights_bytes",
    "layers",
    "heads",
    "kv_heads",
    "head_dim",
    "key_length",
    "value_length",
    "embedding",
    "vocab",
    "trained_context",
)


def checked(header: Mapping | None) -> Shape | str:
    """The header's numbers as a Shape, or the sentence saying why there is none to estimate from.

    The one place a header's values become numbers: a header is JSON from a file anyone
    copied into the mirror (or from an older reader), so a string, a float, NaN or a count
    past any model is a sentence here, never a product of strings or an OverflowError in
    a page or a start order (issue 34).
    """
    if not header:
        return "the weights' header has not been read yet"
    if not isinstance(header, Mapping):
        return "the weights' header is not a table"
    if header.get("error"):
        return f"the weights' header could not be read ({header['error']})"
    numbers = {}
    for name in SHAPE_FIELDS:
        value = header.get(name)
        if value is None:
            continue
        if problem := number_problem(value, name, FIELD_LIMITS[name]):
            return f"the weights' header cannot be estimated from: {problem}"
        numbers[name] = value
    if not numbers.get("weights_bytes"):
        return "the weights' header gives nothing to estimate from"
    types = header.get("tensor_types") or {}
    if not isinstance(types, Mapping):
        return "the weights' header cannot be estimated from: its tensor types are not a table"
    repacked = 0
    for name in LLAMACPP_REPACKED_TYPES:
        value = types.get(name, 0)
        if problem := number_problem(value, f"the bytes of {name}", FIELD_LIMITS["weights_bytes"]):
            return f"the weights' header cannot be estimated from: {problem}"
        repacked += value
    return Shape(**numbers, repacked_bytes=repacked)


def arg_value(args: Sequence[str], *flags: str) -> str | None:
    """The value given to any of `flags` (as the next argument or after `=`), the last one winning."""
    found = None
    args = list(args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            if eq:
                found = value
            elif i + 1 < len(args):
                found = args[i + 1]
    return found


# llama-server keeps idle slots' prompts in host memory, up to `--cache-ram` MiB (its own
# default 8,192 MiB whatever the model, -1 without bound, 0 none): a conversation pushed
# out of its slot is restored at its next turn instead of computed again (prefix routing
# sends it back for that). The control plane bounds it to one pool's KV cache again, so
# that a replica keeps as many tokens again as its slots hold, and the estimate counts it;
# a profile's own --cache-ram wins. Where the header does not give the KV cache's size the
# cache is turned off: memory nobody counted is how a node runs out of it.
PROMPT_CACHE_FLAGS = ("--cache-ram", "-cram")
# An embedding or rerank engine answers each input whole and resumes no conversation: its
# prompt cache would only hold memory, so it is started with none (and none is counted).
NO_CONVERSATION_SWITCHES = frozenset().union(*KIND_SWITCH_SPELLINGS.values())


def prompt_cache_args(engine: str, header: Mapping | None, args: Sequence[str]) -> list[str]:
    """`--cache-ram N` for a llama-server start whose arguments do not bound its prompt cache, else nothing."""
    if engine != "llamacpp" or arg_value(args, *PROMPT_CACHE_FLAGS) is not None:
        return []
    if NO_CONVERSATION_SWITCHES.intersection(args):
        return ["--cache-ram", "0"]
    found = estimate(header or {}, engine, args)
    kv = found.kv_cache if found is not None else 0
    return ["--cache-ram", str(-(-kv // MB))]


def _prompt_cache(args: Sequence[str], kv_cache: int) -> tuple[int, str]:
    """(bytes the prompt cache may hold, why it could not be counted): the profile's --cache-ram, else the pool's KV again."""
    given = arg_value(args, *PROMPT_CACHE_FLAGS)
    if given is None:
        return (0 if NO_CONVERSATION_SWITCHES.intersection(args) else kv_cache), ""
    mib = _number(given, 0)
    if mib < 0:
        return 0, "--cache-ram -1 puts no bound on the engine's prompt cache: it is not counted"
    return int(mib * MB), ""


def _number(raw: str | None, default: float) -> float:
    """An argument's number; `default` for none, for what is not one, and for inf or nan (int() of them raises)."""
    try:
        value = float(raw) if raw is not None else default
    except ValueError:
        return default
    return value if math.isfinite(value) else default


def kv_bytes_per_token(shape: Shape, k_bytes: float, v_bytes: float) -> float:
    """The KV cache one token of context holds, over every layer; 0 when the header does not say its shape."""
    layers, kv_heads, head_dim = shape.layers, shape.kv_heads or shape.heads, shape.head_dim
    if not (layers and kv_heads and head_dim):
        return 0.0
    key = shape.key_length or head_dim
    value = shape.value_length or head_dim
    return layers * kv_heads * (key * k_bytes + value * v_bytes)


def estimate(
    header: Mapping | None, engine: str, args: Sequence[str] = (), parallel: int = 1, gpu_memory_bytes: int = 0
) -> Estimate | None:
    """The memory a replica of these weights needs with this engine and these arguments.

    `parallel` is llama.cpp's slots (they share the pool: it adds only their per-slot
    buffers); `gpu_memory_bytes` the card a vLLM replica runs on, when known. None when
    the header says nothing to estimate from (not read, unreadable, or numbers that are
    not: `checked` says why): callers then fall back on the size rule.
    """
    shape = checked(header)
    if isinstance(shape, str):
        return None
    if engine == "llamacpp":
        return _llamacpp(shape, list(args), max(int(parallel or 1), 1))
    if engine == "vllm":
        return _vllm(shape, list(args), gpu_memory_bytes)
    return None


def _llamacpp(shape: Shape, args: list[str], parallel: int) -> Estimate:
    trained = shape.trained_context
    pool = int(_number(arg_value(args, "--ctx-size", "-c", "--n_ctx"), 0))
    if pool <= 0:
        # llama.cpp's own default: its context size, never past what the model was trained for.
        pool = min(LLAMACPP_DEFAULT_POOL, trained) if trained else LLAMACPP_DEFAULT_POOL
    k_type = (arg_value(args, "--cache-type-k", "-ctk") or "f16").lower()
    v_type = (arg_value(args, "--cache-type-v", "-ctv") or "f16").lower()
    per_token = kv_bytes_per_token(shape, CACHE_TYPE_BYTES.get(k_type, 2.0), CACHE_TYPE_BYTES.get(v_type, 2.0))
    missing = "" if per_token else "the header does not give layers, KV heads and head size: no KV cache counted"
    ubatch = int(_number(arg_value(args, "--ubatch-size", "-ub", "--n_ubatch"), LLAMACPP_UBATCH))
    vocab = shape.vocab
    # The vocabulary's share scales with the micro-batch (its logits are a micro-batch
    # of rows); each further slot keeps a row of logits of its own.
    layer_width = shape.layers * shape.embedding
    compute = (
        int(
            (vocab * LLAMACPP_BYTES_PER_VOCAB_TOKEN + layer_width * LLAMACPP_BYTES_PER_LAYER_WIDTH)
            * ubatch
            / LLAMACPP_UBATCH
        )
        + (parallel - 1) * vocab * 4
    )
    kv_cache = int(per_token * pool)
    prompt_cache, unbounded = _prompt_cache(args, kv_cache)
    return Estimate(
        weights=shape.weights_bytes + shape.repacked_bytes,
        kv_cache=kv_cache,
        prompt_cache=prompt_cache,
        overhead=compute + LLAMACPP_FOOTPRINT_BYTES,
        pool=pool,
        engine="llamacpp",
        missing="; ".join(why for why in (missing, unbounded) if why),
    )


def _vllm(shape: Shape, args: list[str], gpu_memory_bytes: int) -> Estimate:
    weights, trained = shape.weights_bytes, shape.trained_context
    pool = int(_number(arg_value(args, "--max-model-len"), trained))
    cache = VLLM_CACHE_BYTES.get((arg_value(args, "--kv-cache-dtype") or "auto").lower(), 2.0)
    per_token = kv_bytes_per_token(shape, cache, cache)
    kv = int(per_token * pool)
    utilization = _number(arg_value(args, "--gpu-memory-utilization"), VLLM_DEFAULT_UTILIZATION)
    if gpu_memory_bytes:
        # vLLM takes its share of the card whatever the model needs, and fills what is
        # left after the weights with KV cache.
        kv = max(kv, int(gpu_memory_bytes * utilization) - weights)
    missing = "" if per_token else "the header does not give layers, KV heads and head size: no KV cache counted"
    return Estimate(
        weights=weights, kv_cache=kv, overhead=VLLM_FOOTPRINT_BYTES, pool=pool, engine="vllm", missing=missing
    )
