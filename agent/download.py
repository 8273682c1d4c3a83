"""One address into one file: through `<target>.part`, resumed with Range, renamed when whole.

The caller holds the target's lock (`fetch_state.locked`) and has checked that
the target is not already there. A part is kept across failures, paired with
the validator of the file it is the start of, so the next attempt resumes it.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import urljoin

import requests
from django.conf import settings

from contracts import credentials, signing
from contracts.digest import sha256_file

from . import runtime
from .fetch_state import read_validator, write_validator
from .progress import Progress, human_bytes
from .sources import TIMEOUT, Entry, FetchError, MirrorChanged, describe, origin, status_error

CHUNK = 1 << 20


class OneHostSession(requests.Session):
    """A session that follows a redirect only to the host and port it was made for.

    The source was checked before any request (`refuse_other_hosts`); a redirect must
    not take the fetch somewhere the check would have refused.
    """

    def __init__(self, source: str):
        super().__init__()
        self.headers["User-Agent"] = "llmgw-agent"
        self.source = source

    def get_redirect_target(self, resp):
        target = super().get_redirect_target(resp)
        if target:
            where = urljoin(resp.url, target)
            if origin(where) != origin(self.source):
                raise FetchError(f"{resp.url} redirected to {where}, another host; it is not followed")
        return target


class NodePass(requests.auth.AuthBase):
    """This node's pass for the byte listener, made afresh for every request (it expires)."""

    def __init__(self, node: str, token: str):
        self.node = node
        self.key = signing.token_hash(token)

    def __call__(self, request):
        request.headers.update(credentials.bearer(credentials.bytes_pass(self.key, self.node)))
        return request


def new_session(source: str) -> requests.Session:
    """A session for one source; it presents this node's pass, to this node's byte listener only.

    The node is who LLMGW_NODE_NAME and LLMGW_NODE_TOKEN say (`manage.py agent` sets
    both; `manage.py fetch` reads them). A one-off copy from another host
    (`--allow-any-host`) never carries the pass there.
    """
    session = OneHostSession(source)
    node, token = runtime.node_name(), runtime.token()
    if node and token and origin(source) == origin(settings.BYTES_URL):
        session.auth = NodePass(node, token)
    return session


def part_of(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def head_size(session: requests.Session, url: str) -> int | None:
    try:
        response = session.head(url, timeout=TIMEOUT, allow_redirects=True)
    except requests.RequestException as error:
        raise FetchError(f"asking {url} its size: {describe(error)}", transient=True) from None
    if response.status_code != 200:
        raise status_error(url, response.status_code, response)
    length = response.headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


def check_space(source: str, directory: Path, missing: int) -> None:
    """Refuse up front: a disk that fills at 90% wastes the hour it took to get there."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if missing > free:
        raise FetchError(
            f"fetching {source} needs {missing:,} more bytes ({human_bytes(missing)}) but only {free:,} bytes "
            f"({human_bytes(free)}) are free under {directory}"
        )


def fetch_file(
    session: requests.Session,
    url: str,
    target: Path,
    cache: Path,
    progress: Progress,
    entry: Entry | None = None,
    cancel: threading.Event | None = None,
    size: int | None = None,
    need_sha256: bool = False,
) -> None:
    """Download url into target through <target>.part, resuming a part left by an earlier attempt.

    The file is `entry.bytes` long (the manifest's word), or `size` (a HEAD's), or the
    answer's own Content-Length: a body that goes on past that is an error, not a bigger file.
    """
    part = part_of(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    validator, have = _resumable_part(cache, target, part, entry)
    for _attempt in range(2):
        with _range_request(session, url, have, validator) as response:
            if response.status_code == 416 and have:
                if _content_range(response)[1] == have:
                    # The part is already whole: an earlier attempt died between the
                    # last byte and the rename.
                    _finish(url, part, target, have, entry, progress, need_sha256)
                    return
                # The part is longer than the file now is: it was a part of something else.
                part.unlink()
                progress.restarted(have)
                have, validator = 0, {}
                continue
            mode, have, total, expected_body = _how_to_write(response, url, have, progress)
            # Before the validator is touched: a part must never be paired with the
            # validator of a file it is not the start of.
            if entry is not None and total is not None and total != entry.bytes:
                raise MirrorChanged(
                    f"{url} is {total:,} bytes but the mirror's manifest said {entry.bytes:,}: the file changed on "
                    "the mirror since the manifest was read; fetch again"
                )
            if mode == "wb":
                part.unlink(missing_ok=True)
                etag, last_modified = response.headers.get("ETag", ""), response.headers.get("Last-Modified", "")
                write_validator(cache, target, etag, last_modified, total)
            promised = [n for n in (entry.bytes if entry else None, size, total) if n is not None]
            limit = min(promised) - have if promised else None
            received = _copy_body(response, part, mode, url, have, progress, cancel, limit)
            if expected_body is not None and received < expected_body:
                raise FetchError(
                    f"{url} ended after {have + received:,} of {have + expected_body:,} bytes; the part is kept and "
                    "the next attempt resumes from there",
                    transient=True,
                )
            _finish(
                url, part, target, total if total is not None else part.stat().st_size, entry, progress, need_sha256
            )
            return
    raise FetchError(f"{url} kept refusing the range of an earlier attempt; the part was removed, fetch again")


def _resumable_part(cache: Path, target: Path, part: Path, entry: Entry | None) -> tuple[dict, int]:
    """The validator and the bytes of a part an earlier attempt left, or ({}, 0) when it cannot be continued."""
    validator = read_validator(cache, target)
    have = part.stat().st_size if part.exists() else 0
    if have and not validator:
        # A part with no record of what it is a part of cannot be trusted to
        # continue anything: it might be the start of a different file.
        part.unlink()
        have = 0
    if entry is not None and have > entry.bytes:
        part.unlink()
        have = 0
    return validator, have


def _range_request(session: requests.Session, url: str, have: int, validator: dict) -> requests.Response:
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
        # If-Range: the range applies only to the file the part came from.
        # A file replaced on the mirror comes back whole with a 200.
        if if_range := validator.get("etag") or validator.get("last_modified"):
            headers["If-Range"] = if_range
    try:
        return session.get(url, headers=headers, stream=True, timeout=TIMEOUT)
    except requests.RequestException as error:
        raise FetchError(f"fetching {url}: {describe(error)}; the next attempt resumes", transient=True) from None


def _content_range(response: requests.Response) -> tuple[int | None, int | None]:
    """(start, total) from `bytes a-b/total` or `bytes */total`."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", response.headers.get("Content-Range") or "")
    if not m:
        return None, None
    start = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return start, total


def _how_to_write(
    response: requests.Response, url: str, have: int, progress: Progress
) -> tuple[str, int, int | None, int | None]:
    """(file mode, bytes of the part kept, the file's size, the body's size) for an answer to the request."""
    if response.status_code == 206 and have:
        start, total = _content_range(response)
        if start != have or total is None:
            raise FetchError(
                f"{url} answered a request for bytes from {have:,} with the range "
                f"{response.headers.get('Content-Range')!r}; the part is kept"
            )
        return "ab", have, total, total - have
    if response.status_code == 200:
        if have:
            # The server ignored Range or the file changed: start the file over.
            # Appending a whole file to a part would make a file that is neither.
            progress.restarted(have)
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        return "wb", 0, total, total
    raise status_error(url, response.status_code, response)


def _copy_body(
    response, part: Path, mode: str, url: str, have: int, progress: Progress, cancel, limit: int | None
) -> int:
    """Append (or write) the body to the part; returns the bytes received. The part is kept on failure.

    At most `limit` bytes: a server that sends more than the file has (an endless body)
    would otherwise fill the disk. That part is removed, since its end is not the file's.
    """
    received = 0
    with open(part, mode) as out:
        while True:
            if cancel is not None and cancel.is_set():
                raise FetchError("stopped")
            try:
                chunk = response.raw.read1(CHUNK, decode_content=False)
            except Exception as error:  # urllib3's ProtocolError, IncompleteRead, ReadTimeoutError
                out.flush()
                reason = "timed out" if "timed out" in str(error).lower() else "the connection ended early"
                raise FetchError(
                    f"{url} stopped after {have + received:,} bytes ({reason}); the part is kept and the next "
                    "attempt resumes from there",
                    transient=True,
                ) from None
            if not chunk:
                return received
            if limit is not None and received + len(chunk) > limit:
                out.close()
                part.unlink(missing_ok=True)
                raise FetchError(
                    f"{url} sent more than the {have + limit:,} bytes the file has; the download was removed and "
                    "the next attempt starts it over"
                )
            try:
                out.write(chunk)
            except OSError as error:
                raise FetchError(f"writing {part}: {error.strerror}") from None
            received += len(chunk)
            progress.advanced(len(chunk))


def _finish(
    url: str, part: Path, target: Path, total: int, entry: Entry | None, progress: Progress, need_sha256: bool = False
) -> None:
    """Rename a part into place, only when it is whole: its size, and its sha256 where known (or `need_sha256`)."""
    size = part.stat().st_size
    if size > total:
        # Longer than the file: no later attempt could make it right by appending.
        part.unlink()
        raise FetchError(
            f"{url} gave more bytes ({size:,}) than the file has ({total:,}); the next attempt starts over"
        )
    if size != total:
        raise FetchError(
            f"{url} gave {size:,} bytes where {total:,} were expected; the part is kept for the next attempt",
            transient=True,
        )
    if entry is not None and entry.bytes != total:
        part.unlink()
        raise MirrorChanged(
            f"{url} is {total:,} bytes but the mirror's manifest said {entry.bytes:,}: the file changed on the "
            "mirror during the fetch; fetch again"
        )
    if need_sha256 and (entry is None or not entry.sha256):
        # A size is not a proof: a file still being copied in has a size too.
        raise FetchError(
            f"{url}: the mirror gives no sha256 for it, and a file is taken as whole only when its sha256 agrees "
            "with the mirror's; the part is kept and the next attempt asks again",
            transient=True,
        )
    if entry is not None and entry.sha256:
        progress.set_state("verifying")
        actual = sha256_file(part)
        if actual != entry.sha256:
            part.unlink()
            raise FetchError(
                f"{url} does not match its sha256 (expected {entry.sha256}, got {actual}); the download was "
                "removed and the next attempt starts it over"
            )
        progress.set_state("fetching")
    with open(part, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(part, target)
    fsync_dir(target.parent)
