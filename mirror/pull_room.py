"""A pull's room on the mirror's disk, and the hidden folder it copies into (mirror/pull.py).

A pull is refused when the mirror's filesystem cannot hold the version and still keep
LLMGW_PULL_RESERVE_MB free, and stopped when the room runs out meanwhile (something else
took it): the other mirror's version is another site's size, and this mirror's disk is
what its scans, its byte listener and its database live on.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from django.conf import settings
from django.template.defaultfilters import filesizeformat

from . import disk
from .pull_remote import Address, Manifest

STAGING = ".pull"  # under the mirror root: hidden, so never a model


def staging_of(model: str, version: str) -> Path:
    return disk.root() / STAGING / model / version


def _free_bytes() -> int:
    place = disk.root()
    while not place.exists() and place != place.parent:
        place = place.parent
    return shutil.disk_usage(place).free


def _staged_bytes(address: Address, manifest: Manifest) -> int:
    """What of the version is on disk in its staging folder already (a pull that goes on), by blocks written."""
    staging = staging_of(address.model, address.version)
    found = 0
    for name, size, _ in manifest.files:
        try:
            st = os.lstat(staging / name)
        except OSError:
            continue
        found += min(st.st_blocks * 512, size)  # files are sparse until written: their blocks, not their length
    return found


def room_problem(address: Address, manifest: Manifest) -> str | None:
    """Why the mirror's filesystem cannot take the version and keep LLMGW_PULL_RESERVE_MB free; None when it can."""
    needed = manifest.bytes - _staged_bytes(address, manifest)
    free, reserve = _free_bytes(), settings.PULL_RESERVE_BYTES
    if free >= needed + reserve:
        return None
    return (
        f"the mirror's disk has {filesizeformat(free)} free and {address.model}/{address.version} needs "
        f"{filesizeformat(needed)}, with {filesizeformat(reserve)} kept free beside it (LLMGW_PULL_RESERVE_MB): "
        "nothing was pulled; make room first"
    )


def room_ran_out(address: Address, manifest: Manifest) -> str | None:
    """Why the copy under way can no longer finish on the mirror's disk (something else took the room); None if it can."""
    needed = manifest.bytes - _staged_bytes(address, manifest)
    free = _free_bytes()
    if free >= needed:
        return None
    return (
        f"the mirror's disk ran out of room during the pull: {filesizeformat(free)} free, "
        f"{filesizeformat(needed)} still to come; the copy so far is removed and nothing of it is in the mirror"
    )
