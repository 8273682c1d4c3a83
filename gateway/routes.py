"""What the gateway routes by: a snapshot of models, ready replicas and keys, read from the database.

The gateway never touches the database while it forwards a request. A thread
reads this snapshot every LLMGW_GATEWAY_REFRESH_MS and the event loop swaps it
in whole, so a request sees one consistent table and pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import connection
from django.db.models import Exists, OuterRef, Q

from accounts.models import TeamMember
from catalog.models import Model, Profile, RoutingProfile
from contracts import credentials
from contracts.credentials import replica_nonce as nonce
from fleet.models import Replica

from . import prefix
from .limits import BUDGET_FIELDS, Budget, Limits, budget_of, tag_of
from .limits import of as limits_of
from .models import LIMIT_FIELDS, ApiKey, TableChange


@dataclass(frozen=True)
class Upstream:
    replica_id: int
    base: str  # the engine's OpenAI base URL, ending in /v1
    weight: int
    # Requests its engine answers at once (its profile's slots: llama.cpp's --parallel), for prefix routing's bound.
    slots: int = 1
    # What the engine answers to (`Authorization: Bearer …`), made from its node's replica key,
    # never its token hash (contracts.credentials); empty for a node with no token. Never in a repr, so never in a log.
    secret: str = field(default="", repr=False)


@dataclass(frozen=True)
class Route:
    name: str
    aliases: tuple[str, ...]
    context_length: int
    max_output: int  # 0: no limit of its own
    created: int
    upstreams: tuple[Upstream, ...]
    kind: str = "chat"  # chat, embedding or rerank: which addresses it answers
    # Per million input, cached input and output tokens, in micro-units a token (gateway/limits/windows.py MICRO);
    # None: free.
    prices: tuple[Decimal, Decimal, Decimal] | None = None
    # Its ready replicas on a hash ring, for a model routed by prefix (routing profile "chat",
    # gateway/prefix.py); None routes by load alone.
    ring: prefix.Ring | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Key:
    id: int
    name: str
    models: frozenset[str] | None  # None: every model
    limits: Limits | None = None  # None: no limits, and no Redis on its requests (unless its team has budgets)
    tag: str = ""  # what its counters in Redis are filed under
    budget: Budget | None = None  # its team's budgets; None: no team, or a team without budgets
    team_id: int | None = None
    owner_id: int | None = None
    expires: float | None = None  # a Unix time; None: never
    refused: str = ""  # why the key may not be used though it is active (its owner's state): a 403's sentence

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def counted(self) -> bool:
        """Whether its requests go to Redis: it has limits of its own, or its team has budgets."""
        return self.limits is not None or self.budget is not None


@dataclass
class Table:
    routes: dict[str, Route] = field(default_factory=dict)  # by name and by alias
    models: list[Route] = field(default_factory=list)  # each once, in name order
    keys: dict[str, Key] = field(default_factory=dict)  # by sha256 of the key


def load() -> Table:
    """The whole table, read at once. Runs in a thread: it reads the database."""
    return TableReader().read()


# How far back each look at the change log reaches before the previous look: a
# change written by a transaction that commits later than this after writing is
# missed. Changes seen twice are applied once.
OVERLAP = timedelta(seconds=5)
# Marks older than this are deleted; a reader that has not looked for half as
# long reads the whole table again rather than trust a log with holes in it.
KEEP_CHANGES = timedelta(minutes=10)
PRUNE_EVERY = timedelta(minutes=1)
IN_BATCH = 500


class TableReader:
    """Keeps the rows a gateway routes by, and reads again only those the change log marks.

    The first read is whole; after it, a read with nothing changed is one indexed
    query on `gateway_tablechange`, however many keys and models there are.
    Used from the gateway's one database thread, never from two at once.
    """

    def __init__(self) -> None:
        self.table: Table | None = None
        self.since = None  # the database's clock, minus OVERLAP, at the last look
        self.applied: set[int] = set()  # change ids within the window already applied
        self.pruned_at = None
        self.keys: dict[int, tuple[str, Key]] = {}  # id -> (hash, key), active keys only
        # id -> (name, aliases, context_length, max_output, added_at, kind, routing_profile, three prices)
        self.models: dict[int, tuple] = {}
        self.profiles: dict[int, tuple[int, str, int]] = {}  # id -> (model id, name, weight)
        # id -> (model name, profile, endpoint, secret), ready ones
        self.replicas: dict[int, tuple[str, str, str, str]] = {}
        # Rings by their upstreams: a table change rebuilds only the rings whose replicas changed.
        self.rings: dict[tuple, prefix.Ring] = {}
        self.full_reads = 0
        self.rows_read = 0

    def read(self) -> Table:
        """The current table: the same object as last time when nothing changed."""
        try:
            now = database_now()
            if self.table is None or self.since is None or now - self.since > KEEP_CHANGES / 2:
                self._read_everything(now)
            else:
                self._read_changes(now)
        except Exception:
            # A read cut short (the database went away halfway) may have taken marks it did
            # not apply: the next read is whole rather than trust what it has.
            self.since = None
            raise
        if self.pruned_at is None or now - self.pruned_at > PRUNE_EVERY:
            TableChange.objects.filter(at__lt=now - KEEP_CHANGES).delete()
            self.pruned_at = now
        return self.table

    # --- whole ---------------------------------------------------------------------

    def _read_everything(self, now) -> None:
        self.full_reads += 1
        self.applied = set(TableChange.objects.filter(at__gte=now - OVERLAP).values_list("pk", flat=True))
        self.since = now - OVERLAP
        self.keys = {row[0]: key_of(row) for row in _key_rows(ApiKey.objects.filter(active=True))}
        self.models = {row[0]: row[1:] for row in _model_rows(Model.objects.all())}
        self.profiles = {row[0]: row[1:] for row in _profile_rows(Profile.objects.all())}
        self.replicas = {row[0]: row[1:] for row in _replica_rows(Replica.objects.all())}
        self.rows_read += len(self.keys) + len(self.models) + len(self.profiles) + len(self.replicas)
        keys = {digest: key for digest, key in self.keys.values()}
        self.table = Table(keys=keys, **self._routes())

    # --- what changed ----------------------------------------------------------------

    def _read_changes(self, now) -> None:
        marks = marks_since(self.since)
        self.since = now - OVERLAP
        fresh = [(table, row_id) for pk, table, row_id in marks if pk not in self.applied]
        self.applied = {pk for pk, _, _ in marks}
        if not fresh:
            return
        changed: dict[str, set[int]] = {}
        for table, row_id in fresh:
            changed.setdefault(table, set()).add(row_id)
        keys = self.table.keys
        ids, teams, owners = changed.get("key", set()), changed.get("team", set()), changed.get("owner", set())
        if teams or owners:
            # A team's budgets or members, or an owner's state, changed: its keys are read again.
            ids = ids | {
                row_id for row_id, (_, key) in self.keys.items() if key.team_id in teams or key.owner_id in owners
            }
            found = ApiKey.objects.filter(active=True).filter(Q(team_id__in=teams) | Q(owner_id__in=owners))
            ids |= set(found.values_list("pk", flat=True))
        if ids:
            keys = dict(keys)  # a new dict: requests keep the one they started with
            for row_id in ids:
                old = self.keys.pop(row_id, None)
                if old is not None and keys.get(old[0]) is old[1]:
                    del keys[old[0]]
            for row in self._reread(ApiKey.objects.filter(active=True), ids, _key_rows):
                digest, key = self.keys[row[0]] = key_of(row)
                keys[digest] = key
        routing = False
        for name, rows, store, queryset in (
            ("model", _model_rows, self.models, Model.objects.all()),
            ("profile", _profile_rows, self.profiles, Profile.objects.all()),
            ("replica", _replica_rows, self.replicas, Replica.objects.all()),
        ):
            if ids := changed.get(name):
                routing = True
                for row_id in ids:
                    store.pop(row_id, None)
                for row in self._reread(queryset, ids, rows):
                    store[row[0]] = row[1:]
        if routing:
            self.table = Table(keys=keys, **self._routes())
        elif keys is not self.table.keys:
            self.table = Table(routes=self.table.routes, models=self.table.models, keys=keys)

    def _reread(self, queryset, ids: set[int], rows) -> list[tuple]:
        ordered = sorted(ids)
        found = []
        for start in range(0, len(ordered), IN_BATCH):
            found += rows(queryset.filter(pk__in=ordered[start : start + IN_BATCH]))
        self.rows_read += len(found)
        return found

    # --- the routes, from the rows held ---------------------------------------------

    def _routes(self) -> dict:
        weights = {(model_id, name): max(weight, 0) for model_id, name, weight, _ in self.profiles.values()}
        slots = {(model_id, name): max(parallel, 1) for model_id, name, _, parallel in self.profiles.values()}
        ready: dict[str, list[tuple[int, str, str, str]]] = {}
        for replica_id, (model_name, profile_name, endpoint, secret) in sorted(self.replicas.items()):
            ready.setdefault(model_name, []).append((replica_id, profile_name, endpoint, secret))
        routes: dict[str, Route] = {}
        models: list[Route] = []
        rings: dict[tuple, prefix.Ring] = {}
        for model_id, (name, aliases, context_length, max_output, added_at, kind, routing, *prices) in sorted(
            self.models.items(), key=lambda item: item[1][0]
        ):
            upstreams = tuple(
                Upstream(
                    replica_id,
                    endpoint.rstrip("/"),
                    weights.get((model_id, profile_name), 1),
                    slots.get((model_id, profile_name), 1),
                    secret,
                )
                for replica_id, profile_name, endpoint, secret in ready.get(name, [])
            )
            aliases = tuple(a for a in (aliases or []) if isinstance(a, str))
            route = Route(
                name=name,
                aliases=aliases,
                context_length=context_length,
                max_output=max_output,
                created=int(added_at.timestamp()),
                upstreams=upstreams,
                kind=kind,
                prices=prices_of(*prices),
                ring=self._ring(upstreams, rings) if routing == RoutingProfile.CHAT and kind == "chat" else None,
            )
            models.append(route)
            for alias in aliases:
                routes.setdefault(alias, route)
            routes[name] = route
        self.rings = rings
        return {"routes": routes, "models": models}

    def _ring(self, upstreams: tuple[Upstream, ...], rings: dict) -> prefix.Ring:
        # By the upstreams themselves: a replica whose endpoint or secret changed gets a ring that has the new ones.
        ring = rings.get(upstreams) or self.rings.get(upstreams) or prefix.Ring(upstreams)
        rings[upstreams] = ring
        return ring


def key_of(row: tuple) -> tuple[str, Key]:
    pk, name, key_hash, model_names, *rest = row
    limits, rest = rest[: len(LIMIT_FIELDS)], rest[len(LIMIT_FIELDS) :]
    team_id, team_name, team_models, *rest = rest
    budgets, (expires, owner_id, owner_active, member) = rest[: len(BUDGET_FIELDS)], rest[len(BUDGET_FIELDS) :]
    models = frozenset(model_names) if model_names else None
    if team_id is not None and team_models:
        # What a team's key may use: what both it and its team may.
        models = frozenset(team_models) if models is None else models & frozenset(team_models)
    refused = ""
    if owner_id is not None and not owner_active:
        refused = "This API key's owner can no longer use llmgw, and neither can their keys."
    elif owner_id is not None and team_id is not None and not member:
        refused = f"This API key's owner is no longer a member of the team {team_name}, whose key it is."
    return key_hash, Key(
        pk,
        name,
        models,
        limits_of(limits),
        tag_of(key_hash),
        budget=budget_of(team_id, team_name, budgets) if team_id is not None else None,
        team_id=team_id,
        owner_id=owner_id,
        expires=expires.timestamp() if expires else None,
        refused=refused,
    )


def _key_rows(queryset) -> list[tuple]:
    member = TeamMember.objects.filter(team_id=OuterRef("team_id"), user_id=OuterRef("owner_id"))
    return list(
        queryset.order_by()
        .annotate(owner_in_team=Exists(member))
        .values_list(
            "pk",
            "name",
            "key_hash",
            "model_names",
            *LIMIT_FIELDS,
            "team_id",
            "team__name",
            "team__model_names",
            *(f"team__{name}" for name in BUDGET_FIELDS),
            "expires",
            "owner_id",
            "owner__is_active",
            "owner_in_team",
        )
    )


def prices_of(price_input, price_cached_input, price_output) -> tuple[Decimal, Decimal, Decimal] | None:
    """A model's prices (None: free); cached input at the input price when it has none of its own."""
    if price_input is None and price_cached_input is None and price_output is None:
        return None
    cached = price_cached_input if price_cached_input is not None else price_input
    return (price_input or Decimal(0), cached or Decimal(0), price_output or Decimal(0))


def _model_rows(queryset) -> list[tuple]:
    return list(
        queryset.order_by().values_list(
            "pk",
            "name",
            "aliases",
            "context_length",
            "max_output",
            "added_at",
            "kind",
            "routing_profile",
            "price_input",
            "price_cached_input",
            "price_output",
        )
    )


def _profile_rows(queryset) -> list[tuple]:
    return list(queryset.order_by().values_list("pk", "model_id", "name", "weight", "parallel"))


def _replica_rows(queryset) -> list[tuple]:
    ready = queryset.filter(state=Replica.State.READY).exclude(endpoint="")
    rows = ready.order_by().values_list("pk", "model_name", "profile_name", "endpoint", "created", "node__replica_key")
    return [
        (pk, model, profile, endpoint, credentials.replica_secret_from_replica_key(key or "", pk, nonce(created)))
        for pk, model, profile, endpoint, created, key in rows
    ]


def marks_since(since: datetime) -> list[tuple[int, str, int]]:
    """(id, table, row id) of the marks written since then.

    Plain SQL: this and database_now are all a refresh with nothing changed does,
    every second, and through the ORM building each query costs ten times running it.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT id, "table", row_id FROM {TableChange._meta.db_table} WHERE at >= %s',
            [connection.ops.adapt_datetimefield_value(since)],
        )
        return cursor.fetchall()


def database_now() -> datetime:
    """The database's clock: the triggers mark changes with it, so the reader looks back by it too."""
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")
            return datetime.fromisoformat(cursor.fetchone()[0]).replace(tzinfo=UTC)
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]
