"""Mirrors pull from mirrors: a version copied from another llmgw byte listener into this mirror (issue 24).

Sites in other buildings keep their mirror in step with a central one. The copy goes
through the same engine the nodes fetch with (`contracts.swarm`, libtorrent, the other
byte listener as its web seed), into a hidden folder under the mirror root
(`.pull/<model>/<version>/`, which no scan, manifest or listing reads), and is renamed
into place only when libtorrent has verified every piece and every file's sha256 agrees
with the other mirror's manifest. A pull that fails or is killed leaves nothing the
mirror takes for a version; pulling the same address again goes on from the pieces
already verified (libtorrent's resume data beside the staging folder).

The other site's byte listener serves only its fleet, so this site is one of its nodes:
`manage.py node_token NAME` there gives the token, and a pass made from it (as a node's
agent makes one) goes with every request: Bearer for the manifest and the torrent,
HTTP Basic in the web seed's URL for libtorrent.

Bounds (issue 34): the other mirror is another site's server, so nothing it does may hold
this one. A pull goes over https unless LLMGW_PULL_ALLOW_HTTP; it is refused when the
mirror's filesystem cannot hold the version and still keep LLMGW_PULL_RESERVE_MB free, and
stopped when the room runs out meanwhile; it ends within LLMGW_PULL_DEADLINE_S in all, its
copy removed when it is stopped; and the check made inside the admin's request waits at
most LLMGW_PULL_CHECK_S. Every request has a clock of its whole (`clocked.Cut`), not only of each
read: a server that sends a byte every few seconds never trips a read timeout.

The pull in its modules: `pull_remote` (what the other mirror says, checked), `pull_room`
(the disk's room and the staging folder), `pull_copy` (libtorrent's fetch) and
`pull_verify` (the copy checked and put in the mirror); this one starts and runs a pull.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import time
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from . import disk
from .models import MirrorPull
from .pull_copy import fetch_version, prepare_staging
from .pull_remote import (
    Address,
    Credentials,
    Deadline,
    Manifest,
    NotReadyYet,
    PullError,
    Stopped,
    no_torrent,
    parse_address,
    read_manifest,
    read_torrent,
    torrent_coming,
)
from .pull_room import STAGING, room_problem, staging_of
from .pull_verify import put_in_mirror

log = logging.getLogger(__name__)

# How long a pull waits for the other mirror to offer the version whole (and its torrent).
WAIT_S = 600


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"


def check(url: str, node: str = "", token: str = "") -> tuple[Address, Credentials]:
    """The address and credentials of a pull, tried against the other site now; PullError saying what is wrong.

    So a mistyped address, an HTML page, a wrong token or a disk too small is said at once,
    on the page or by the command, rather than by a pull that fails later. It runs inside
    the admin's request: the other mirror has LLMGW_PULL_CHECK_S to answer, not a worker's hours.
    """
    address = parse_address(url)
    who = Credentials.of(node, token)
    if (disk.root() / address.model / address.version).exists():
        raise PullError(f"this mirror already has {address.model}/{address.version}; a pull never replaces a version")
    seconds = settings.PULL_CHECK_S
    deadline = Deadline(
        seconds,
        f"the other mirror at {address.base} did not answer within {_duration(seconds)} (LLMGW_PULL_CHECK_S); "
        "a byte listener answers a manifest at once, so this is not one or it is overloaded: nothing was pulled",
    )
    try:
        manifest = read_manifest(address, who, deadline)
    except NotReadyYet:
        return address, who  # whole later: the pull waits on it
    if not manifest.info_hash and not torrent_coming(address, who, deadline):
        raise PullError(no_torrent(address))
    if problem := room_problem(address, manifest):
        raise PullError(problem)
    return address, who


def start(url: str, node: str = "", token: str = "", requested_by: str = "") -> MirrorPull:
    """A pull of `url` recorded (not yet run), once `check` finds nothing wrong."""
    address, who = check(url, node, token)
    # A pull whose worker was killed never cleared its credential: it goes now.
    silent = timezone.now() - timedelta(seconds=MirrorPull.SILENT_S)
    MirrorPull.objects.filter(state=MirrorPull.State.RUNNING, updated__lt=silent).exclude(pass_key="").update(
        pass_key=""
    )
    return MirrorPull.objects.create(
        url=address.url,
        model=address.model,
        version=address.version,
        node=who.node,
        pass_key=who.key,
        requested_by=requested_by,
    )


def run(pull_id: int, swarm_factory: Callable | None = None, wait_s: float = WAIT_S) -> MirrorPull | None:
    """Do the pull; the row ends done or failed with its sentence. Safe to run twice: one at a time per version."""
    pull = MirrorPull.objects.filter(pk=pull_id).first()
    if pull is None or pull.state in (MirrorPull.State.DONE, MirrorPull.State.FAILED):
        return pull
    lock_path = disk.root() / STAGING / pull.model / f"{pull.version}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        # "a+", not "w": opening must not empty the holder's word of which pull it runs.
        lock = open(lock_path, "a+")  # noqa: SIM115 (closed by the with below)
    except OSError as error:
        # A mirror this worker may not write (a unit's ReadOnlyPaths, a full or read-only disk): said, not a traceback.
        _end(
            pull,
            f"the pull could not make its staging folder {lock_path.parent} ({error.strerror or error}): this worker "
            "may not write the mirror (pulls run on the pulls unit, docs/fleet.md); nothing was pulled",
        )
        pull.refresh_from_db()
        return pull
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            if lock.read().strip() == str(pull.pk):
                # This very pull, delivered twice (Redis re-delivers an unacknowledged task; two pull workers):
                # the run under way ends the row, and this one must not mark it failed beneath it.
                log.info("pull %s of %s/%s is under way already; this delivery leaves it", pull.pk, *_named(pull))
                return pull
            _end(pull, f"another pull of {pull.model}/{pull.version} is under way; this one did nothing")
            return pull
        lock.truncate(0)
        lock.write(str(pull.pk))
        lock.flush()
        MirrorPull.objects.filter(pk=pull.pk).update(state=MirrorPull.State.RUNNING, updated=timezone.now())
        try:
            _pull(pull, swarm_factory, wait_s)
        except Stopped as error:
            # Stopped by a bound: the copy so far goes, so that nothing half-written stays and the room comes back.
            staging = staging_of(pull.model, pull.version)
            shutil.rmtree(staging, ignore_errors=True)
            staging.with_name(f"{pull.version}.resume").unlink(missing_ok=True)
            _end(pull, str(error))
        except PullError as error:
            _end(pull, str(error))
        except Exception as error:
            log.exception("the pull of %s failed", pull.url)
            _end(pull, f"the pull stopped on an error ({type(error).__name__}: {error}); the worker's log has the rest")
        except BaseException:
            # Killed (SIGTERM in a command, a worker shut down): the row says so at once.
            _end(pull, "the pull was stopped before it finished; nothing of it is in the mirror")
            raise
    pull.refresh_from_db()
    return pull


def _named(pull: MirrorPull) -> tuple[str, str]:
    return pull.model, pull.version


def _end(pull: MirrorPull, error: str) -> None:
    log.warning("pull of %s: %s", pull.url, error)
    MirrorPull.objects.filter(pk=pull.pk).update(
        state=MirrorPull.State.FAILED, error=error, pass_key="", finished=timezone.now()
    )


def _wait_for(what: Callable, wait_until: float, wait_s: float, deadline: Deadline):
    while True:
        try:
            return what()
        except NotReadyYet as not_yet:
            if time.monotonic() + not_yet.retry_after > wait_until:
                raise PullError(f"{not_yet} (waited {wait_s:g} s)") from None
            if not_yet.retry_after >= deadline.left():
                raise Stopped(deadline.sentence) from None
            time.sleep(not_yet.retry_after)


def _ready_manifest(address: Address, who: Credentials, deadline: Deadline) -> Manifest:
    """The manifest once the other mirror offers the version whole with its torrent; NotReadyYet until then."""
    manifest = read_manifest(address, who, deadline)
    if not manifest.info_hash:
        if torrent_coming(address, who, deadline):
            raise NotReadyYet("the other mirror is still computing the version's torrent", 5)
        raise PullError(no_torrent(address))
    return manifest


def _pull(pull: MirrorPull, swarm_factory: Callable | None, wait_s: float) -> None:
    address = parse_address(pull.url)
    who = Credentials(pull.node, pull.pass_key)
    target = disk.root() / address.model / address.version
    if target.exists() or target.is_symlink():
        raise PullError(f"this mirror already has {address.model}/{address.version}; a pull never replaces a version")
    seconds = settings.PULL_DEADLINE_S
    # The whole pull, from the first request: a server that trickles can hold none of it for longer.
    deadline = Deadline(
        seconds,
        f"the pull did not finish within {_duration(seconds)} (LLMGW_PULL_DEADLINE_S): the other mirror answered "
        "or sent too slowly; what was copied is removed and nothing of it is in the mirror",
    )
    wait_until = time.monotonic() + wait_s
    manifest = _wait_for(lambda: _ready_manifest(address, who, deadline), wait_until, wait_s, deadline)
    data = _wait_for(lambda: read_torrent(address, manifest, who, deadline), wait_until, wait_s, deadline)
    MirrorPull.objects.filter(pk=pull.pk).update(bytes_total=manifest.bytes, updated=timezone.now())
    if problem := room_problem(address, manifest):
        raise PullError(problem)  # before anything is staged: what an earlier pull verified is kept

    staging = prepare_staging(address, manifest)
    resume = staging.with_name(f"{address.version}.resume")
    fetch_version(pull, address, who, manifest, data, staging, resume, deadline, swarm_factory)
    put_in_mirror(address, manifest, staging, target, resume, data)
    MirrorPull.objects.filter(pk=pull.pk).update(
        state=MirrorPull.State.DONE, bytes_done=manifest.bytes, pass_key="", error="", finished=timezone.now()
    )
    log.info("pulled %s/%s from %s", address.model, address.version, address.base)
