"""Per-key limits, kept in Redis so that every gateway process, on every host, counts against the same numbers.

A key with no limits costs nothing here: the gateway does not call Redis for it.
A key with limits waits for one reply before its request goes on (unless it is far below
its limits: then it goes on at once and the reply is heard later, `limiter.Heard`): a Lua script
that reads the key's windows, refuses when one is full, and otherwise counts the
request and marks it in flight, atomically, so two processes cannot both take
the last request of a minute. After the answer, its tokens (from the engine's
usage) are added to the windows and the in-flight mark removed; that write is
sent after the client has its answer, and is not waited for. The requests of one
turn of the event loop share those scripts (one admission and one settling a key,
see Limiter), which is what makes a limited request cost little more than one
without limits.

Windows are fixed: the minute, the UTC day and the UTC month, each a counter
under its own Redis key that expires after the window.

Admission comes in two steps, so that a request the key may not make costs
nothing. Before its body is read, ADMIT counts the request and marks it in
flight (and refuses a key whose token windows are full already). Once the body
is read, a key with token limits has RESERVE add to its token windows what the
request may cost at most: its prompt by the body's size and the most tokens its
answer may have (the max_tokens the gateway sends, intake.check_limits), refused
when that does not fit. For a small body the two go in one round trip: the body
is read while ADMIT is on its way and RESERVE is queued in the same batch, holding
nothing for a request not in flight (one ADMIT refused). Settling replaces the
reservation with the answer's tokens. So concurrent requests cannot together go past a token window: each
holds its share of it while it runs.

The package by topic: `Limiter` in `limiter` (the batches sent and each request's answer), `scripts`
(the Lua scripts and the numbers they share), `windows` (a key's limits, its team's budgets, the
windows they are counted in, and what was used in them), `refusals` (the 429s and their headers) and
`connection` (the one connection to Redis and its watchdog).
"""

from .limiter import Limiter, Ticket
from .scripts import BATCH
from .windows import (
    BUDGET_FIELDS,
    LIMIT_FIELDS,
    MICRO,
    Budget,
    Limits,
    Windows,
    budget_of,
    calendar,
    of,
    tag_of,
    team_used_now,
    used_now,
)

__all__ = [
    "BATCH",
    "BUDGET_FIELDS",
    "LIMIT_FIELDS",
    "MICRO",
    "Budget",
    "Limiter",
    "Limits",
    "Ticket",
    "Windows",
    "budget_of",
    "calendar",
    "of",
    "tag_of",
    "team_used_now",
    "used_now",
]
