"""What makes a catalog entry valid, each rule once, as a sentence saying what is wrong.

The admin (through `Model.clean`), the API, the serve page and the configuration
file all ask these, so a rule is never written twice for the UI and the API.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from django.conf import settings

from contracts import engine_args
from contracts.sources import SourceError, cache_parts

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")
# An alias may be written the way clients of other servers already ask for the
# model ("meta-llama/Llama-3.1-8B-Instruct"); a name may not, because it can end
# up as a directory or a queue name, where a slash means something else.
# Bounds on what staff and automation may write. The gateway reads every model, alias and
# argument into memory each time its table changes, so text without a bound is a way to
# make every request slower (a 20 MB description was read every second).
MAX_DESCRIPTION = 4000
MAX_LIST = 100  # aliases, engine arguments, selector labels
MAX_ITEM = 1000  # one engine argument, one label's key or value

ALIAS_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*(/[A-Za-z0-9][A-Za-z0-9._:@+-]*)*")


def name_problem(name: str, what: str = "a model's name") -> str | None:
    # Clients type it into requests and aliases are written comma-separated, so
    # a name with a space or a comma would be one nobody can ask for.
    if not name:
        return f"{what} cannot be empty"
    if len(name) > 200:
        return f"{what} must be at most 200 characters"
    if not NAME_PATTERN.fullmatch(name):
        return f"{what} {name!r} may hold only letters, digits and . _ : @ + -, and must start with a letter or digit"
    return None


def alias_problem(aliases, name: str | None = None) -> str | None:
    """Why these are not aliases of the model called `name`, or None; other models are clash()'s to ask."""
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        return "aliases must be a list of names"
    if len(aliases) > MAX_LIST:
        return f"a model may have at most {MAX_LIST} aliases"
    for alias in aliases:
        if not alias or len(alias) > 200 or not ALIAS_PATTERN.fullmatch(alias):
            return (
                f"the alias {alias!r} may hold only letters, digits and . _ : @ + - (and / between parts), "
                "and must start with a letter or digit"
            )
    if len(set(aliases)) != len(aliases):
        return "an alias is listed twice"
    if name is not None and name in aliases:
        return f"{name} is the model's own name, not an alias"
    return None


def scaling_problem(minimum: int | None, maximum: int | None) -> str | None:
    if minimum is not None and maximum is not None and maximum < minimum:
        return f"the most replicas ({maximum}) cannot be fewer than the fewest ({minimum})"
    return None


def target_load_problem(target: int | None) -> str | None:
    if target is not None and target < 1:
        return "the target load is requests in flight per replica, at least 1"
    return None


def routing_problem(value, choices: list[tuple[str, str]]) -> str | None:
    """Why this is not a routing profile, or None; `choices` are (value, "value: what it does")."""
    if value in {v for v, _ in choices}:
        return None
    said = " or ".join(f"{v} ({label.partition(': ')[2]})" for v, label in choices)
    return f"the routing profile must be {said}, not {value!r}"


def source_problem(source: str, byte_base: str | None = None) -> str | None:
    """Why this source is not an address on the byte listener, or None.

    Every node fetches what the source names, so a form that accepted any URL
    would be a way to make the whole fleet download from an arbitrary host.
    """
    base = byte_base or settings.BYTES_URL
    if not source:
        return "a model needs a source"
    wanted = urlsplit(base)
    given = urlsplit(source)
    if (
        given.scheme != wanted.scheme
        or given.netloc != wanted.netloc
        or not given.path.startswith(wanted.path)
        or given.query
        or given.fragment
        or "/../" in f"{given.path}/"
        or "%2f" in given.path.lower()
        or len(given.path) <= len(wanted.path)
    ):
        return f"the source must be an address on the byte listener, {base}, so nodes fetch only from the mirror"
    try:
        # And one that every node would fetch: each name in it plain, however encoded.
        cache_parts(source)
    except SourceError as error:
        return str(error)
    return None


def declared_source_problem(source) -> str | None:
    """Why this is not a source the configuration file may name, or None: any http:// or https:// address."""
    if not isinstance(source, str) or not source.startswith(("http://", "https://")):
        return "the source must be an http:// or https:// address"
    return None


# Engines that can run one replica across several nodes: llama.cpp over its RPC backend, vLLM over Ray.
GROUP_ENGINES = ("llamacpp", "vllm")
MAX_NODES = 16


def nodes_problem(nodes, engine: str | None = None) -> str | None:
    """Why a profile may not span this many nodes, or None."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        return "a replica runs on at least 1 node"
    if nodes > MAX_NODES:
        return f"a replica spans at most {MAX_NODES} nodes"
    if nodes > 1 and engine not in GROUP_ENGINES:
        return f"only llama.cpp and vLLM run one replica across several nodes, not {engine}"
    return None


def args_problem(args, engine: str | None = None) -> str | None:
    """Why these are not arguments a profile of `engine` may give, or None.

    The allow-list is the contract's, which a node checks again before it starts an engine.
    """
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return 'engine arguments must be a list of strings, like ["--ctx-size", "8192"]'
    if len(args) > MAX_LIST:
        return f"a profile may have at most {MAX_LIST} engine arguments"
    if any(len(a) > MAX_ITEM for a in args):
        return f"an engine argument may be at most {MAX_ITEM} characters"
    if engine in engine_args.ALLOWED:
        return engine_args.args_problem(engine, args, settings.LLMGW_ALLOW_REMOTE_CODE)
    return None


def selector_problem(selector) -> str | None:
    if not isinstance(selector, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in selector.items()
    ):
        return 'a node selector must be labels written {"key": "value"}'
    return labels_problem(selector, "a node selector")


def labels_problem(labels: dict, what: str = "a node's labels") -> str | None:
    if len(labels) > MAX_LIST:
        return f"{what} may have at most {MAX_LIST} labels"
    if any(len(k) > MAX_ITEM or len(str(v)) > MAX_ITEM for k, v in labels.items()):
        return f"a label's key and value may be at most {MAX_ITEM} characters each"
    return None


def clash(name: str, aliases: list[str], others: Iterable[tuple[str, list[str], bool]]) -> tuple[str, str] | None:
    """(field, sentence) when this name or an alias is already another model's name or alias.

    `others` is every other model's (name, aliases, declared). The gateway resolves
    names and aliases alike, so one string meaning two models would send requests
    to whichever it happened to find first.
    """
    taken: dict[str, str] = {}
    declared: set[str] = set()
    for other_name, other_aliases, is_declared in others:
        taken[other_name] = other_name
        for alias in other_aliases or []:
            taken[alias] = other_name
        if is_declared:
            declared.add(other_name)
    if name in taken:
        owner = taken[name]
        if owner == name and owner in declared:
            return (
                "name",
                f"a model called {name} is declared in configuration; edit it there rather than adding a second",
            )
        if owner == name:
            return "name", f"a model called {name} is already in the catalog"
        return "name", f"{name} is already an alias of {owner}"
    for alias in aliases:
        if alias in taken:
            return "aliases", f"the alias {alias} is already a name or alias of {taken[alias]}"
    return None
