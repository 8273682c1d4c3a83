"""What another llmgw's byte listener says of a version, checked, for a pull (mirror/pull.py).

A version's address taken apart, this site's credentials there, and its manifest and torrent
read under a deadline and checked against each other: everything the other site sends is
another site's word, so each answer is refused with a sentence unless it is a version's
manifest (or torrent) that this mirror can hold. Every request has a clock of its whole
(`clocked.Cut`), not only of each read: a server that sends a byte every few seconds never
trips a read timeout.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

import libtorrent as lt
import requests
import urllib3
from django.conf import settings

from contracts import credentials, signing
from contracts.names import node_name_problem, plain_name_problem

from . import clocked

MANIFEST_LIMIT = 1 << 20
TORRENT_LIMIT = 64 << 20
CONNECT_S, READ_S = 10, 60
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PullError(Exception):
    """A pull that cannot go on; str() is the sentence for staff."""


class Stopped(PullError):
    """A pull stopped by a bound (its deadline, the disk's room): its copy so far is removed."""


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
    data = _manifest_answered(address, who, response, body)
    files = _manifest_files(address, data)
    offered = data.get("torrent") if isinstance(data.get("torrent"), dict) else {}
    manifest = Manifest(files, sum(size for _, size, _ in files))
    if isinstance(offered.get("info_hash"), str) and SHA256.fullmatch(offered["info_hash"]):
        manifest.info_hash = offered["info_hash"]
        # Asked of the address we were given, not of wherever the manifest points: the credentials go nowhere else.
        manifest.torrent_url = url + "?torrent"
    return manifest


def _manifest_answered(address: Address, who: Credentials, response: requests.Response, body: bytes) -> dict:
    """The answer's JSON when it is the manifest of the version asked for; PullError saying what it is instead."""
    url = address.url
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
    return data


def _manifest_files(address: Address, data: dict) -> list[tuple[str, int, str]]:
    """The manifest's (name, bytes, sha256), each a file this mirror can hold and pull verified."""
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
    return files


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


def no_torrent(address: Address) -> str:
    return (
        f"the other mirror offers no torrent for {address.model}/{address.version} (an llmgw mirror from before "
        "torrents, or another server); a pull copies through libtorrent only"
    )


def torrent_coming(address: Address, who: Credentials, deadline: Deadline) -> bool:
    """Whether a ready manifest without a torrent is one whose torrent is still being made (a large version)."""
    response, _ = _get(address.url + "?torrent", who, TORRENT_LIMIT, deadline)
    return response.status_code == 503
