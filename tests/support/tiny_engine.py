"""The real llama-server on the tiny GGUF, known to the catalog and the fleet as a ready replica,
so a real gateway routes to it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from agent import engines
from catalog.models import Model, Profile
from fleet.models import Node, Replica

from .. import real_model


@contextmanager
def serving_tiny_model(tiny_gguf: Path, log_dir: Path):
    """The engine running and routed as real_model.MODEL while inside; stopped afterwards."""
    process, endpoint, _ = real_model.start_engine(tiny_gguf, log_dir)
    try:
        model = Model.objects.create(name=real_model.MODEL, source="http://127.0.0.1:1/tiny/", context_length=2048)
        Profile.objects.create(model=model, name="cpu", engine="llamacpp")
        Replica.objects.create(
            model_name=real_model.MODEL,
            profile_name="cpu",
            node=Node.objects.create(name="n1"),
            state="ready",
            endpoint=endpoint,
        )
        yield endpoint
    finally:
        engines.stop_group(process.pid, grace=5)
