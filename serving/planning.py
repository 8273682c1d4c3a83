"""Putting one mirrored version into service: what it would mean, and the entry it makes.

`plan_serve` works out the offer and `build_model` reads the answer. Both are
pure: they take what they need as arguments and touch no database, so the serve
page, the API and the tests all call the same two functions.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from urllib.parse import quote

from catalog.models import Kind, Model, Profile
from catalog.rules import GROUP_ENGINES, MAX_NODES, nodes_problem, source_problem
from contracts import engines as engine_specs


@dataclass(frozen=True)
class FileFacts:
    """One file of a mirrored version, as the mirror's index has it."""

    name: str
    bytes: int


@dataclass(frozen=True)
class NodeFacts:
    """What a node's agent reports that matters to the offer."""

    engines: tuple[str, ...] = ()
    gpus: int = 0
    memory_gb: int = 0
    # Installed but failing the agent's self-test: the node reports them, and they do not run.
    engines_unusable: tuple[str, ...] = ()


@dataclass(frozen=True)
class CatalogFacts:
    declared: Collection[str] = frozenset()
    # Every name and alias in the catalog, declared or not.
    taken: Collection[str] = frozenset()


@dataclass
class ServePlan:
    """The offer to put one mirrored version into service.

    Everything a catalog entry needs that the mirror already knows is filled in:
    the name, the source, and the engine that reads that kind of file. What is
    left is what nobody can infer (the context pool and how many replicas), and
    those are fields rather than guesses presented as facts.
    """

    model: str
    version: str
    source: str = ""
    engine: str = ""
    # Named for the hardware rather than the model, because a profile is about where a model runs.
    profile: str = "cpu"
    # chat, embedding or rerank: chat unless the weights' header says otherwise.
    kind: str = Kind.CHAT.value
    # How many files the version holds when it is a set of more than one; 0 for a single file.
    files: int = 0
    bytes_total: int = 0
    # Filled in rather than left blank. Blank writes no constraint at all, and a
    # CPU profile has no card to be short of, so every ready node becomes a
    # candidate: a 4.7 GB model went onto a 7.9 GB machine and left it with
    # 3.5 GB for a KV pool. Nothing was wrong with placement; it was never told
    # what the model needed.
    min_memory_gb: int = 0
    # Set when this version cannot be served as it stands. Offered and then
    # failing at placement is worse than not offered.
    refusal: str = ""
    # Set when it can be served but probably will not run.
    warning: str = ""
    # A model of this name (or alias) is in the catalog already.
    already: bool = False
    file_names: list[str] = field(default_factory=list)
    # Which figure fills min_memory_gb and its parts (serving/memory.py): the header estimate or the size rule.
    memory: dict = field(default_factory=dict)
    # Requests one replica answers at once (llama.cpp's --parallel); 0 for an engine without slots.
    parallel: int = 0
    # How many nodes one replica spans: more than 1 only when no single node holds it (issue 37),
    # with about what it needs on each.
    nodes: int = 1
    per_node_gb: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def engine_for(file_name: str) -> str:
    """The engine that reads this kind of weights file, or "" when none does (contracts/engines.py)."""
    return engine_specs.engine_reading(file_name)


# Slots the serve page offers a llama.cpp model: what llama-server picks by itself, and on two
# cores about where its tokens per second stop growing (docs/benchmarks.md).
DEFAULT_SLOTS = 4


def ext_of(file_name: str) -> str:
    dot = file_name.rfind(".")
    return file_name[dot:] if dot >= 0 else file_name


def plan_serve(
    model: str,
    version: str,
    files: Sequence[FileFacts],
    byte_base: str,
    fleet: Sequence[NodeFacts] | None,
    catalog: CatalogFacts | None,
    header_kind: str = "",
    not_ready: str = "",
    estimated_gb: int = 0,
) -> ServePlan:
    """Work out what serving this version would mean.

    `header_kind` is the kind the weights' header says (a GGUF with a pooling type
    is an embedding or rerank model), "" when nobody read one. `not_ready` is the
    mirror's sentence for a version that is not whole yet (a file still being
    written), "" when it is: such a version is not offered. `estimated_gb` is the
    memory the weights' header gives (serving/memory.py); 0 leaves the size rule.
    """
    files = sorted(files, key=lambda f: f.name)
    plan = ServePlan(model=model, version=version, file_names=[f.name for f in files])
    if header_kind in Kind.values:
        plan.kind = header_kind
    version_url = f"{byte_base}{quote(model)}/{quote(version)}/"
    if not files:
        plan.source = version_url
        plan.refusal = "this version holds no files yet; copy its weights into the mirror first"
        return plan

    deciding = _offer_files(plan, files, version_url)
    if not plan.engine:
        plan.refusal = f"nothing here reads {ext_of(deciding.name)} files"
        return plan
    if not_ready:
        # Offered now, a node would fetch a file cut short; the mirror says when to look again.
        plan.refusal = f"this version is not ready yet: {not_ready}; reload the page when the copy is done"
        return plan
    spec = engine_specs.SPECS[plan.engine]
    plan.profile = "gpu" if spec.default_gpus else "cpu"
    plan.parallel = DEFAULT_SLOTS if spec.slots else 0

    _warn_engine_missing(plan, fleet, spec, ext_of(deciding.name))
    _warn_memory(plan, fleet, estimated_gb)
    _check_catalog(plan, model, catalog)
    return plan


def _offer_files(plan: ServePlan, files: Sequence[FileFacts], version_url: str) -> FileFacts:
    """The engine, size and source a version's files give; the file the offer speaks of.

    That file is the one that decides the engine, or the first when none does.
    """
    deciding = next((f for f in files if engine_for(f.name)), files[0])
    plan.engine = engine_for(deciding.name)
    plan.bytes_total = sum(f.bytes for f in files)
    if len(files) > 1:
        # A version of several files is served as the version, not as one of
        # them: the source is the directory (a trailing slash), the agent fetches
        # every file in it and hands the engine the folder. The engine comes
        # from whichever file says, because a version is a mixture only when
        # somebody has put one there by hand.
        plan.source = version_url
        plan.files = len(files)
    else:
        plan.source = version_url + quote(deciding.name)
    return deciding


def _check_catalog(plan: ServePlan, model: str, catalog: CatalogFacts | None) -> None:
    """Whether the catalog has the name already; a name declared in configuration is refused."""
    if catalog is None:
        return
    plan.already = model in catalog.taken or model in catalog.declared
    if model in catalog.declared:
        plan.refusal = f"a model called {model} is declared in configuration; edit it there rather than adding a second"


def _warn_engine_missing(
    plan: ServePlan, fleet: Sequence[NodeFacts] | None, spec: engine_specs.EngineSpec, ext: str
) -> None:
    """Warn when no node can run the plan's engine, saying where it is installed but failing."""
    # Whether any node can actually run it. A warning, not a refusal: an engine
    # can be installed this afternoon, and a node that reports nothing is an
    # older agent rather than an empty one.
    if not runs_anywhere(fleet, plan.engine):
        plan.warning = f"no node reports having {plan.engine} installed, and {ext} weights need it"
        if failing := sum(plan.engine in node.engines_unusable for node in fleet):
            plan.warning += (
                f" (installed on {failing} node{'s' if failing != 1 else ''} but failing its self-test: "
                "the node's page says why)"
            )
        if spec.default_gpus and gpu_total(fleet) == 0:
            plan.warning += ". This fleet has no GPU either; a GGUF build of the same model runs on the CPU nodes"


def _warn_memory(plan: ServePlan, fleet: Sequence[NodeFacts] | None, estimated_gb: int) -> None:
    """Set the plan's memory, and warn when no node holds it (saying how a group would split it)."""
    plan.min_memory_gb = estimated_gb or memory_for(plan.bytes_total)
    biggest = largest_node_memory_gb(fleet)
    if biggest > 0 and plan.min_memory_gb > biggest:
        joined = plan.warning.removesuffix(".")
        plan.warning = (
            f"{joined}{', and ' if joined else ''}the largest node has {biggest} GB and this needs about "
            f"{plan.min_memory_gb}"
        )
        if plan.engine in GROUP_ENGINES and (spread := nodes_to_hold(fleet, plan.min_memory_gb)):
            plan.nodes = spread
            plan.per_node_gb = -(-plan.min_memory_gb // spread)
            plan.warning += (
                f"; one replica across {spread} nodes needs about {plan.per_node_gb} GB on each "
                "(the profile's nodes, split by each node's free memory)"
            )


def runs_anywhere(fleet: Sequence[NodeFacts] | None, engine: str) -> bool:
    """Whether some node has this engine.

    True when no node reports any engines, so a fleet of agents older than the
    engine probe is not told every model is unservable. That matches what
    placement does with the same absence, and the two disagreeing would be
    worse than either.
    """
    if not fleet or not engine:
        return True
    # A node whose only engine failed its self-test reports it, and is not an older agent.
    reported = [node.engines for node in fleet if node.engines or node.engines_unusable]
    return not reported or any(engine in engines for engines in reported)


def gpu_total(fleet: Sequence[NodeFacts] | None) -> int:
    return sum(node.gpus for node in fleet or ())


def nodes_to_hold(fleet: Sequence[NodeFacts] | None, need_gb: int) -> int:
    """The fewest nodes whose memory together holds `need_gb`, up to the catalog's most; 0 when none do."""
    sizes = sorted((node.memory_gb for node in fleet or ()), reverse=True)
    total = 0
    for count, size in enumerate(sizes[:MAX_NODES], start=1):
        total += size
        if total >= need_gb:
            return count
    return 0


def largest_node_memory_gb(fleet: Sequence[NodeFacts] | None) -> int:
    """The most memory any single node reports, or 0 when none says."""
    return max((node.memory_gb for node in fleet or ()), default=0)


def memory_for(size_bytes: int) -> int:
    """The host RAM, in GB, a model needs: from the size of its weights.

    Weights plus half again, plus two. The half covers the KV pool, which grows
    with the same things the weights do (layers and heads), and the two are the
    engine's own footprint and the page cache it will not get back. It is an
    estimate and the field it fills is editable; what it is not is blank, which
    is what put a 4.7 GB model on a 7.9 GB node.
    """
    if size_bytes <= 0:
        return 0
    return int(size_bytes / (1 << 30) * 1.5) + 2


class ServeError(ValueError):
    """The submitted form cannot become a catalog entry: `errors` says where and why, every one.

    `field` and `sentence` are the first, for callers that show one.
    """

    def __init__(self, field: str, sentence: str, more: Sequence[tuple[str, str]] = ()):
        super().__init__(sentence)
        self.field = field
        self.sentence = sentence
        self.errors = [(field, sentence), *more]

    @classmethod
    def of(cls, errors: Sequence[tuple[str, str]]) -> ServeError:
        return cls(*errors[0], more=errors[1:])


WHOLE_NUMBER = re.compile(r"\+?[0-9]+")


class _Problems(list):
    """The sentences found so far, each beside its field: every field is checked, not only the first."""

    def whole_number(self, value: str, what: str, field: str) -> int:
        if not WHOLE_NUMBER.fullmatch(value.strip()):
            self.append((field, f"{what} must be a whole number"))
            return 0
        return int(value.strip())


def _slots_and_pool(get, problems: _Problems, spec, model: Model, profile: Profile) -> None:
    """Parallel slots and the context pool they share; the model's target load follows its slots."""
    slots = get("parallel")
    # Blank: what the serve page pre-fills, so a request from automation gets the same replica.
    profile.parallel = DEFAULT_SLOTS if spec is not None and spec.slots else 1
    if slots:
        profile.parallel = problems.whole_number(slots, "the number of parallel slots", "parallel")
        if spec is not None and not spec.slots:
            problems.append(("parallel", f"parallel slots are a llama.cpp setting; {spec.label} schedules its own"))
        elif profile.parallel < 1:
            problems.append(("parallel", "a replica needs at least one slot"))
    # One replica answers this many at once, so the autoscaler adds another only past them.
    model.target_load = max(1, profile.parallel)
    if ctx_size := get("ctx_size"):
        # The pool, not the per-request limit: llama.cpp divides it across its
        # parallel slots, so the number a client may use is smaller and is what
        # the context length above says.
        pool = problems.whole_number(ctx_size, "the engine's context pool", "ctx_size")
        if spec is not None and not spec.pool_flag:
            problems.append(
                ("ctx_size", "the context pool is a llama.cpp setting; vLLM sizes its pool from GPU memory")
            )
        profile.args = [spec.pool_flag if spec and spec.pool_flag else "--ctx-size", str(pool)]
    elif spec is not None and spec.pool_flag and model.context_length:
        # Left blank: each slot gets the context length a client may ask for.
        profile.args = [spec.pool_flag, str(max(1, profile.parallel) * model.context_length)]


def slot_warning(model: Model, profile: Profile) -> str:
    """A sentence when the pool gives a slot less than the context length a client may ask for; else "".

    Not a refusal: the operator may know its clients ask for less. But a client that asks for
    the whole context length is then cut off at the slot's share, which it was not told.
    """
    spec = engine_specs.spec(profile.engine)
    pool = engine_specs.pool_size(profile.args)
    if spec is None or not spec.slots or not pool or not model.context_length:
        return ""
    slots = max(1, profile.parallel)
    if pool // slots >= model.context_length:
        return ""
    return (
        f"the context pool of {pool} tokens gives each of the {slots} slots {pool // slots}, less than the context "
        f"length of {model.context_length} a client may ask for: make the pool {slots * model.context_length} "
        "or the context length smaller"
    )


def build_model(form: Mapping[str, str], byte_base: str) -> tuple[Model, Profile]:
    """Turn the submitted serve form into an unsaved catalog entry and its profile.

    Raises ServeError with every sentence to show, each beside its field.
    """

    def get(key: str) -> str:
        value = form.get(key)
        return str(value).strip() if value is not None else ""

    problems = _Problems()
    model = Model(
        name=get("name"),
        description=get("description"),
        source=get("source"),
        routing_profile="chat",
        kind=get("kind") or Kind.CHAT.value,
    )
    if model.kind not in Kind.values:
        problems.append(("kind", f"the kind must be one of {', '.join(Kind.values)}, not {model.kind}"))
    if not model.name or not model.source:
        problems.append(("name" if not model.name else "source", "a model needs a name and a source"))
    elif problem := source_problem(model.source, byte_base):
        problems.append(("source", problem))
    model.aliases = [a.strip() for a in get("aliases").split(",") if a.strip()]
    model.context_length = problems.whole_number(get("context_length"), "the context length", "context_length")
    if get("max_output"):
        model.max_output = problems.whole_number(get("max_output"), "the output limit", "max_output")
    replicas = problems.whole_number(get("replicas"), "the replica count", "replicas")
    model.scaling_min = model.scaling_max = replicas

    engine = get("engine")
    spec = engine_specs.spec(engine)
    if not engine:
        problems.append(("engine", "which engine should run it?"))
    elif spec is None:
        problems.append(("engine", f"the engine must be {' or '.join(engine_specs.NAMES)}, not {engine}"))
    profile = Profile(name=get("profile") or engine, engine=engine, weight=1, priority=100)
    # vLLM without a card is not a setup anyone runs; a profile for it asks for one.
    profile.gpus = spec.default_gpus if spec else 0
    _slots_and_pool(get, problems, spec, model, profile)
    if get("nodes"):
        said = len(problems)
        profile.nodes = problems.whole_number(get("nodes"), "the node count", "nodes")
        if len(problems) == said and (problem := nodes_problem(profile.nodes, engine)):
            problems.append(("nodes", problem))
    if get("min_memory_gb"):
        profile.min_memory_gb = problems.whole_number(get("min_memory_gb"), "the memory requirement", "min_memory_gb")
    key, value = get("selector_key"), get("selector_value")
    if key and value:
        # What keeps a large model off the small nodes. A CPU profile has no
        # card to be short of, so without this every ready node looks like a
        # candidate and the first one picked is the one that gets OOM-killed.
        profile.node_selector = {key: value}
    elif key or value:
        problems.append(("selector_key", "a node selector needs both a label key and its value"))
    if problems:
        raise ServeError.of(problems)
    return model, profile
