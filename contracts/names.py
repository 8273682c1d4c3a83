"""Names that travel between the two sides and end up on a disk or a queue."""

from __future__ import annotations

import re

# A file's name on a node is written first as NAME.part and renamed when whole, and
# file systems allow 255 bytes: so a name the mirror offers is at most 250 bytes, on
# both sides, or a version would show in the mirror that no node could fetch.
MAX_NAME_BYTES = 255 - len(".part")

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def plain_name_problem(name: str) -> str | None:
    """Why this is not a plain name for a model, version or file, or None.

    A name is joined onto a path, on the mirror and in a node's cache, and the
    mirror is a place files are copied into by hand: anything that could climb
    out, hide (`.complete` is the marker of a whole set), or mean a half-written
    download is refused rather than trusted.
    """
    if not name:
        return "the name is empty"
    if name in {".", ".."}:
        return f"{name!r} is not a name"
    if "/" in name or "\\" in name:
        return f"{name!r} contains a path separator"
    if "\x00" in name:
        return f"{name!r} contains a NUL byte"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return f"{name!r} contains a control character"
    if name.startswith("."):
        return f"{name!r} is hidden"
    if name.endswith(".part"):
        return f"{name!r} is an unfinished download"
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        return f"{name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"{name!r} is not valid UTF-8"
    return None


def node_name_problem(name: str) -> str | None:
    """Why this cannot be a node's name, or None.

    The name becomes the agent's Celery queue (node.NAME) and is typed on the
    agent's command line, so it is kept to characters that survive both.
    """
    if not NODE_NAME.fullmatch(name):
        return (
            f"{name!r} is not a node name: use up to 100 letters, digits, dots, dashes and underscores, "
            "starting with a letter or digit"
        )
    return None
