"""What the weights say about themselves: GGUF and safetensors headers read when the mirror indexes a version."""

from __future__ import annotations

import json
import struct

import pytest
from rest_framework.test import APIClient

from launcher.demo_model import write_tiny_llama
from mirror import scan
from mirror.models import MirrorVersion

from .support.mirror import settle
from .weights import write_gqa_gguf, write_safetensors

pytestmark = pytest.mark.django_db


def test_a_gguf_s_shape_and_tensor_bytes_are_read_when_the_version_is_indexed(mirror_root):
    weights = write_gqa_gguf(mirror_root / "gqa" / "q8" / "gqa.gguf")
    settle(mirror_root)  # copied in a while ago: a file still being written is not read (LLMGW_MIRROR_SETTLE_S)
    scan.scan_mirror()
    headers = MirrorVersion.objects.get(model="gqa").headers
    assert headers["format"] == "gguf"
    assert headers["architecture"] == "llama"
    assert (headers["layers"], headers["heads"], headers["kv_heads"], headers["embedding"]) == (3, 8, 2, 128)
    assert headers["head_dim"] == 16
    assert headers["trained_context"] == 4096
    assert set(headers["tensor_types"]) == {"Q8_0", "F32"}
    assert headers["weights_bytes"] == weights == sum(headers["tensor_types"].values())
    assert "error" not in headers


def test_a_gguf_in_three_parts_is_read_as_one_model(mirror_root):
    parts = write_tiny_llama(mirror_root / "tiny" / "v1", files=3)
    settle(mirror_root)
    scan.scan_mirror()
    headers = MirrorVersion.objects.get(model="tiny").headers
    assert headers["files"] == [p.name for p in parts]
    assert headers["split_count"] == 3
    assert (headers["layers"], headers["heads"], headers["kv_heads"], headers["embedding"]) == (2, 4, 4, 64)
    # Every part's tensors, F32 all: the 2 layers, the embeddings and the output.
    assert headers["tensor_types"] == {"F32": headers["weights_bytes"]}
    assert headers["tensors"] == 2 * 9 + 3


def test_a_safetensors_set_is_read_with_its_config(mirror_root):
    version = mirror_root / "st" / "bf16"
    first = write_safetensors(
        version / "model-00001-of-00002.safetensors",
        {"embed.weight": ("BF16", [1000, 64]), "layers.0.q.weight": ("BF16", [64, 64])},
    )
    second = write_safetensors(
        version / "model-00002-of-00002.safetensors",
        {"layers.1.q.weight": ("BF16", [64, 64]), "norm.weight": ("F32", [64])},
    )
    (version / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 64,
                "max_position_embeddings": 32768,
                "torch_dtype": "bfloat16",
            }
        )
    )
    settle(mirror_root)
    scan.scan_mirror()
    headers = MirrorVersion.objects.get(model="st").headers
    assert headers["format"] == "safetensors"
    assert headers["tensors"] == 4
    assert headers["tensor_types"] == {"BF16": first + second - 64 * 4, "F32": 64 * 4}
    assert headers["weights_bytes"] == first + second
    assert headers["architecture"] == "Qwen2ForCausalLM"
    assert (headers["layers"], headers["heads"], headers["kv_heads"], headers["embedding"]) == (2, 4, 2, 64)
    assert headers["trained_context"] == 32768
    assert headers["head_dim"] == 16


def test_a_file_whose_header_cannot_be_read_is_indexed_with_the_reason_shown(mirror_root, admin_client):
    (mirror_root / "broken" / "v1").mkdir(parents=True)
    (mirror_root / "broken" / "v1" / "model.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    (mirror_root / "broken" / "v2").mkdir(parents=True)
    (mirror_root / "broken" / "v2" / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    settle(mirror_root)
    report = scan.scan_mirror()
    assert sorted(report.added) == ["broken/v1", "broken/v2"]
    v1 = MirrorVersion.objects.get(version="v1")
    assert v1.files.count() == 1
    assert "model.gguf is not a GGUF file llmgw can read" in v1.headers["error"]
    v2 = MirrorVersion.objects.get(version="v2")
    assert "does not start with a safetensors header" in v2.headers["error"]
    page = admin_client.get(f"/admin/mirror/mirrorversion/{v1.pk}/change/").content.decode()
    assert 'id="header-error"' in page
    assert "The header could not be read: model.gguf is not a GGUF file" in page


def test_a_changed_file_is_read_again_and_an_unchanged_one_is_not(mirror_root):
    path = mirror_root / "gqa" / "q8" / "gqa.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a copy")
    settle(path)
    scan.scan_mirror()
    assert "error" in MirrorVersion.objects.get().headers
    read_at = MirrorVersion.objects.get().headers_read
    scan.scan_mirror()
    assert MirrorVersion.objects.get().headers_read == read_at
    write_gqa_gguf(path)
    settle(path)
    scan.scan_mirror()
    headers = MirrorVersion.objects.get().headers
    assert "error" not in headers and headers["kv_heads"] == 2


def test_the_version_page_and_the_api_show_the_header(mirror_root, admin_client, admin_user):
    write_gqa_gguf(mirror_root / "gqa" / "q8" / "gqa.gguf")
    settle(mirror_root)
    scan.scan_mirror()
    version = MirrorVersion.objects.get()
    page = admin_client.get(f"/admin/mirror/mirrorversion/{version.pk}/change/").content.decode()
    assert 'id="weights-header"' in page
    assert "<th>KV heads</th><td>2</td>" in page
    assert "<th>trained context</th><td>4096</td>" in page
    assert "Q8_0" in page
    api = APIClient()
    api.force_authenticate(admin_user)
    detail = api.get(f"/api/mirror/versions/{version.pk}/").json()
    assert detail["headers"]["kv_heads"] == 2
    assert detail["headers"]["tensor_types"]["Q8_0"] > 0
