"""What a node's messages may say: its signature checked, then each field, before anything is believed.

A heartbeat or report comes from a node's agent over Redis, so it is untrusted input:
a node that is taken over, or a bug, may send a word where a number goes, a number
past PostgreSQL's integer, a NUL (which PostgreSQL refuses in any text) or a list of a
million entries. Each is refused here with a sentence naming the field (`Refused`), so
the caller drops that one message with one log line and goes on with the rest; nothing
reaches the database that it would refuse with an error.
"""

from __future__ import annotations

import json
import math

from contracts import signing, tasks

from .enrolment import Enrolled

INTEGER_MAX = 2**31 - 1  # PostgreSQL integer (PositiveIntegerField)
BIGINT_MAX = 2**63 - 1  # PostgreSQL bigint (BigIntegerField, the ids)
# A heartbeat of a node with a few hundred replicas is tens of kilobytes.
MESSAGE_MAX_CHARS = 1_000_000
MANY = 10_000  # replicas on one node, far beyond what one runs


class Refused(ValueError):
    """A message not believed; its text is the sentence why, naming the field."""


def opened(enrolled: Enrolled | None, kind: str, message, name=None) -> tuple[int, dict]:
    """(seq, body) of a message the node signed as `kind`; Refused when it did not, or it is no longer good.

    `message` is the task's argument, or the raw JSON a node posted in Redis.
    """
    if isinstance(message, bytes | str):
        if len(message) > MESSAGE_MAX_CHARS:
            raise Refused(f"it is {len(message)} bytes long, more than {MESSAGE_MAX_CHARS}")
        try:
            message = json.loads(message)
        except (ValueError, RecursionError):
            raise Refused("it is not JSON") from None
    if isinstance(message, list):
        raise Refused("it is in the old form, the node's raw token first: the node's agent must be upgraded")
    if enrolled is None:
        raise Refused("it names no enrolled node")
    if problem := signing.message_problem(enrolled.key, kind, enrolled.name, message):
        raise Refused(problem)
    if not isinstance(message["body"], dict):
        raise Refused(f"its body is {_shown(message['body'])}, not an object")
    return message["seq"], message["body"]


def checked_facts(name: str, facts: dict) -> dict:
    """A heartbeat's facts with every field checked; Refused naming the first field that is wrong."""
    if "node" in facts and facts["node"] != name:
        raise Refused(f"node is {_shown(facts['node'])}, but the message is node {name}'s")
    checked: dict = {"node": name}
    if "agent_version" in facts:
        checked["agent_version"] = _text(facts["agent_version"], "agent_version", 50, cut=True)
    if "engines" in facts:
        checked["engines"] = [_text(e, "engines", 50) for e in _list(facts["engines"], "engines", 32)]
    if "engines_unusable" in facts:
        unusable = _dict(facts["engines_unusable"], "engines_unusable", 32)
        checked["engines_unusable"] = {
            _text(k, "engines_unusable", 50): _text(v, "engines_unusable", 1000, cut=True) for k, v in unusable.items()
        }
    if "gpus" in facts:
        checked["gpus"] = [_gpu(g) for g in _list(facts["gpus"], "gpus", 64)]
    if "memory_gb" in facts:
        checked["memory_gb"] = _int(facts["memory_gb"], "memory_gb", INTEGER_MAX)
    if "disk_free_bytes" in facts:
        checked["disk_free_bytes"] = _int(facts["disk_free_bytes"], "disk_free_bytes")
    if "labels" in facts:
        labels = _dict(facts["labels"], "labels", 64)
        checked["labels"] = {_text(k, "labels", 100): _text(v, "labels", 200) for k, v in labels.items()}
    if "replicas" in facts:
        checked["replicas"] = [_int(i, "replicas", low=1) for i in _list(facts["replicas"], "replicas", MANY)]
    if "replica_memory" in facts:
        measured = _dict(facts["replica_memory"], "replica_memory", MANY)
        checked["replica_memory"] = {_replica_id(k): _measured(m) for k, m in measured.items()}
    for flag in ("rpc", "rpc_head"):
        if flag in facts:
            if not isinstance(facts[flag], bool):
                raise Refused(f"{flag} is {_shown(facts[flag])}, not true or false")
            checked[flag] = facts[flag]
    if facts.get("memory_available_bytes") is not None:
        checked["memory_available_bytes"] = _int(facts["memory_available_bytes"], "memory_available_bytes")
    return checked


def checked_report(body: dict) -> tasks.ReplicaReport:
    state = body.get("state")
    if state not in tasks.REPLICA_STATES:
        raise Refused(f"state is {_shown(state)}, not one of {', '.join(tasks.REPLICA_STATES)}")
    report = tasks.ReplicaReport(
        replica=_int(body.get("replica"), "replica", low=1),
        state=state,
        endpoint=_text(body.get("endpoint", ""), "endpoint", 300),
        reason=_text(body.get("reason", ""), "reason", 4000, cut=True),
    )
    # A worker of a replica across nodes says so (contracts/groups.py); believed only for a share it holds.
    if "role" in body:
        if body["role"] not in ("head", "worker"):
            raise Refused(f"role is {_shown(body['role'])}, not head or worker")
        report["role"] = body["role"]  # type: ignore[typeddict-unknown-key]
    return report


def checked_fetch(name: str, body: dict) -> tasks.FetchReport:
    if "node" in body and body["node"] != name:
        raise Refused(f"node is {_shown(body['node'])}, but the message is node {name}'s")
    state = body.get("state")
    if state not in tasks.FETCH_ENDINGS:
        raise Refused(f"state is {_shown(state)}, not one of {', '.join(tasks.FETCH_ENDINGS)}")
    return tasks.FetchReport(
        node=name,
        source=_text(body.get("source", ""), "source", 1000),
        state=state,
        path=_text(body.get("path", ""), "path", 1000),
        error=_text(body.get("error", ""), "error", 2000, cut=True),
        bytes_total=_int(body.get("bytes_total", 0), "bytes_total"),
        files_total=_int(body.get("files_total", 0), "files_total", INTEGER_MAX),
        seconds=_number(body.get("seconds", 0), "seconds"),
        started=_number(body.get("started", 0), "started"),
    )


# --- one field ---------------------------------------------------------------------------


def _shown(value) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    said = repr(value)
    return said if len(said) <= 60 else said[:60] + "..."


def _int(value, field: str, high: int = BIGINT_MAX, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(f"{field} is {_shown(value)}, not a whole number")
    if not low <= value <= high:
        raise Refused(f"{field} is {_shown(value)}, not between {low} and {high}")
    return value


def _number(value, field: str, high: float = 1e12) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refused(f"{field} is {_shown(value)}, not a number")
    if not (math.isfinite(value) and 0 <= value <= high):
        raise Refused(f"{field} is {_shown(value)}, not between 0 and {high:g}")
    return float(value)


def _text(value, field: str, most: int, cut: bool = False) -> str:
    if not isinstance(value, str):
        raise Refused(f"{field} is {_shown(value)}, not text")
    if "\x00" in value:
        raise Refused(f"{field} holds a NUL character, which no text column takes")
    if len(value) > most:
        if not cut:
            raise Refused(f"{field} is {len(value)} characters long, more than {most}")
        value = value[:most]
    return value


def _list(value, field: str, most: int) -> list:
    if not isinstance(value, list):
        raise Refused(f"{field} is {_shown(value)}, not a list")
    if len(value) > most:
        raise Refused(f"{field} has {len(value)} entries, more than {most}")
    return value


def _dict(value, field: str, most: int) -> dict:
    if not isinstance(value, dict):
        raise Refused(f"{field} is {_shown(value)}, not an object")
    if len(value) > most:
        raise Refused(f"{field} has {len(value)} entries, more than {most}")
    return value


def _gpu(value) -> dict:
    """One GPU as the agent finds it ({name, memory_mb}, and whatever a later agent adds): flat and bounded."""
    gpu = _dict(value, "gpus", 16)
    checked = {}
    for key, item in gpu.items():
        key = _text(key, "gpus", 50)
        if item is None or isinstance(item, bool):
            checked[key] = item
        elif isinstance(item, int):
            checked[key] = _int(item, "gpus")
        elif isinstance(item, float):
            checked[key] = _number(item, "gpus", 1e18)
        else:
            checked[key] = _text(item, "gpus", 200)
    return checked


def _replica_id(key: str) -> str:
    if not (key.isascii() and key.isdigit() and len(key) <= 19 and 1 <= int(key) <= BIGINT_MAX):
        raise Refused(f"replica_memory names replica {_shown(key)}, not a replica id")
    return key


def _measured(value) -> dict:
    entry = _dict(value, "replica_memory", 8)
    checked = {"rss": _int(entry.get("rss"), "replica_memory")}
    if entry.get("pss") is not None:
        checked["pss"] = _int(entry["pss"], "replica_memory")
    if entry.get("gpu") is not None:
        checked["gpu"] = _int(entry["gpu"], "replica_memory")
    return checked
