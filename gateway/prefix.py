"""Which replica takes a conversation: consistent hashing on its prefix, bounded by load (CHWBL).

Every turn of a chat resends the whole conversation, and an engine that holds its
start in its KV cache skips that prefill. Least-in-flight scatters one conversation
over every replica, so each prefills it again and their caches evict each other.
Here a request's key is the start of its conversation; the key's place on a ring of
the model's replicas names the replica that has it, unless that replica already has
more than its share of the requests in flight (the bound), and then the next replica
on the ring takes it (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with
Bounded Loads", 2018; what KubeAI, llm-d and vLLM's production-stack do).

The bound is the larger of two (issue 39): what the replica serves at once (its slots, by a
margin) and the paper's share of the model's load (its mean, by a factor). The mean alone
spilled turns away from their cache while the replica still had free slots: 8 clients on 4
replicas of 4 slots gave a bound of 3, and a spilled turn is a whole prefill elsewhere, where
waiting for a slot it already had was free. The slots alone would let one hot conversation
fill a replica's queue while the others idle once the model is busy everywhere: then the
mean is larger and keeps the load even.

The ring is made from the routing table alone (replica ids and weights), so every
gateway process on every host builds the same one and sends a conversation to the
same replica without talking to the others; a replica that joins or leaves moves
only the keys that fall on its own points.

A conversation's first turn has nothing cached anywhere, so it need not go to its owner:
it starts on the replica with the fewest requests in flight (the owner when it is among
them), and where it started is remembered (gateway/conversations.py, shared by every
gateway process through Redis) for its later turns. Placed by hash alone, 16 new
conversations fell 11 / 8 / 4 / 9 on four replicas, and first turns queued behind each
other on one while another idled (issue 39, bench/prefix.py at 2 turns).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from .endpoints import ENDPOINTS


class Upstream(Protocol):
    """What the ring needs of a replica (routes.Upstream, which imports this module)."""

    replica_id: int
    weight: int
    slots: int


# Points on the ring per replica (per unit of weight). With 128 the share of keys each of
# two to ten replicas owns is within about 10% of its fair share, and a table change
# builds the ring in well under a millisecond.
POINTS = 128
# A weight counts for at most this many times POINTS on the ring; the bound uses it whole.
MOST_WEIGHT_POINTS = 8

# What the key is made of: the messages up to and including the first from the user (the
# system prompt, a developer message, the opening question), at most KEY_MESSAGES of them,
# each cut to KEY_CHARS characters. That part is the same in every turn of a conversation,
# so every turn has the key of the first; two conversations that share a long system prompt
# but open differently still get keys of their own (and are spread), while one opening sent
# by many clients is one hot key, which the bound spills. 512 characters is about 128
# tokens a message: enough to tell system prompts and openings apart, and the key costs a
# couple of microseconds however long the conversation grows, never the whole body.
KEY_MESSAGES = 4
KEY_CHARS = 512

# Why a request went where it went: the request log and the replica's page say these.
PREFIX = "prefix"  # the replica the key's place on the ring names
BOUNDED = "prefix, bounded → next"  # that one was past the bound; a later one on the ring took it
UNREACHABLE = "prefix, unreachable → next"  # that one refused a connection a moment ago; the next took it
NEW = "prefix, new → fewest in flight"  # a first turn no gateway had seen, where the fewest were in flight
LOAD = "load"  # the fewest requests in flight: a model routed by load, or a request with no conversation
REASONS = (PREFIX, BOUNDED, UNREACHABLE, NEW, LOAD)

# The addresses routed by prefix: those that reach the engine as a chat completion
# (chat completions, and Anthropic's messages and OpenAI's responses translated to one).
BY_PREFIX = frozenset(path for path, e in ENDPOINTS.items() if e.engine_path == "/chat/completions")


def point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _text(content) -> str:
    if isinstance(content, str):
        return content[:KEY_CHARS]
    if isinstance(content, list):
        parts, size = [], 0
        for part in content:
            # Never str() of a whole object: a part may be megabytes, and the key must cost microseconds.
            if isinstance(part, dict):
                text, kind = part.get("text"), part.get("type")
                text = text if isinstance(text, str) else f"<{kind[:KEY_CHARS] if isinstance(kind, str) else ''}>"
            else:
                text = part if isinstance(part, str) else f"<{type(part).__name__}>"
            parts.append(text[: KEY_CHARS - size])
            size += len(parts[-1])
            if size >= KEY_CHARS:
                break
        return "".join(parts)
    return ""


class Conversation(NamedTuple):
    key: bytes  # the start of the conversation, the same in every turn
    opening: bool  # the body is only that start (a first turn): no replica has anything of it yet


def conversation_of(request: dict) -> Conversation | None:
    """The conversation of a chat-completions body, or None when it has none."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    pieces = []
    for message in messages[:KEY_MESSAGES]:
        if not isinstance(message, dict):
            break
        role = message.get("role")
        role = role[:KEY_CHARS] if isinstance(role, str) else ""
        pieces.append(f"{role}\x00{_text(message.get('content'))}\x01")
        if role == "user":
            break
    if not pieces:
        return None
    key = "".join(pieces).encode("utf-8", "surrogatepass")
    return Conversation(key, len(pieces) == len(messages) and role == "user")


def placed_as(model: str, key: bytes) -> int:
    """A conversation's name in the table of where conversations started: its model's and its key's."""
    return point(model.encode() + b"\x02" + key)


def key_of(request: dict) -> bytes | None:
    """The key of a chat-completions body: the start of its conversation, or None when it has none."""
    conversation = conversation_of(request)
    return conversation.key if conversation is not None else None


class Ring:
    """The replicas of one model on a hash ring; built once per table, read by every request."""

    def __init__(self, upstreams: tuple[Upstream, ...]) -> None:
        # Weight 0 is a standby: on the ring only when nothing else is.
        members = [u for u in upstreams if u.weight > 0] or list(upstreams)
        self.members = tuple(members)
        self.weights = tuple(max(u.weight, 1) for u in members)
        placed = []
        for index, upstream in enumerate(members):
            for n in range(POINTS * min(self.weights[index], MOST_WEIGHT_POINTS)):
                placed.append((point(f"{upstream.replica_id}#{n}".encode()), upstream.replica_id, index))
        placed.sort()  # a tie between two replicas' points goes the same way in every gateway: by replica id
        self._points = [p for p, _, _ in placed]
        self._owners = [index for _, _, index in placed]

    def walk(self, key: bytes) -> Iterator[int]:
        """The members' indices in the order the ring meets them from the key's place, each once."""
        if not self._points:
            return
        start = bisect_right(self._points, point(key))
        seen: set[int] = set()
        count = len(self._points)
        for i in range(count):
            index = self._owners[(start + i) % count]
            if index not in seen:
                seen.add(index)
                yield index
                if len(seen) == len(self.members):
                    return

    def owner(self, key: bytes) -> int:
        """The replica id the key belongs to when no replica is past the bound."""
        return self.members[next(self.walk(key))].replica_id


def choose(
    ring: Ring,
    key: bytes,
    load_of: Callable[[int], int],
    unusable: Callable[[int], bool],
    bound: float,
    margin: float = 0.0,
    started_on: int | None = None,
) -> tuple[Upstream, str] | None:
    """The replica for `key` and why, or None when every member is unusable.

    A member takes the request while its load plus this request stays within the larger of
    ceil(margin × its slots) and ceil(bound × (the model's load + 1) × its weight ÷ the
    members' weights), the paper's capacity; with bound ≥ 1 some member always has room. `load_of` is a
    replica's requests in flight, every gateway's; `unusable` is true of a replica
    already tried for this request or cooling after a refused connection. `started_on` is the
    replica the conversation started on when that was not its owner (`open_new`): it is asked
    first, then the ring from the key's place.
    """
    members, weights = ring.members, ring.weights
    total = sum(load_of(u.replica_id) for u in members)
    all_weight = sum(weights)
    skipped_for_load = skipped_unusable = False
    for index in _order(ring, key, started_on):
        upstream = members[index]
        if unusable(upstream.replica_id):
            skipped_unusable = True
            continue
        capacity = max(math.ceil(margin * upstream.slots), math.ceil(bound * (total + 1) * weights[index] / all_weight))
        if load_of(upstream.replica_id) + 1 <= capacity:
            if skipped_for_load:
                return upstream, BOUNDED
            return upstream, UNREACHABLE if skipped_unusable else PREFIX
        skipped_for_load = True
    return None


def _order(ring: Ring, key: bytes, started_on: int | None) -> Iterator[int]:
    """The members' indices to ask: the one the conversation started on, if any and still a member, then the ring's."""
    first = next((i for i, u in enumerate(ring.members) if u.replica_id == started_on), None)
    if first is not None:
        yield first
    yield from (index for index in ring.walk(key) if index != first)


def open_new(
    ring: Ring,
    key: bytes,
    load_of: Callable[[int], int],
    unusable: Callable[[int], bool],
    own_load_of: Callable[[int], int] | None = None,
) -> tuple[Upstream, str] | None:
    """Where a conversation no gateway has seen starts: the usable member with the fewest requests in
    flight for its weight, ties going the ring's way from the key (so an idle model starts it on its owner).

    Its first turn has nothing cached anywhere, so it costs as much everywhere, and the least busy
    replica starts it soonest. Within the bound by construction: the least loaded member is at or
    under the mean.

    `own_load_of`: this process's own requests in flight, counted now, where `load_of` adds every
    other gateway's as of its last write (a second old at most). It leaves its owner only when the
    owner is busier in both: a count a second old may be of requests that ended since (a client
    whose last answer came through another gateway a moment ago), and a conversation moved for it
    would leave its owner idle for nothing.
    """
    best = best_score = owner = None
    first_usable = None
    for rank, index in enumerate(ring.walk(key)):
        upstream = ring.members[index]
        if unusable(upstream.replica_id):
            continue
        if first_usable is None:
            first_usable, owner, owner_weight = rank, upstream, ring.weights[index]
        score = (load_of(upstream.replica_id) + 1) / ring.weights[index]
        if best is None or score < best_score:
            best, best_score, best_rank, best_weight = upstream, score, rank, ring.weights[index]
    if best is None:
        return None
    if best_rank != first_usable:
        own = own_load_of or load_of
        if (own(owner.replica_id) + 1) / owner_weight > (own(best.replica_id) + 1) / best_weight:
            return best, NEW
        best, best_rank = owner, first_usable
    return best, PREFIX if best_rank == 0 else UNREACHABLE
