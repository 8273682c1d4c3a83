"""Usage per key, model and day: counted in memory as answers finish, written in batches.

A database write per request would cost more than the rest of the gateway
together; the counts are added up here and written by the gateway's database
thread with each refresh, and once more at shutdown.
"""

from __future__ import annotations

import re
import threading
from datetime import date

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from .models import ApiKey, Usage

USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# How far after `"usage": {` the counts may be; usage objects are a few hundred bytes at most.
USAGE_SPAN = 2048


def tokens_in(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) from the last usage object in an answer's tail, or None if it has none.

    Works alike on a JSON body and on an event stream, where the usage object
    comes with the last chunk; the engine's counts are taken as they are.
    """
    found = list(USAGE_OBJECT.finditer(tail))
    if not found:
        return None
    last = found[-1]
    span = tail[last.end() : last.end() + USAGE_SPAN]
    prompt, completion = PROMPT_TOKENS.search(span), COMPLETION_TOKENS.search(span)
    if prompt is None and completion is None:
        return None
    return int(prompt.group(1)) if prompt else 0, int(completion.group(1)) if completion else 0


class Recorder:
    """Counts kept until the next flush. add() is called on the event loop, flush() in a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str, date], list[int]] = {}

    def add(self, key_id: int, model: str, prompt: int, completion: int) -> None:
        day = timezone.localdate()
        with self._lock:
            counts = self._counts.setdefault((key_id, model, day), [0, 0, 0])
            counts[0] += 1
            counts[1] += prompt
            counts[2] += completion

    def pending(self) -> int:
        with self._lock:
            return len(self._counts)

    def flush(self) -> None:
        """Write what has been counted. Runs in a thread: it uses the database."""
        with self._lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return
        try:
            with transaction.atomic():
                # A key deleted since its requests were counted takes its usage with it.
                live = set(ApiKey.objects.filter(pk__in={k for k, _, _ in counts}).values_list("pk", flat=True))
                for (key_id, model, day), (requests, prompt, completion) in counts.items():
                    if key_id not in live:
                        continue
                    row, _ = Usage.objects.get_or_create(key_id=key_id, model_name=model, day=day)
                    Usage.objects.filter(pk=row.pk).update(
                        requests=F("requests") + requests,
                        prompt_tokens=F("prompt_tokens") + prompt,
                        completion_tokens=F("completion_tokens") + completion,
                    )
                ApiKey.objects.filter(pk__in=live).update(last_used=timezone.now())
        except Exception:
            # Not written this time: put the counts back so the next flush carries them.
            with self._lock:
                for where, (requests, prompt, completion) in counts.items():
                    mine = self._counts.setdefault(where, [0, 0, 0])
                    mine[0] += requests
                    mine[1] += prompt
                    mine[2] += completion
            raise
