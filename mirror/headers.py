"""What a version's weights say about themselves: the headers of its GGUF and safetensors files.

Read when a scan finds a version new or changed, and kept on the version
(`MirrorVersion.headers`), because the memory a model needs follows from its shape
(layers, KV heads, head size) and its tensors' bytes, not from the size of its files.
Only headers are read: a GGUF's metadata and tensor table (the `gguf` package
maps the file and reads no tensor data), a safetensors file's JSON header (its first
bytes), and `config.json` where there is one. A file whose header cannot be read
leaves the version indexed as before, with `error` saying why.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

from django.db.models import F, Q
from django.utils import timezone

from . import disk
from .models import MirrorVersion

log = logging.getLogger(__name__)

# A safetensors header larger than this is not one (the format caps it at 100 MB).
SAFETENSORS_HEADER_MAX = 100 * 1000 * 1000
# Bytes per element of safetensors' dtypes.
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
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


class HeaderError(ValueError):
    """A header that cannot be read; the message is the sentence staff see."""


# --- GGUF ---------------------------------------------------------------------------


# GGUF's value types (gguf.GGUFValueType) -> struct format of one element; 8 is a string, 9 an array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Past these a file is not a GGUF header, whatever its first bytes say.
_MAX_COUNT = 10_000_000
_MAX_STRING = 64 << 20


class _Cursor:
    """Little-endian reads from a mapped file, each one bounds-checked by struct."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.take("Q")
        if length > _MAX_STRING:
            raise ValueError(f"a string of {length:,} bytes")
        raw = self.data[self.at : self.at + length]
        if len(raw) != length:
            raise ValueError("the file ends inside a string")
        self.at += length
        return raw.decode("utf-8", "replace")

    def value(self, kind: int):
        """A scalar or a string; for an array, (its length, its numbers if it holds a few, else None)."""
        if kind in _SCALAR:
            return self.take(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if count > _MAX_COUNT:
            raise ValueError(f"an array of {count:,} values")
        if item in _SCALAR:
            size = struct.calcsize("<" + _SCALAR[item])
            if self.at + size * count > len(self.data):
                raise ValueError("the file ends inside an array")
            numbers = (
                list(struct.unpack_from(f"<{count}{_SCALAR[item]}", self.data, self.at)) if count <= 4096 else None
            )
            self.at += size * count
            return (count, numbers)
        for _ in range(count):
            self.value(item)
        return (count, None)


def read_gguf(path: Path) -> dict:
    """One GGUF file's header: its architecture's shape and its tensors' types and bytes.

    Only the header is read, with the `gguf` package's tables of tensor types and their
    sizes: gguf's own GGUFReader maps the whole file and makes an array of every token of
    the vocabulary, six seconds of CPU for a header of 152,000 tokens.
    """
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError as missing:
        raise HeaderError(f"the gguf package is not installed here ({missing})") from None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            values, tensors = _read_gguf_header(_Cursor(data))
    except (OSError, ValueError, struct.error, OverflowError) as error:
        raise HeaderError(f"{path.name} is not a GGUF file llmgw can read ({error})") from None
    arch = values.get("general.architecture") or ""

    def of_arch(key: str):
        value = values.get(f"{arch}.{key}")
        if isinstance(value, tuple):
            # Per-layer counts are an array in some architectures: the largest is what the cache holds.
            return max(value[1]) if value[1] else None
        return value

    types: dict[str, int] = {}
    for kind, elements in tensors:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise HeaderError(
                f"{path.name} holds a tensor of type {kind}, which the gguf package does not know"
            ) from None
        name = GGMLQuantizationType(kind).name
        types[name] = types.get(name, 0) + elements // block * size
    tokens = values.get("tokenizer.ggml.tokens")
    header = {
        "architecture": arch,
        "layers": of_arch("block_count"),
        "heads": of_arch("attention.head_count"),
        "kv_heads": of_arch("attention.head_count_kv"),
        "embedding": of_arch("embedding_length"),
        "trained_context": of_arch("context_length"),
        "key_length": of_arch("attention.key_length"),
        "value_length": of_arch("attention.value_length"),
        "sliding_window": of_arch("attention.sliding_window"),
        "pooling_type": of_arch("pooling_type"),
        "split_count": values.get("split.count"),
        "vocab": of_arch("vocab_size") or (tokens[0] if isinstance(tokens, tuple) else None),
        "tensors": len(tensors),
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
        "weights_bytes": sum(types.values()),
    }
    return {key: value for key, value in header.items() if value is not None}


def _read_gguf_header(cursor: _Cursor) -> tuple[dict, list[tuple[int, int]]]:
    """({key: value}, [(tensor type, elements)]) from a GGUF file's header."""
    if cursor.take("4s") != b"GGUF":
        raise ValueError("it does not start with GGUF")
    version = cursor.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    tensor_count, kv_count = cursor.take("Q"), cursor.take("Q")
    if tensor_count > _MAX_COUNT or kv_count > _MAX_COUNT:
        raise ValueError(f"{tensor_count:,} tensors and {kv_count:,} keys")
    values = {}
    for _ in range(kv_count):
        key = cursor.string()
        values[key] = cursor.value(cursor.take("I"))
    tensors = []
    for _ in range(tensor_count):
        cursor.string()
        dims = cursor.take("I")
        if dims > 8:
            raise ValueError(f"a tensor of {dims} dimensions")
        elements = 1
        for _ in range(dims):
            elements *= cursor.take("Q")
        kind = cursor.take("I")
        cursor.take("Q")
        tensors.append((kind, elements))
    return values, tensors


# --- safetensors ---------------------------------------------------------------------


def read_safetensors(path: Path) -> dict:
    """One safetensors file's header: how many tensors, and the bytes of each dtype."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise HeaderError(f"{path.name} is shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > SAFETENSORS_HEADER_MAX or length > os.fstat(f.fileno()).st_size - 8:
                raise HeaderError(f"{path.name} does not start with a safetensors header (it says {length:,} bytes)")
            raw = f.read(length)
    except OSError as error:
        raise HeaderError(f"{path.name} cannot be read: {error.strerror or error}") from None
    try:
        table = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HeaderError(f"{path.name}'s safetensors header is not JSON") from None
    if not isinstance(table, dict):
        raise HeaderError(f"{path.name}'s safetensors header is not a table of tensors")
    types: dict[str, int] = {}
    tensors = 0
    for name, info in table.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or "dtype" not in info:
            raise HeaderError(f"{path.name}'s safetensors header says nothing of {name!r}'s dtype")
        offsets = info.get("data_offsets") or [0, 0]
        try:
            size = int(offsets[1]) - int(offsets[0])
        except (TypeError, ValueError, IndexError):
            raise HeaderError(f"{path.name}'s safetensors header has no byte range for {name!r}") from None
        dtype = str(info["dtype"])
        types[dtype] = types.get(dtype, 0) + size
        tensors += 1
    return {"tensors": tensors, "tensor_types": types, "weights_bytes": sum(types.values())}


def read_config(path: Path) -> dict:
    """The shape a Hugging Face `config.json` gives, in the names a GGUF header's are kept under."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise HeaderError(f"{path.name} is not a JSON file llmgw can read") from None
    if not isinstance(config, dict):
        raise HeaderError(f"{path.name} is not a JSON object")
    # Multimodal configs keep the language model's shape under text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out: dict = {}
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        out["architecture"] = str(architectures[0])
    elif config.get("model_type"):
        out["architecture"] = str(config["model_type"])
    for key, names in CONFIG_KEYS.items():
        for name in names:
            value = text.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
                break
    if isinstance(text.get("torch_dtype") or config.get("torch_dtype"), str):
        out["dtype"] = text.get("torch_dtype") or config.get("torch_dtype")
    return out


# --- a version ----------------------------------------------------------------------


def _merge_tensors(into: dict, part: dict) -> None:
    into["tensors"] = into.get("tensors", 0) + part.get("tensors", 0)
    into["weights_bytes"] = into.get("weights_bytes", 0) + part.get("weights_bytes", 0)
    types = into.setdefault("tensor_types", {})
    for name, size in part.get("tensor_types", {}).items():
        types[name] = types.get(name, 0) + size
    into["tensor_types"] = dict(sorted(types.items(), key=lambda kv: -kv[1]))


def read_version(paths: Mapping[str, Path]) -> dict:
    """The headers of one version's files, merged into one summary.

    `format` is gguf or safetensors (or "" when neither is there); the shape comes
    from the first GGUF part (the one llama.cpp opens) or from config.json; tensors
    and bytes are summed over every part. `error` says why a header could not be read.
    """
    names = sorted(paths)
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    safetensors = [n for n in names if n.lower().endswith(".safetensors")]
    summary: dict = {"format": ""}
    try:
        if ggufs:
            summary["format"] = "gguf"
            for i, name in enumerate(ggufs):
                part = read_gguf(paths[name])
                if i == 0:
                    summary.update(
                        {k: v for k, v in part.items() if k not in ("tensors", "tensor_types", "weights_bytes")}
                    )
                _merge_tensors(summary, part)
            summary["files"] = ggufs
        elif safetensors:
            summary["format"] = "safetensors"
            for name in safetensors:
                _merge_tensors(summary, read_safetensors(paths[name]))
            summary["files"] = safetensors
            if "config.json" in names:
                summary.update(read_config(paths["config.json"]))
    except HeaderError as error:
        summary["error"] = str(error)
    if summary.get("heads") and summary.get("embedding") and not summary.get("head_dim"):
        summary["head_dim"] = summary["embedding"] // summary["heads"]
    return summary


def stale_versions():
    """Versions whose headers were never read, or were read before a scan last found them changed."""
    return MirrorVersion.objects.filter(Q(headers_read__isnull=True) | Q(headers_read__lt=F("scanned_at")))


# Whether this process has looked for versions whose headers were never read (indexed
# before headers were, or read by a worker that died): once per process, so a scan of an
# unchanged mirror stays the one query it is (docs/mirror.md).
_looked_for_unread = False


def read_changed(report) -> int:
    """Read the headers of every version the scan added or changed; how many were read.

    Called by the scan after it has written the index: nothing to do, and no query, when
    it found nothing new (after the first scan of a process, which also reads what was
    never read). Each changed version costs its files' headers and one write.
    """
    global _looked_for_unread
    if not (report.added or report.changed) and _looked_for_unread:
        return 0
    _looked_for_unread = True
    read = []
    now = timezone.now()
    for version in stale_versions().prefetch_related("files"):
        # Through disk.resolve, as the byte listener serves them: a link out of the root is not followed.
        paths = {f.name: disk.resolve(version.model, version.version, f.name) for f in version.files.all()}
        try:
            summary = read_version({name: path for name, path in paths.items() if path is not None})
        except Exception as error:  # whatever a header trips on, the version stays indexed and says why
            log.exception("mirror scan: the headers of %s could not be read", version)
            summary = {"format": "", "error": f"the headers could not be read ({type(error).__name__}: {error})"}
        if summary.get("error"):
            log.warning("mirror scan: %s: %s", version, summary["error"])
        read.append(MirrorVersion(pk=version.pk, headers=summary, headers_read=now))
    # In one statement per batch, like the scan's own writes.
    MirrorVersion.objects.bulk_update(read, ["headers", "headers_read"], batch_size=500)
    return len(read)
