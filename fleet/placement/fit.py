"""Whether a node can take a replica of a profile, and the sentence an unplaced replica shows: per node, why not."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..snapshots import ModelView, ProfileView
from .books import Room
from .groups import group_short

# How a node's reasons are shown when nothing fits. Past a few nodes per reason
# and a few reasons, a list of a thousand node names tells staff nothing.
NAMES_PER_REASON = 3
REASONS_SHOWN = 8


def why_not(profile: ProfileView, room: Room, engines_known: bool = True) -> str | None:
    """Why this node cannot take a replica of this profile, or None when it can."""
    node = room.node
    if not node.ready:
        return "not ready"
    if node.draining:
        return "draining"
    if engines_known and profile.engine not in node.engines:
        if profile.engine in node.engines_unusable:
            return f"{profile.engine} is installed but unusable ({node.engines_unusable[profile.engine]})"
        return f"no {profile.engine}"
    return short_of(profile, room)


def fits(profile: ProfileView, room: Room) -> bool:
    """The fit test, for a node that is ready and has the engine: labels, memory, GPUs.

    Placement asks it of every candidate, and `short_of` says why it said no, so the
    sentence a replica shows is the rule that kept it off the node. A bool first:
    placement asks it a million times on a large fleet and wants no sentences.
    """
    if room.memory_gb < profile.need_gb or room.gpus < profile.gpus:
        return False
    if not profile.node_selector:
        return True
    labels = room.node.labels
    return all(labels.get(key) == value for key, value in profile.node_selector.items())


def short_of(profile: ProfileView, room: Room) -> str | None:
    """Why `fits` says no, in the words a replica shows; None when it fits."""
    if fits(profile, room):
        return None
    labels = room.node.labels
    for key, value in profile.node_selector.items():
        if key not in labels:
            return f"no label {key}"
        if labels[key] != value:
            return f"{key} is {labels[key]}, needs {value}"
    if room.memory_gb < profile.need_gb:
        if profile.measured_gb > profile.min_memory_gb:
            return (
                f"{max(room.memory_gb, 0)} GB free, needs {profile.need_gb} "
                f"(measured; the profile asks {profile.min_memory_gb})"
            )
        return f"{max(room.memory_gb, 0)} GB free, needs {profile.need_gb}"
    return f"{max(room.gpus, 0)} GPU{'s' if room.gpus != 1 else ''} free, needs {profile.gpus}"


def profile_order(profiles: Sequence[ProfileView], per_profile: dict[str, int]) -> list[ProfileView]:
    """Higher priority first; among equals, the one furthest below its share by weight."""

    def key(p: ProfileView) -> tuple:
        share = per_profile.get(p.name, 0) / max(p.weight, 1)
        return (-p.priority, share, -p.weight, p.name)

    return sorted(profiles, key=key)


def explain(model: ModelView, rooms: Iterable[Room], engines_known: bool = True) -> str:
    """The sentence an unplaceable replica shows: per node, why it was not chosen."""
    rooms = sorted(rooms, key=lambda r: r.node.name)
    if not model.profiles:
        return f"{model.name} has no profile to run it with"
    if not rooms:
        return "no node has enrolled"
    parts = []
    for profile in profile_order(model.profiles, {}):
        by_reason: dict[str, list[str]] = {}
        for room in rooms:
            reason = why_not(profile, room, engines_known)
            if reason is not None:
                by_reason.setdefault(reason, []).append(room.node.name)
        text = _grouped(by_reason)
        if profile.nodes > 1:
            text += f"; {group_short(profile, rooms, engines_known)}"
        parts.append(f"profile {profile.name}: {text}" if len(model.profiles) > 1 else text)
    return ". ".join(parts)


def _grouped(by_reason: dict[str, list[str]]) -> str:
    shown = []
    for reason, names in list(by_reason.items())[:REASONS_SHOWN]:
        listed = ", ".join(names[:NAMES_PER_REASON])
        if len(names) > NAMES_PER_REASON:
            listed += f" and {len(names) - NAMES_PER_REASON} more"
        shown.append(f"{listed}: {reason}")
    hidden = sum(len(n) for n in list(by_reason.values())[REASONS_SHOWN:])
    if hidden:
        shown.append(f"{hidden} more nodes for other reasons")
    return "; ".join(shown)
