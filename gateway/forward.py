"""Forwarding: a routed request to a replica and its answer back to the client.

`Forwarding` is part of `Gateway` (gateway/app.py), kept apart by topic: which
replica takes a request (`pick`), the tries across replicas (`forward`), and the
wait for one when none can take it (`answer`, gateway/hold.py). It uses the
gateway's table, holding, demand, observer, usage, session and its counts of
requests in flight and of replicas cooling.
"""

from __future__ import annotations

import logging
import time
from decimal import Decimal
from typing import TYPE_CHECKING

import aiohttp
from django.conf import settings

from contracts.credentials import bearer

from . import hold, metrics, prefix, prospects, routes
from .conversations import ON_RING
from .endpoints import CHAT
from .errors import Refusal
from .intake import sentence_of
from .relay import relay
from .usage import Answer, cost, micro_units

if TYPE_CHECKING:
    from .request import Request

log = logging.getLogger("llmgw.gateway")

# A replica that refused a connection is tried last for this long, so one dead
# engine costs one failed connect, not one per request, until the table says so.
COOLDOWN_S = 5.0


class Forwarding:
    async def answer(self, request: Request) -> tuple[int, int]:
        """forward(), after waiting for a usable replica when there is none (gateway/hold.py)."""
        deadline = None
        unreachable = None
        waited = False
        while True:
            route = request.route = self.table.routes.get(request.route.name, request.route)
            # The first try goes to a replica that refused a moment ago as well, as it always did;
            # a newcomer queues behind requests still being let go, first come first served.
            if (
                not route.upstreams
                or (not waited and route.name in self.holding.queues)
                or (unreachable is not None and not hold.usable(route, self.cooling, time.monotonic()))
            ):
                if not settings.HOLD_S and unreachable is not None:
                    raise unreachable
                prospect = await self.holding.prospect(route.name)
                if prospect.state == prospects.CANNOT:
                    raise unreachable or hold.unavailable(prospect.reason + ".")
                if deadline is None:
                    deadline = time.monotonic() + settings.HOLD_S
                also = f"The last try: {unreachable.message}" if unreachable is not None else ""
                await self.holding.wait(
                    route.name, request.hang_up.gone, request.held, deadline, prospect, also, request.key.id
                )
                waited = True
                continue
            self.demand.started(route.name)
            try:
                return await self.forward(request)
            except Refusal as refusal:
                if not getattr(refusal, "engine_down", False):
                    raise
                # Every replica refused the connection (an engine killed, a node lost): wait for one as above.
                unreachable = refusal
            finally:
                self.demand.finished(route.name)

    def pick(
        self, route: routes.Route, tried: set[int], conversation: prefix.Conversation | None
    ) -> tuple[routes.Upstream | None, str]:
        """The replica for this request and why (gateway/prefix.py): by its conversation, else by load."""
        if conversation is not None and route.ring is not None:
            now = time.monotonic()

            def unusable(replica: int) -> bool:
                return replica in tried or self.cooling.get(replica, 0.0) > now

            name = prefix.placed_as(route.name, conversation.key)
            started_on = self.conversations.started_on(name)
            if started_on is None and conversation.opening and settings.PREFIX_OPEN_BY_LOAD:
                chosen = prefix.open_new(route.ring, conversation.key, self.load_of, unusable, self.own_load_of)
                if chosen is not None:
                    upstream, why = chosen
                    self.conversations.started(name, ON_RING if why == prefix.PREFIX else upstream.replica_id)
                    return chosen
            chosen = prefix.choose(
                route.ring,
                conversation.key,
                self.load_of,
                unusable,
                settings.PREFIX_LOAD_BOUND,
                settings.PREFIX_SLOT_MARGIN,
                started_on=started_on or None,
            )
            if chosen is not None:
                return chosen
        return self.least_in_flight(route.upstreams, tried), prefix.LOAD

    def load_of(self, replica: int) -> int:
        """A replica's requests in flight: this process's now, and every other gateway's as of its last write."""
        return self.in_flight.get(replica, 0) + self.demand.others.get(replica, 0)

    def own_load_of(self, replica: int) -> int:
        """A replica's requests in flight from this process, now."""
        return self.in_flight.get(replica, 0)

    def least_in_flight(self, upstreams: tuple[routes.Upstream, ...], tried: set[int]) -> routes.Upstream | None:
        """The replica with the fewest requests in flight for its weight; cooling ones last."""
        now = time.monotonic()
        best, best_score = None, 0.0
        count = len(upstreams)
        self._turn += 1
        for i in range(count):
            upstream = upstreams[(self._turn + i) % count]
            if upstream.replica_id in tried:
                continue
            in_flight = self.in_flight.get(upstream.replica_id, 0)
            # Weight 0 is a standby: behind every replica that has a weight, however busy.
            score = (in_flight + 1) / upstream.weight if upstream.weight else 1e6 + in_flight
            if self.cooling.get(upstream.replica_id, 0.0) > now:
                score += 1e9
            if best is None or score < best_score:
                best, best_score = upstream, score
        return best

    async def forward(self, request: Request) -> tuple[int, int]:
        """Pass the request to a replica and its answer back; returns the answer's tokens and its cost in
        micro-units (gateway/limits/windows.py MICRO), for its key's limits and its team's budgets."""
        scope, route = request.scope, request.route
        tried: set[int] = set()
        resent: set[int] = set()
        failures = []
        refused_secret = False
        by_prefix = route.ring is not None and scope["path"] in prefix.BY_PREFIX
        conversation = prefix.conversation_of(request.payload) if by_prefix else None
        while True:
            upstream, why = self.pick(route, tried, conversation)
            if upstream is None:
                raise _unreachable(route.name, failures, refused_secret)
            tried.add(upstream.replica_id)
            replica = upstream.replica_id
            self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
            try:
                sent_at = time.perf_counter()
                try:
                    response = await self._post(request, upstream, fresh=replica in resent)
                except aiohttp.ClientConnectionError as error:
                    if not isinstance(error, aiohttp.ClientConnectorError) and replica not in resent:
                        # Connected, then dropped before a byte of answer: a kept-alive connection the
                        # engine let go as it was reused (cpp-httplib does, under load). The engine is
                        # well; the request goes to it again once, on a new connection, as HTTP
                        # clients resend on a reused connection (at worst the engine works twice).
                        # On a new connection: the pool may hold others the engine let go (all of
                        # them, when it has closed them at once), and the next of those would fail too.
                        resent.add(replica)
                        tried.discard(replica)
                        continue
                    # Nothing came back from this one, so the request can go to another.
                    failures.append(self._unanswered(scope, upstream, error))
                    continue
                if response.status == 401:
                    # The engine does not take this replica's secret (its node re-enrolled or was revoked, and it
                    # runs on with the old one): its 401 is not the client's, and another replica may answer.
                    response.close()
                    self.cooling[replica] = time.monotonic() + COOLDOWN_S
                    log.warning("replica %s refused the gateway's replica secret (401)", replica)
                    failures.append(f"replica {replica} at {upstream.base} refused the gateway's replica secret")
                    refused_secret = True
                    continue
                self.cooling.pop(replica, None)
                return await self._relay_and_count(request, response, replica, sent_at - request.started, why)
            finally:
                self.in_flight[replica] -= 1

    async def _post(self, request: Request, upstream: routes.Upstream, fresh: bool) -> aiohttp.ClientResponse:
        """Send the request to one replica (on a new connection when `fresh`); its answer's headers."""
        session = self._fresh_session if fresh else self._session
        try:
            return await session.post(
                upstream.base + request.endpoint.engine_path,
                data=request.body,
                headers={
                    "Content-Type": "application/json",
                    "X-Request-Id": metrics.engine_request_id(request.scope),
                    **bearer(upstream.secret),
                },
            )
        except aiohttp.SocketTimeoutError:
            # The replica has the request and may be working on it: another would do it twice.
            raise Refusal(
                504,
                f"Replica {upstream.replica_id} of {request.route.name} did not start answering within "
                f"{settings.GATEWAY_UPSTREAM_TIMEOUT_S} s.",
                kind="api_error",
                code="replica_timeout",
            ) from None

    def _unanswered(self, scope: dict, upstream: routes.Upstream, error: Exception) -> str:
        """Cool a replica that did not answer, count the failover, and say what happened to it."""
        replica = upstream.replica_id
        self.cooling[replica] = time.monotonic() + COOLDOWN_S
        self.observer.failover(scope)
        log.warning(
            "replica %s at %s did not answer (%r); tried last for %g s",
            replica,
            upstream.base,
            error,
            COOLDOWN_S,
        )
        return f"replica {replica} at {upstream.base}: {sentence_of(error)}"

    async def _relay_and_count(
        self, request: Request, response: aiohttp.ClientResponse, replica: int, gateway_s: float, why: str
    ) -> tuple[int, int]:
        """Relay the replica's answer and count its usage; its tokens and its cost in micro-units."""
        answer = Answer(request.scope["path"] if request.translation is None else CHAT)
        tallied: list[tuple[int, int, int, Decimal]] = []

        def tally() -> tuple[int, int, int, Decimal]:
            """The answer's prompt, completion and cached tokens, and its cost: worked out once."""
            if not tallied:
                prompt, completion = answer.tokens(len(request.body))
                cached = answer.cached()
                tallied.append((prompt, completion, cached, cost(request.route.prices, prompt, completion, cached)))
            return tallied[0]

        async def settle_before_its_end() -> None:
            """Counted against its key's limits and its team's budgets before its client has the last of it; its
            usage and metrics are written after, off the client's way."""
            if request.settle is not None:
                prompt, completion, _, spent = tally()
                await request.settle(prompt + completion, micro_units(spent))

        try:
            await relay(request, response, replica, gateway_s, answer, settle_before_its_end)
        finally:
            response.close()
            # Counted however the answer ended: a stream cut short, by either side, is billed for
            # what was relayed, since its usage chunk (the last) never came.
            prompt, completion, cached, spent = tally()
            self.usage.add(request.key.id, request.route.name, prompt, completion, cached, spent)
            self.observer.answered(request.scope, replica, gateway_s, prompt, completion, cached, why)
        return prompt + completion, micro_units(spent)


def _unreachable(model: str, failures: list[str], refused_secret: bool) -> Refusal:
    """The refusal when no replica of the model could be reached, with what happened to each."""
    unreachable = Refusal(
        502,
        f"No replica of {model} could be reached: " + "; ".join(failures) + ".",
        kind="api_error",
        code="replica_unreachable",
    )
    # Only engines that did not answer at all may be back in a moment (gateway/hold.py);
    # one that refuses the replica secret is not waited for.
    unreachable.engine_down = not refused_secret
    return unreachable
