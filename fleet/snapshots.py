"""What placement reads and writes: plain snapshots of the fleet, the catalog and a plan.

Kept apart from the rules (`fleet.placement`) so that the rules' helpers
(`fleet.room`) and the benchmark can share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from catalog import defaults

# What a replica stopped for another model's room says (fleet.room).
MAKING_ROOM = "stopped to make room for "
# Replica states, as fleet.Replica spells them.
PENDING, FETCHING, STARTING, READY, FAILED, STOPPING = "pending", "fetching", "starting", "ready", "failed", "stopping"
# States in which the node has the weights on disk.
HOLDING_WEIGHTS = {STARTING, READY, STOPPING}


@dataclass(frozen=True)
class NodeView:
    name: str
    ready: bool = True
    draining: bool = False
    engines: frozenset[str] = frozenset()
    # Installed but failing the agent's self-test: {engine: why}. Never in `engines`.
    engines_unusable: dict[str, str] = field(default_factory=dict)
    memory_gb: int = 0
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    # Sources whose weights are already on this node's disk.
    holds: frozenset[str] = frozenset()
    # A replica across nodes (issue 37): it runs rpc-server and stunnel, so it may hold a worker's share ...
    rpc: bool = False
    # ... and its llama-server has the RPC backend, so it may lead one.
    rpc_head: bool = False


@dataclass(frozen=True)
class ProfileView:
    name: str
    engine: str
    args: tuple[str, ...] = ()
    weight: int = defaults.WEIGHT
    priority: int = defaults.PRIORITY
    min_memory_gb: int = defaults.MIN_MEMORY_GB
    node_selector: dict[str, str] = field(default_factory=dict)
    gpus: int = 0
    # The most its replicas have been measured to use, in whole GB (fleet.memory); 0 until measured.
    measured_gb: int = 0
    # How many nodes one replica may span when no single node holds it (issue 37).
    nodes: int = 1

    @property
    def need_gb(self) -> int:
        """What placement asks of a node: the profile's own figure, or the measured one once it is larger."""
        return max(self.min_memory_gb, self.measured_gb)


@dataclass(frozen=True)
class Scaling:
    """A model's bounds and pace from the catalog, for the autoscaler (fleet.autoscale)."""

    fewest: int = defaults.SCALING_MIN
    most: int = defaults.SCALING_MAX
    target_load: int = defaults.TARGET_LOAD
    quiet_s: int = defaults.QUIET_S
    idle_s: int = defaults.IDLE_S
    priority: int = defaults.PRIORITY


@dataclass(frozen=True)
class ModelView:
    name: str
    source: str
    replicas: int
    profiles: tuple[ProfileView, ...] = ()
    # None: held at `replicas`, never stopped to make room for another (a snapshot a test built).
    scaling: Scaling | None = None
    # Set by the autoscaler for this pass: replicas with requests in flight (never stopped),
    # why a new replica is added, what a replica stopped for a lower count says, whether it
    # may stop idle replicas of other models when it fits nowhere, and when it was last asked for.
    busy: frozenset[int] = frozenset()
    cause: str = ""
    stop_reason: str = ""
    make_room: bool = False
    last_request: float = 0.0
    # The mirror's sentence when the model's version is not whole yet (a file still being
    # written): no replica is placed until it is (issue 21).
    not_ready: str = ""


@dataclass(frozen=True)
class ReplicaView:
    id: int
    model: str
    profile: str
    node: str | None
    state: str = PENDING
    # What the replica holds on its node, copied from its profile when placed, so
    # that editing a profile does not change the books of an engine already running.
    memory_gb: int = 0
    gpus: int = 0
    source: str = ""
    # What its engine was started with; None when not known (a row from before it was kept).
    engine: str | None = None
    args: tuple[str, ...] | None = None
    # What its engine holds now, as its node last measured it, in whole GB; 0 when not measured.
    measured_gb: int = 0
    # A group's workers (issue 37): (node, GB held there, state) per share; empty for one node.
    shares: tuple[tuple[str, int, str], ...] = ()
    # A failed replica's wait before it is started again is over (fleet.reconcile.retry_delay).
    retry_due: bool = True

    @property
    def held_gb(self) -> int:
        """What it takes of its node's memory: what it was booked at, or what it uses once that is more."""
        return max(self.memory_gb, self.measured_gb)

    def runs_as(self, model: ModelView, profile: ProfileView) -> bool:
        """Whether its engine runs what the catalog now says: same weights, engine and arguments."""
        if self.source and self.source != model.source:
            return False
        if self.engine is not None and self.engine != profile.engine:
            return False
        return self.args is None or tuple(self.args) == tuple(profile.args)


@dataclass(frozen=True)
class Share:
    """A worker's part of a group: its node, its part of the layers and the GB it holds there."""

    node: str
    share: float
    memory_gb: int


@dataclass(frozen=True)
class Assignment:
    """Run a replica of `model` with `profile` on `node`; `replica` is None for a new one.

    A group (issue 37): `node` is its head, holding `head_gb` (its part `head_share`), and
    `shares` its workers; `explanation` says per node why it was chosen.
    """

    replica: int | None
    model: str
    profile: ProfileView
    node: str
    source: str
    cause: str = ""
    shares: tuple[Share, ...] = ()
    head_share: float = 1.0
    head_gb: int | None = None
    explanation: str = ""

    @property
    def memory_gb(self) -> int:
        """What the head holds: all of it for one node."""
        return self.profile.need_gb if self.head_gb is None else self.head_gb


@dataclass(frozen=True)
class Unplaced:
    """A replica that fits nowhere: `reason` says, per node, why not."""

    replica: int | None
    model: str
    reason: str
    cause: str = ""


@dataclass
class Plan:
    assign: list[Assignment] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)
    # Replicas whose engine must be stopped on their node.
    stop: list[int] = field(default_factory=list)
    # Rows to delete: nothing is running for them anywhere the control plane can reach.
    forget: list[int] = field(default_factory=list)
    # What a stopped replica says, by id, when there is more to say than "stopping".
    stop_reasons: dict[int, str] = field(default_factory=dict)
    # Stopped at once, not drained: a group that lost a worker never finishes what it has in flight.
    stop_now: set[int] = field(default_factory=set)
    # Replicas stopped to make room for another model, counted per model: their counts go down.
    made_room: dict[str, int] = field(default_factory=dict)
