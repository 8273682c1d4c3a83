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

from .intake import prompt_texts
from .models import ApiKey, Usage
from .relay import TAIL_BYTES

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


# A streamed chunk that carries generated text: a chat delta's "content" or a completion's
# "text", not empty, as engines write JSON (no space or one after the colon). llama.cpp and
# vLLM send one token a chunk. A literal start lets the regex engine skip ahead: about half
# a microsecond a chunk.
GENERATED = {
    "/v1/chat/completions": re.compile(rb'"content": ?"[^"]'),
    "/v1/completions": re.compile(rb'"text": ?"[^"]'),
}
# The end of the last chunk kept to find a match split between two chunks: a match is at most 14 bytes.
CARRY_BYTES = 16
# Characters a token, by OpenAI's rule of thumb, counted in UTF-8 bytes so that a script
# of many bytes a character (CJK: about one token each) is not billed at a quarter.
BYTES_PER_TOKEN = 4


class Answer:
    """What the gateway saw of one answer on its way through: its end, and the text chunks streamed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tail = b""
        self.event_stream = False
        self.generated = 0
        self._pattern = GENERATED.get(path)
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        if self.event_stream and self._pattern is not None:
            window = self._carry + chunk
            # A match wholly inside the carry was counted with the chunk before.
            self.generated += len(self._pattern.findall(window)) - len(self._pattern.findall(self._carry))
            self._carry = window[-CARRY_BYTES:]

    def tokens(self, request: dict) -> tuple[int, int]:
        """(prompt, completion): the engine's own count, or what was relayed of a stream cut short."""
        counted = tokens_in(self.tail)
        if counted is not None:
            return counted
        if not self.event_stream:
            return 0, 0
        # The usage chunk comes last and never came. The engine's count is gone with the
        # connection; asking it again would cost a request to an engine for each hang-up.
        size = sum(len(text.encode("utf-8", "replace")) for text in prompt_texts(self.path, request))
        return -(-size // BYTES_PER_TOKEN), self.generated


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
