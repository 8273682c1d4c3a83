"""A pull's copy: the version's files fetched with libtorrent into its staging folder (mirror/pull.py).

The same engine the nodes fetch with (`contracts.swarm`), the other byte listener its only
source, as a web seed; libtorrent's resume data beside the staging folder, so a pull of the
same address again goes on from the pieces already verified. Its deadline and the disk's room
are looked at with every progress report: raised there, the fetch stops at once.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import libtorrent as lt
from django.utils import timezone

from .models import MirrorPull
from .pull_remote import Address, Credentials, Deadline, Manifest, PullError, Stopped
from .pull_room import room_ran_out, staging_of

PROGRESS_EVERY_S = 0.5


def prepare_staging(address: Address, manifest: Manifest) -> Path:
    """The version's staging folder, holding nothing but what may be the manifest's files."""
    staging = staging_of(address.model, address.version)
    staging.mkdir(parents=True, exist_ok=True)
    wanted = {name for name, _, _ in manifest.files}
    for leftover in staging.iterdir():
        # From an earlier pull of another content under the same name: not part of this one.
        if leftover.name not in wanted:
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
    return staging


def fetch_version(
    pull: MirrorPull,
    address: Address,
    who: Credentials,
    manifest: Manifest,
    data: bytes,
    staging: Path,
    resume: Path,
    deadline: Deadline,
    swarm_factory: Callable | None,
) -> None:
    """The torrent `data`'s files fetched into `staging` from the other mirror; PullError or Stopped saying why not."""
    from contracts.swarm import Swarm, SwarmError

    single = len(manifest.files) == 1 and "/" not in lt.torrent_info(lt.bdecode(data)).layout().file_path(0)
    # A web seed for a folder torrent is the folder's parent (libtorrent adds "<version>/<file>");
    # for a single-file torrent, the folder itself (it adds "<file>").
    seed = address.url if single else f"{address.base}{quote(address.model)}/"
    swarm = (swarm_factory or (lambda: Swarm(listen_port=0, listen_host="127.0.0.1")))()
    try:
        swarm.allow([])  # a pull takes pieces from the other mirror only, and serves none
        swarm.fetch(
            data,
            staging,
            web_seeds=lambda: [who.web_seed(seed)],
            progress=_progress(pull, address, manifest, deadline),
            resume_path=resume,
            keep_seeding=False,
        )
    except SwarmError as error:
        if problem := room_ran_out(address, manifest):  # libtorrent's own "no space left on device"
            raise Stopped(problem) from None
        raise PullError(f"the copy did not finish: {error}") from None
    finally:
        swarm.close()


def _progress(pull: MirrorPull, address: Address, manifest: Manifest, deadline: Deadline) -> Callable:
    """The fetch's progress callback: the bounds looked at, and the row's bytes written every PROGRESS_EVERY_S."""
    last = [0.0]

    def progress(status) -> None:
        # Raised here, the fetch stops at once (contracts.swarm): the bounds are checked at every look.
        deadline.check()
        if problem := room_ran_out(address, manifest):
            raise Stopped(problem)
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            MirrorPull.objects.filter(pk=pull.pk).update(
                bytes_done=status.bytes_done, bytes_total=status.bytes_total or manifest.bytes, updated=timezone.now()
            )

    return progress
