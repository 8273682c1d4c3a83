"""Weights' headers, read in a process of its own under limits (issue 34).

The mirror is filled by hand, so a weights file is untrusted input: a GGUF can claim
ten million keys or tensors, strings of 64 MiB, arrays nested in arrays, NaN where a
count belongs, "llama\\0" as its architecture. `mirror.headers` runs this module as
`python -I -S mirror/header_reader.py` with rlimits on its memory and CPU time and a
deadline per version, so whatever a file does costs a bounded process, not the control
worker. It keeps only the keys the memory estimate and the pages use; every other value
is skipped by its length, never decoded; a kept number must be a whole number within
its bound. A file that breaks a bound gets a sentence saying which, in `error`.

Files are read with plain reads, never mapped (`mirror/header_file.py`, loaded by its
path: the process has the standard library only, and its folder is not on sys.path).

The standard library only: no Django, no numpy (the gguf package's table of tensor
types is handed in by the parent), so the process starts small and its memory limit
is the headers' budget.

stdin: one JSON object {"types": {"<ggml type>": [name, block elements, block bytes]},
"cpu_s": seconds of CPU per version, "jobs": [{"id": .., "files": [[name, path, bytes,
mtime_ns], ..]}, ..]}. stdout: one JSON line per job, in order: {"id": .., "summary": {..}}.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import struct
import sys


def _sibling(name: str):
    """The module `name` beside this one, loaded by its path: run as a script under -I, this folder is not on sys.path."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__:  # imported (mirror.headers, catalog.memory): the package's own module, so one Refused
    from . import header_file
else:  # the reader process
    header_file = _sibling("header_file")

File, Refused = header_file.File, header_file.Refused
name_problem, number_problem = header_file.name_problem, header_file.number_problem

# The whole numbers a header may give, and the largest each may be: far past any model
# there is, and small enough that the estimate's products stay numbers a page can show.
FIELD_LIMITS = {
    "layers": 1 << 16,
    "heads": 1 << 20,
    "kv_heads": 1 << 20,
    "head_dim": 1 << 20,
    "key_length": 1 << 20,
    "value_length": 1 << 20,
    "embedding": 1 << 24,
    "trained_context": 1 << 32,
    "sliding_window": 1 << 32,
    "pooling_type": 1 << 8,
    "split_count": 1 << 16,
    "vocab": 1 << 32,
    "tensors": 1 << 32,
    "weights_bytes": 1 << 56,
}

# GGUF: past these a file is refused with a sentence (real ones have tens of keys, a few
# thousand tensors, vocabularies of a few hundred thousand tokens).
MAX_KEYS = 65_536
MAX_TENSORS = 200_000
MAX_TENSOR_NAME = 4096
MAX_ARRAY = 4_000_000
# An array of arrays is walked; an array of arrays of arrays is not a header.
MAX_DEPTH = 2
# A per-layer array of counts (KV heads in some architectures) is decoded up to this long.
MAX_PER_LAYER = 1 << 16
MAX_ELEMENTS = 1 << 48

# safetensors: the format caps its header at 100 MB; one that large would be a million
# tensors of JSON, which no model has. config.json the same.
SAFETENSORS_READ_MAX = 16 << 20
CONFIG_READ_MAX = 4 << 20

SAFETENSORS_DTYPES = frozenset(
    ("F64", "I64", "U64", "F32", "I32", "U32", "F16", "BF16", "I16", "U16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
)
# config.json's names for the shape, as Hugging Face writes them (older names after).
CONFIG_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "embedding": ("hidden_size", "n_embd", "d_model"),
    "head_dim": ("head_dim",),
    "trained_context": ("max_position_embeddings", "n_positions", "max_seq_len"),
    "vocab": ("vocab_size",),
}

# GGUF's value types (gguf.GGUFValueType): whole numbers, the other scalars by size, strings, arrays.
_INTS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
_OTHER_SCALARS = {6: 4, 7: 1, 12: 8}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
}
# `<architecture>.<suffix>` keys kept, under the names the summary gives them. The
# architecture's own name may come after them in the file, so they are kept per prefix.
_ARCH_KEYS = {
    "block_count": "layers",
    "attention.head_count": "heads",
    "attention.head_count_kv": "kv_heads",
    "embedding_length": "embedding",
    "context_length": "trained_context",
    "attention.key_length": "key_length",
    "attention.value_length": "value_length",
    "attention.sliding_window": "sliding_window",
    "pooling_type": "pooling_type",
    "vocab_size": "vocab",
}


# --- reading a file's header -----------------------------------------------------------


def _skip_value(f: File, kind: int, depth: int = 0) -> None:
    """Past one value without decoding it: scalars and strings by their size, arrays by their lengths."""
    if kind in _INTS:
        f.skip(struct.calcsize("<" + _INTS[kind]))
    elif kind in _OTHER_SCALARS:
        f.skip(_OTHER_SCALARS[kind])
    elif kind == _STRING:
        f.skip(f.take("Q"))
    elif kind == _ARRAY:
        item, count = f.take("I"), f.take("Q")
        _skip_array(f, item, count, depth + 1)
    else:
        raise Refused(f"a value of type {kind}, which GGUF does not have")


def _skip_array(f: File, item: int, count: int, depth: int) -> None:
    if count > MAX_ARRAY:
        raise Refused(f"an array of {count:,} values (llmgw reads arrays of at most {MAX_ARRAY:,})")
    if depth > MAX_DEPTH:
        raise Refused(f"arrays nested more than {MAX_DEPTH} deep")
    if item in _INTS:
        f.skip(struct.calcsize("<" + _INTS[item]) * count)
    elif item in _OTHER_SCALARS:
        f.skip(_OTHER_SCALARS[item] * count)
    elif item in (_STRING, _ARRAY):
        for _ in range(count):
            f.walk()
            _skip_value(f, item, depth)
    else:
        raise Refused(f"an array of type {item}, which GGUF does not have")


def _kept_number(f: File, key: str, kind: int):
    """A kept key's whole number (the largest, for a per-layer array), or the sentence saying why it is none."""
    if kind in _INTS:
        return f.take(_INTS[kind])
    if kind == _ARRAY:
        item, count = f.take("I"), f.take("Q")
        if item in _INTS and count <= MAX_PER_LAYER:
            size = struct.calcsize("<" + _INTS[item])
            numbers = struct.unpack(f"<{count}{_INTS[item]}", f.read(size * count))
            return max(numbers) if numbers else None
        _skip_array(f, item, count, 1)
        return f"{key} is an array of {count:,} {_TYPE_NAMES.get(item, item)}s, not a whole number"
    _skip_value(f, kind)
    return f"{key} is a {_TYPE_NAMES.get(kind, kind)}, not a whole number"


def read_gguf(path: str, name: str, expected, types: dict | None) -> dict:
    """One GGUF file's header: its architecture's shape and its tensors' types and bytes."""
    f = File(path, name, expected)
    try:
        try:
            header = _gguf(f, types)
        except (Refused, struct.error, OverflowError, MemoryError) as error:
            moved = f.changed()
            if moved:
                raise Refused(moved) from None
            if isinstance(error, MemoryError):
                raise Refused(f"{name}'s header needs more memory than the header reader may use") from None
            raise Refused(f"{name} is not a GGUF file llmgw can read ({error})") from None
        if moved := f.changed():
            raise Refused(moved)
        return header
    finally:
        f.close()


def _gguf(f: File, types: dict | None) -> dict:
    if types is None:
        raise Refused("the gguf package, whose table of tensor types sizes them, is not installed here")
    if f.read(4) != b"GGUF":
        raise Refused("it does not start with GGUF")
    version = f.take("I")
    if version not in (2, 3):
        raise Refused(f"GGUF version {version}")
    tensor_count, kv_count = f.take("Q"), f.take("Q")
    if kv_count > MAX_KEYS:
        raise Refused(f"its header claims {kv_count:,} keys; llmgw reads at most {MAX_KEYS:,}")
    if tensor_count > MAX_TENSORS:
        raise Refused(f"its header claims {tensor_count:,} tensors; llmgw reads at most {MAX_TENSORS:,}")
    header = _gguf_keys(f, kv_count)
    by_type = _gguf_tensors(f, tensor_count, types)
    weights = sum(by_type.values())
    if weights > f.size:
        raise Refused(f"its tensor table claims {weights:,} bytes of tensors, and the file holds {f.size:,}")
    header["tensors"] = tensor_count
    header["tensor_types"] = by_type
    header["weights_bytes"] = weights
    return header


def _gguf_keys(f: File, kv_count: int) -> dict:
    """The header's keys a plan needs (architecture, its sizes, split count, vocabulary), each within its limit."""
    arch = ""
    per_prefix: dict[tuple[str, str], object] = {}
    split_count = None
    tokens = None
    for _ in range(kv_count):
        key = f.key()
        kind = f.take("I")
        prefix, _, suffix = key.partition(".")
        if key == "general.architecture":
            if kind != _STRING:
                raise Refused(f"general.architecture is a {_TYPE_NAMES.get(kind, kind)}, not a string")
            arch = f.text("general.architecture")
        elif suffix in _ARCH_KEYS:
            per_prefix[(prefix, suffix)] = _kept_number(f, key, kind)
        elif key == "split.count":
            split_count = _kept_number(f, key, kind)
        elif key == "tokenizer.ggml.tokens" and kind == _ARRAY:
            item, tokens = f.take("I"), f.take("Q")
            _skip_array(f, item, tokens, 1)
        else:
            _skip_value(f, kind)
    header: dict = {"architecture": arch}
    found = [(f"{arch}.{suffix}", field, per_prefix.get((arch, suffix))) for suffix, field in _ARCH_KEYS.items()]
    found += [("split.count", "split_count", split_count), ("tokenizer.ggml.tokens", "vocab", tokens)]
    for key, field, value in found:
        if value is None or field in header:
            continue
        # A sentence: the key was there, and not a whole number.
        if isinstance(value, str):
            raise Refused(value)
        if problem := number_problem(value, key, FIELD_LIMITS[field]):
            raise Refused(problem)
        header[field] = value
    return header


def _gguf_tensors(f: File, tensor_count: int, types: dict) -> dict[str, int]:
    """The tensor table: bytes of weights per tensor type, as the gguf package sizes each type."""
    by_type: dict[str, int] = {}
    for _ in range(tensor_count):
        n = f.take("Q")
        if n > MAX_TENSOR_NAME:
            raise Refused(f"a tensor name of {n:,} bytes")
        f.skip(n)
        dims = f.take("I")
        if dims > 8:
            raise Refused(f"a tensor of {dims} dimensions")
        elements = 1
        for _ in range(dims):
            elements *= f.take("Q")
            if elements > MAX_ELEMENTS:
                raise Refused(f"a tensor of more than {MAX_ELEMENTS:,} elements")
        kind = f.take("I")
        f.take("Q")
        known = types.get(str(kind))
        if known is None:
            raise Refused(f"a tensor of type {kind}, which the gguf package does not know")
        type_name, block, size = known
        by_type[type_name] = by_type.get(type_name, 0) + elements // block * size
    return by_type


def _refuse_constant(name: str):
    raise Refused(f"{name} where a number belongs")


def _json(f: File, length: int, what: str):
    raw = f.read(length)
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except Refused as error:
        raise Refused(f"{what} holds {error}") from None
    except RecursionError:
        raise Refused(f"{what} is nested too deep") from None
    except (ValueError, UnicodeDecodeError):
        raise Refused(f"{what} is not JSON") from None


def read_safetensors(path: str, name: str, expected) -> dict:
    """One safetensors file's header: how many tensors, and the bytes of each dtype."""
    f = File(path, name, expected)
    try:
        try:
            header = _safetensors(f, name)
        except (Refused, struct.error, MemoryError) as error:
            moved = f.changed()
            if moved:
                raise Refused(moved) from None
            if isinstance(error, MemoryError):
                raise Refused(f"{name}'s header needs more memory than the header reader may use") from None
            raise
        if moved := f.changed():
            raise Refused(moved)
        return header
    finally:
        f.close()


def _safetensors(f: File, name: str) -> dict:
    if f.size < 8:
        raise Refused(f"{name} is shorter than a safetensors header")
    length = f.take("Q")
    if length > f.size - 8:
        raise Refused(f"{name} does not start with a safetensors header (it says {length:,} bytes)")
    if length > SAFETENSORS_READ_MAX:
        raise Refused(
            f"{name}'s safetensors header is {length:,} bytes; llmgw reads headers of at most {SAFETENSORS_READ_MAX:,}"
        )
    table = _json(f, length, f"{name}'s safetensors header")
    if not isinstance(table, dict):
        raise Refused(f"{name}'s safetensors header is not a table of tensors")
    if len(table) > MAX_TENSORS + 1:
        raise Refused(f"{name}'s safetensors header lists {len(table):,} tensors; llmgw reads at most {MAX_TENSORS:,}")
    data = f.size - 8 - length
    by_type: dict[str, int] = {}
    tensors = 0
    for tensor, info in table.items():
        if tensor == "__metadata__":
            continue
        if not isinstance(info, dict) or "dtype" not in info:
            raise Refused(f"{name}'s safetensors header says nothing of {tensor[:80]!r}'s dtype")
        dtype = info["dtype"]
        if dtype not in SAFETENSORS_DTYPES:
            raise Refused(
                f"{name}'s safetensors header gives {tensor[:80]!r} the dtype {str(dtype)[:40]!r}, which is not one"
            )
        offsets = info.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or any(number_problem(o, "", data) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise Refused(f"{name}'s safetensors header has no byte range in the file for {tensor[:80]!r}")
        by_type[dtype] = by_type.get(dtype, 0) + offsets[1] - offsets[0]
        tensors += 1
    return {"tensors": tensors, "tensor_types": by_type, "weights_bytes": sum(by_type.values())}


def read_config(path: str, name: str, expected) -> dict:
    """The shape a Hugging Face `config.json` gives, in the names a GGUF header's are kept under."""
    f = File(path, name, expected)
    try:
        if f.size > CONFIG_READ_MAX:
            raise Refused(f"{name} is {f.size:,} bytes; llmgw reads a config.json of at most {CONFIG_READ_MAX:,}")
        config = _json(f, f.size, name)
        if moved := f.changed():
            raise Refused(moved)
    finally:
        f.close()
    if not isinstance(config, dict):
        raise Refused(f"{name} is not a JSON object")
    # Multimodal configs keep the language model's shape under text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out: dict = {}
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        out["architecture"] = architectures[0]
    elif config.get("model_type"):
        out["architecture"] = config["model_type"]
    dtype = text.get("torch_dtype") or config.get("torch_dtype")
    if dtype is not None:
        out["dtype"] = dtype
    for key in ("architecture", "dtype"):
        if key in out and (problem := name_problem(out[key], f"{name}'s {key}")):
            raise Refused(problem)
    for key, names in CONFIG_KEYS.items():
        for config_name in names:
            value = text.get(config_name)
            if value is None:
                continue
            if problem := number_problem(value, f"{name}'s {config_name}", FIELD_LIMITS[key]):
                raise Refused(problem)
            out[key] = value
            break
    return out


# --- a version -----------------------------------------------------------------------


def _merge_tensors(into: dict, part: dict) -> None:
    into["tensors"] = into.get("tensors", 0) + part.get("tensors", 0)
    into["weights_bytes"] = into.get("weights_bytes", 0) + part.get("weights_bytes", 0)
    types = into.setdefault("tensor_types", {})
    for name, size in part.get("tensor_types", {}).items():
        types[name] = types.get(name, 0) + size
    into["tensor_types"] = dict(sorted(types.items(), key=lambda kv: -kv[1]))


def read_version(files: list, types: dict | None) -> dict:
    """The headers of one version's files, merged into one summary.

    `format` is gguf or safetensors (or "" when neither is there); the shape comes
    from the first GGUF part (the one llama.cpp opens) or from config.json; tensors
    and bytes are summed over every part. `error` says why a header could not be read.
    """
    by_name = {name: (path, (size, mtime_ns)) for name, path, size, mtime_ns in files}
    names = sorted(by_name)
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    safetensors = [n for n in names if n.lower().endswith(".safetensors")]
    summary: dict = {"format": ""}
    try:
        if ggufs:
            summary["format"] = "gguf"
            for i, name in enumerate(ggufs):
                path, expected = by_name[name]
                part = read_gguf(path, name, expected, types)
                if i == 0:
                    summary.update(
                        {k: v for k, v in part.items() if k not in ("tensors", "tensor_types", "weights_bytes")}
                    )
                _merge_tensors(summary, part)
            summary["files"] = ggufs
        elif safetensors:
            summary["format"] = "safetensors"
            for name in safetensors:
                _merge_tensors(summary, read_safetensors(by_name[name][0], name, by_name[name][1]))
            summary["files"] = safetensors
            if "config.json" in by_name:
                summary.update(read_config(by_name["config.json"][0], "config.json", by_name["config.json"][1]))
    except Refused as error:
        summary["error"] = str(error)
    except MemoryError:
        summary["error"] = "the headers need more memory than the header reader may use"
    if summary.get("heads") and summary.get("embedding") and not summary.get("head_dim"):
        summary["head_dim"] = summary["embedding"] // summary["heads"]
    for key in ("tensors", "weights_bytes"):
        if key in summary and (problem := number_problem(summary[key], key, FIELD_LIMITS[key])):
            summary = {"format": summary["format"], "error": problem}
    return summary


def _cpu_budget(seconds: float) -> None:
    """This version's CPU time from now: past it the kernel stops the process (SIGXCPU), and the parent says so."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    now = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(now + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def main() -> None:
    order = json.load(sys.stdin)
    types, cpu_s = order["types"], float(order["cpu_s"])
    for job in order["jobs"]:
        _cpu_budget(cpu_s)
        summary = read_version(job["files"], types)
        sys.stdout.write(json.dumps({"id": job["id"], "summary": summary}, allow_nan=False) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
