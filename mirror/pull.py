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
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import libtorrent as lt
import requests
import urllib3
from django.conf import settings
from django.template.defaultfilters import filesizeformat
from django.utils import timezone

from contracts import credentials, signing
from contracts.digest import sha256_file
from contracts.names import node_name_problem, plain_name_problem

from . import clocked, disk, headers, scan, torrent
from .models import MirrorFile, MirrorPull, MirrorVersion

log = logging.getLogger(__name__)

STAGING = ".pull"  # under the mirror root: hidden, so never a model
MANIFEST_LIMIT = 1 << 20
TORRENT_LIMIT = 64 << 20
CONNECT_S, READ_S = 10, 60
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# How long a pull waits for the other mirror to offer the version whole (and its torrent).
WAIT_S = 600
PROGRESS_EVERY_S = 0.5


class PullError(Exception):
    """A pull that cannot go on; str() is the sentence for staff."""


class Stopped(PullError):
    """A pull stopped by a bound (its deadline, the disk's room): its copy so far is removed."""


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"


class Deadline:
    """When something must be over, and the sentence said when it is not."""

    def __init__(self, seconds: float, sentence: str):
        self.at = time.monotonic() + seconds
        self.sentence = sentence

    def left(self) -> float:
        return self.at - time.monotonic()

    def check(self) -> None:
        if self.left() <= 0:
            raise Stopped(self.sentence)


@dataclass(frozen=True)
class Address:
    """A version's address on another byte listener, taken apart."""

    base: str  # scheme://host:port/
    model: str
    version: str

    @property
    def url(self) -> str:
        return f"{self.base}{quote(self.model)}/{quote(self.version)}/"


def parse_address(url: str) -> Address:
    """The version an address names, or PullError saying why it is not a version's address."""
    url = (url or "").strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PullError(
            f"{url!r} is not an address on a byte listener: it should look like https://mirror:8001/<model>/<version>/"
        )
    if parts.scheme == "http" and not settings.PULL_ALLOW_HTTP:
        raise PullError(
            f"{url} is plain http: a pull goes over https only, so that no one on the way reads this site's pass "
            "or changes what the other mirror says; LLMGW_PULL_ALLOW_HTTP=true allows http on a network you trust"
        )
    if "@" in parts.netloc:
        raise PullError(
            "the address carries credentials: give this site's node name and token apart from it "
            "(an address is shown on pages and in logs)"
        )
    if parts.query or parts.fragment:
        raise PullError(f"{url!r} has a query or a fragment; a version's address is /<model>/<version>/ alone")
    segments = parts.path.split("/")
    # "/m/v/" splits into ["", "m", "v", ""].
    if len(segments) != 4 or segments[0] != "" or segments[3] != "":
        if len(segments) == 4 and segments[3]:
            raise PullError(f"{url} names a file, not a version: a version's address ends in /<model>/<version>/")
        raise PullError(f"{url} is not a version's address: it should end in /<model>/<version>/, with the slash")
    model, version = unquote(segments[1]), unquote(segments[2])
    for what, name in (("model", model), ("version", version)):
        if problem := plain_name_problem(name):
            raise PullError(f"the address names the {what} {name!r}, which this mirror cannot hold: {problem}")
    return Address(f"{parts.scheme}://{parts.netloc}/", model, version)


# --- the other site's credentials ---------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """This site's node name at the other site and the key its passes are made with ("" and "": none)."""

    node: str = ""
    key: str = ""

    @classmethod
    def of(cls, node: str, token: str) -> Credentials:
        node, token = (node or "").strip(), (token or "").strip()
        if not node and not token:
            return cls()
        if not node or not token:
            raise PullError(
                "give both this site's node name at the other site and the token it issued "
                "(`manage.py node_token NAME` there), or neither for a public mirror"
            )
        if problem := node_name_problem(node):
            raise PullError(problem)
        return cls(node, signing.token_hash(token))

    def headers(self) -> dict[str, str]:
        return credentials.bearer(credentials.bytes_pass(self.key, self.node)) if self.key else {}

    def web_seed(self, url: str) -> str:
        """`url` with a current pass as its Basic credentials: what libtorrent sends a web seed.

        The same pass for a quarter of its life, then the next: libtorrent is asked for the
        web seeds every second, and a changed URL is a new web seed (its connection
        and requests dropped), so the URL changes only when the pass must.
        """
        if not self.key:
            return url
        window = credentials.BYTES_PASS_TTL_S // 4
        made = int(time.time()) // window * window
        parts = urlsplit(url)
        userinfo = f"{quote(self.node, safe='')}:{credentials.bytes_pass(self.key, self.node, now=made)}"
        return parts._replace(netloc=f"{userinfo}@{parts.netloc}").geturl()


# --- what the other mirror says ---------------------------------------------------------


@dataclass
class Manifest:
    files: list[tuple[str, int, str]]  # (name, bytes, sha256)
    bytes: int
    torrent_url: str = ""
    info_hash: str = ""


class NotReadyYet(PullError):
    def __init__(self, sentence: str, retry_after: int):
        super().__init__(sentence)
        self.retry_after = retry_after


def _get(url: str, who: Credentials, limit: int, deadline: Deadline) -> tuple[requests.Response, bytes]:
    deadline.check()
    left = deadline.left()
    cut = clocked.Cut(left)
    try:
        with cut, clocked.session() as session:
            response = session.get(
                url,
                headers=who.headers(),
                timeout=(min(CONNECT_S, left), min(READ_S, left)),
                stream=True,
                allow_redirects=False,
            )
            with response:
                body = response.raw.read(limit + 1, decode_content=True)
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as error:
        # the read timeout is the deadline's too (min(READ_S, left)): whichever clock fired first, it is the deadline
        if cut.cut or deadline.left() <= 0.05:
            raise Stopped(deadline.sentence) from None
        raise PullError(f"{url} could not be reached: {type(error).__name__}") from None
    if cut.cut:  # a body cut short can look whole (no Content-Length): never taken
        raise Stopped(deadline.sentence)
    if len(body) > limit:
        raise PullError(f"{url} answered more than {limit >> 20} MiB where a version's manifest was expected")
    return response, body


def _said(body: bytes) -> str:
    try:
        said = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return said if isinstance(said, str) else ""


def read_manifest(address: Address, who: Credentials, deadline: Deadline) -> Manifest:
    """The other mirror's manifest of the version, checked; PullError (NotReadyYet to wait on) saying what is wrong."""
    url = address.url
    response, body = _get(url, who, MANIFEST_LIMIT, deadline)
    status = response.status_code
    if status == 401:
        if not who.key:
            raise PullError(
                f"the byte listener at {address.base} serves only its fleet and this pull presented no credentials: "
                "give this site's node name there and the token it issued (`manage.py node_token NAME` on that site)"
            )
        raise PullError(
            f"the byte listener at {address.base} refused this site's credentials (node {who.node}): "
            f"{_said(body) or 'it said no more'}"
        )
    if status == 404:
        raise PullError(f"the mirror at {address.base} has no version {address.model}/{address.version} (404)")
    if status in (301, 302, 303, 307, 308):
        raise PullError(f"{url} answered a redirect to {response.headers.get('Location', '?')}; give that address")
    content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type == "text/html" or body.lstrip()[:1] == b"<":
        raise PullError(
            f"{url} answered an HTML page, not a version's manifest: it is not an llmgw byte listener's "
            "address of a version"
        )
    try:
        data = json.loads(body)
    except ValueError:
        raise PullError(f"{url} answered {status} with something that is not a version's manifest (not JSON)") from None
    if not isinstance(data, dict):
        raise PullError(f"{url} did not answer a version's manifest")
    if status == 503 and data.get("ready") is False:
        value = response.headers.get("Retry-After", "")
        raise NotReadyYet(
            f"the other mirror does not offer {address.model}/{address.version} whole yet: {data.get('error') or '?'}",
            min(60, max(1, int(value))) if value.isdigit() else 10,
        )
    if status != 200:
        raise PullError(f"{url} answered {status}{': ' + _said(body) if _said(body) else ''}")
    if "models" in data or "versions" in data:
        raise PullError(f"{url} is a listing of the other mirror, not a version's address")
    if (
        data.get("model") != address.model
        or data.get("version") != address.version
        or not isinstance(data.get("files"), list)
    ):
        raise PullError(f"{url} did not answer the manifest of {address.model}/{address.version}")
    files = []
    for entry in data["files"]:
        name = entry.get("name") if isinstance(entry, dict) else None
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(name, str) or (problem := plain_name_problem(name)):
            raise PullError(
                f"the other mirror's manifest names a file this mirror cannot hold: {problem or repr(name)}"
            )
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PullError(f"the other mirror's manifest gives {name} no size")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            raise PullError(f"the other mirror's manifest gives {name} no sha256; a version is pulled only verified")
        files.append((name, size, digest))
    if not files:
        raise PullError(f"the other mirror's {address.model}/{address.version} holds no file")
    if len({name for name, _, _ in files}) != len(files):
        raise PullError("the other mirror's manifest names a file twice")
    offered = data.get("torrent") if isinstance(data.get("torrent"), dict) else {}
    manifest = Manifest(files, sum(size for _, size, _ in files))
    if isinstance(offered.get("info_hash"), str) and SHA256.fullmatch(offered["info_hash"]):
        manifest.info_hash = offered["info_hash"]
        # Asked of the address we were given, not of wherever the manifest points: the credentials go nowhere else.
        manifest.torrent_url = url + "?torrent"
    return manifest


def read_torrent(address: Address, manifest: Manifest, who: Credentials, deadline: Deadline) -> bytes:
    """The version's torrent from the other mirror, when it describes exactly the manifest's files."""
    response, data = _get(manifest.torrent_url, who, TORRENT_LIMIT, deadline)
    if response.status_code == 503:
        raise NotReadyYet("the other mirror is still computing the version's torrent", 5)
    if response.status_code != 200:
        raise PullError(f"{manifest.torrent_url} answered {response.status_code}: {_said(data) or 'no torrent'}")
    check_torrent(data, address, manifest)
    return data


def check_torrent(data: bytes, address: Address, manifest: Manifest) -> lt.torrent_info:
    """The torrent, when it is v2, private, the manifest's info-hash, and exactly its files; else PullError."""
    try:
        info = lt.torrent_info(lt.bdecode(data))
    except (RuntimeError, TypeError, ValueError):
        raise PullError("the other mirror's torrent is not a torrent") from None
    hashes = info.info_hashes()
    if not hashes.has_v2() or hashes.has_v1():
        raise PullError("the other mirror's torrent is not a BitTorrent v2 torrent; refused")
    if str(hashes.v2) != manifest.info_hash:
        raise PullError(f"the other mirror's torrent is {hashes.v2}, not the manifest's {manifest.info_hash}; refused")
    if not info.priv():
        raise PullError("the other mirror's torrent is not private; refused")
    layout = info.layout()
    paths = {
        layout.file_path(i): layout.file_size(i)
        for i in range(layout.num_files())
        if not layout.file_flags(i) & lt.file_storage.flag_pad_file
    }
    single = len(paths) == 1 and "/" not in next(iter(paths))
    if not single and info.name() != address.version:
        raise PullError(f"the other mirror's torrent is for the folder {info.name()!r}, not {address.version!r}")
    found = {path.removeprefix(address.version + "/"): size for path, size in paths.items()}
    wanted = {name: size for name, size, _ in manifest.files}
    if found != wanted:
        raise PullError(
            "the other mirror's torrent disagrees with its manifest "
            f"(it has {sorted(found.items())}, the manifest {sorted(wanted.items())}); refused"
        )
    return info


# --- the pull ------------------------------------------------------------------------


def staging_of(model: str, version: str) -> Path:
    return disk.root() / STAGING / model / version


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
    if not manifest.info_hash and not _torrent_coming(address, who, deadline):
        raise PullError(_no_torrent(address))
    if problem := room_problem(address, manifest):
        raise PullError(problem)
    return address, who


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


def _room_ran_out(address: Address, manifest: Manifest) -> str | None:
    """Why the copy under way can no longer finish on the mirror's disk (something else took the room); None if it can."""
    needed = manifest.bytes - _staged_bytes(address, manifest)
    free = _free_bytes()
    if free >= needed:
        return None
    return (
        f"the mirror's disk ran out of room during the pull: {filesizeformat(free)} free, "
        f"{filesizeformat(needed)} still to come; the copy so far is removed and nothing of it is in the mirror"
    )


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


def _no_torrent(address: Address) -> str:
    return (
        f"the other mirror offers no torrent for {address.model}/{address.version} (an llmgw mirror from before "
        "torrents, or another server); a pull copies through libtorrent only"
    )


def _torrent_coming(address: Address, who: Credentials, deadline: Deadline) -> bool:
    """Whether a ready manifest without a torrent is one whose torrent is still being made (a large version)."""
    response, _ = _get(address.url + "?torrent", who, TORRENT_LIMIT, deadline)
    return response.status_code == 503


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


def _pull(pull: MirrorPull, swarm_factory: Callable | None, wait_s: float) -> None:
    from contracts.swarm import Swarm, SwarmError

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

    def ready_manifest() -> Manifest:
        manifest = read_manifest(address, who, deadline)
        if not manifest.info_hash:
            if _torrent_coming(address, who, deadline):
                raise NotReadyYet("the other mirror is still computing the version's torrent", 5)
            raise PullError(_no_torrent(address))
        return manifest

    manifest = _wait_for(ready_manifest, wait_until, wait_s, deadline)
    data = _wait_for(lambda: read_torrent(address, manifest, who, deadline), wait_until, wait_s, deadline)
    single = len(manifest.files) == 1 and "/" not in lt.torrent_info(lt.bdecode(data)).layout().file_path(0)
    MirrorPull.objects.filter(pk=pull.pk).update(bytes_total=manifest.bytes, updated=timezone.now())
    if problem := room_problem(address, manifest):
        raise PullError(problem)  # before anything is staged: what an earlier pull verified is kept

    staging = staging_of(address.model, address.version)
    staging.mkdir(parents=True, exist_ok=True)
    resume = staging.with_name(f"{address.version}.resume")
    wanted = {name for name, _, _ in manifest.files}
    for leftover in staging.iterdir():
        # From an earlier pull of another content under the same name: not part of this one.
        if leftover.name not in wanted:
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()

    # A web seed for a folder torrent is the folder's parent (libtorrent adds "<version>/<file>");
    # for a single-file torrent, the folder itself (it adds "<file>").
    seed = address.url if single else f"{address.base}{quote(address.model)}/"
    last = [0.0]

    def progress(status) -> None:
        # Raised here, the fetch stops at once (contracts.swarm): the bounds are checked at every look.
        deadline.check()
        if problem := _room_ran_out(address, manifest):
            raise Stopped(problem)
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            MirrorPull.objects.filter(pk=pull.pk).update(
                bytes_done=status.bytes_done, bytes_total=status.bytes_total or manifest.bytes, updated=timezone.now()
            )

    swarm = (swarm_factory or (lambda: Swarm(listen_port=0, listen_host="127.0.0.1")))()
    try:
        swarm.allow([])  # a pull takes pieces from the other mirror only, and serves none
        swarm.fetch(
            data,
            staging,
            web_seeds=lambda: [who.web_seed(seed)],
            progress=progress,
            resume_path=resume,
            keep_seeding=False,
        )
    except SwarmError as error:
        if problem := _room_ran_out(address, manifest):  # libtorrent's own "no space left on device"
            raise Stopped(problem) from None
        raise PullError(f"the copy did not finish: {error}") from None
    finally:
        swarm.close()

    verified = _verify(staging, manifest)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        raise PullError(f"{address.model}/{address.version} appeared in this mirror during the pull; left as it is")
    os.rename(staging, target)
    resume.unlink(missing_ok=True)
    _index(address, manifest, verified, data)
    MirrorPull.objects.filter(pk=pull.pk).update(
        state=MirrorPull.State.DONE, bytes_done=manifest.bytes, pass_key="", error="", finished=timezone.now()
    )
    log.info("pulled %s/%s from %s", address.model, address.version, address.base)


def _verify(staging: Path, manifest: Manifest) -> dict[str, tuple[int, int, str]]:
    """Every file whole and its sha256 the manifest's: name -> (bytes, mtime_ns, sha256) as they are now."""
    disk.mark_settled(staging)  # whole once renamed: not "still being written" for LLMGW_MIRROR_SETTLE_S
    on_disk = {p.name for p in staging.iterdir()}
    if on_disk != {name for name, _, _ in manifest.files}:
        raise PullError(f"the copy holds {sorted(on_disk)}, not the manifest's files; nothing was put in the mirror")
    verified = {}
    for name, size, digest in manifest.files:
        path = staging / name
        before = os.stat(path)
        if before.st_size != size:
            raise PullError(f"{name} is {before.st_size:,} bytes after the copy, not {size:,}")
        got = sha256_file(path)
        if got != digest:
            # Dropped with the resume record that counted its pieces as verified, so the next pull fetches it again.
            path.unlink()
            staging.with_name(f"{staging.name}.resume").unlink(missing_ok=True)
            raise PullError(
                f"{name}'s sha256 is {got}, not the other mirror's {digest}: the file is dropped and fetched again "
                "at the next pull; nothing was put in the mirror"
            )
        verified[name] = (before.st_size, before.st_mtime_ns, digest)
    return verified


def _index(address: Address, manifest: Manifest, verified: dict[str, tuple[int, int, str]], data: bytes) -> None:
    """The version in this mirror's index at once, with the hashes just checked and the torrent just used.

    The sha256s are stored against the size and mtime they were computed for, so a file
    touched since is hashed again as usual; the torrent is the other mirror's, which has
    the same info-hash this mirror would compute (same files, same piece size).
    """
    report = scan.index_version(address.model, address.version)
    for name, (size, mtime_ns, digest) in verified.items():
        MirrorFile.objects.filter(
            version__model=address.model,
            version__version=address.version,
            name=name,
            bytes=size,
            mtime_ns=mtime_ns,
            sha256="",
        ).update(sha256=digest, hashed_at=timezone.now())
    triples = [(name, size, digest) for name, (size, _, digest) in verified.items()]
    if torrent.PIECE_BYTES == lt.torrent_info(lt.bdecode(data)).piece_length():
        MirrorVersion.objects.filter(model=address.model, version=address.version).update(
            torrent=data, torrent_info_hash=manifest.info_hash, torrent_of=torrent.fingerprint(triples)
        )
    headers.read_changed(report)
