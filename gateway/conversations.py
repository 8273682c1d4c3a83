"""Where each conversation started, for prefix routing: this process's placements and every other gateway's.

A conversation's first turn starts on the replica with the fewest requests in flight
(gateway/prefix.py `open_new`); its later turns must find that replica, which the ring
alone no longer names. So each process keeps, by the key's place on the ring, the replica
a conversation started on, or ON_RING when that was the key's owner (the ring finds it,
and keeps finding it as replicas join and leave, as before). What this process places is
appended to the Redis stream contracts.demand.CONVERSATIONS_KEY by the demand writer
(gateway/demand.py) about once a second, and what the others placed is read back in the
same round trip, so a later turn that reaches another gateway process a second or more
after the first finds its replica too. Sooner, or with Redis away, it goes to the key's
owner, as every turn did before: a cache missed, never a request refused.

Only a conversation's first turn is placed by load, and only when no gateway has placed
its key: a hot opening that many clients send is placed once and then bounded as any
conversation is. The table is bounded (MOST, least recently used out), as is the stream.
"""

from __future__ import annotations

from collections import OrderedDict

# The conversations a process remembers: about 100 bytes each in memory.
MOST = 200_000
# The key's owner on the ring: what a record says when the conversation started there.
ON_RING = 0


class Conversations:
    """Used on the gateway's event loop only (the demand writer hands over what it read)."""

    def __init__(self, most: int = MOST) -> None:
        self.most = most
        self._started: OrderedDict[int, int] = OrderedDict()
        self._unsent: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._started)

    def started_on(self, point: int) -> int | None:
        """The replica the conversation started on, ON_RING for its owner, None when no gateway placed it."""
        replica = self._started.get(point)
        if replica is not None:
            self._started.move_to_end(point)
        return replica

    def started(self, point: int, replica: int) -> None:
        """This process placed a conversation's first turn: remembered here, and told to the others."""
        self._remember(point, replica)
        self._unsent.append((point, replica))

    def heard(self, placed: list[tuple[int, int]]) -> None:
        """What other gateway processes placed, oldest first."""
        for point, replica in placed:
            self._remember(point, replica)

    def take_unsent(self) -> list[tuple[int, int]]:
        unsent, self._unsent = self._unsent, []
        return unsent

    def _remember(self, point: int, replica: int) -> None:
        self._started[point] = replica
        self._started.move_to_end(point)
        if len(self._started) > self.most:
            self._started.popitem(last=False)


def encode(placed: list[tuple[int, int]]) -> str:
    """A stream entry's placements: `point:replica` pairs, comma-separated (points in hex)."""
    return ",".join(f"{point:x}:{replica}" for point, replica in placed)


def decode(raw: bytes | str) -> list[tuple[int, int]]:
    """The placements of a stream entry; a malformed pair (another version's, a hand's) is skipped."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    placed = []
    for pair in text.split(","):
        point, _, replica = pair.partition(":")
        try:
            placed.append((int(point, 16), int(replica)))
        except ValueError:
            continue
    return placed
