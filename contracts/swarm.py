"""Fetching and seeding a torrent's files with libtorrent: the one download primitive both sides use (issue 24).

The agent fetches sets with it (its one session per node, `agent/peers.py`), and the
control plane's `mirror_pull` copies versions from another mirror with it. No Django and
no app here: a process makes one `Swarm` and keeps it.

    swarm = Swarm(listen_port=6881)                 # one per process; 0 picks a free port
    swarm.allow(["10.0.0.21", "10.0.0.22"])         # who may connect or be connected to; None: anyone
    done = swarm.fetch(
        torrent_bytes, dest_dir,
        web_seeds=["http://node:PASS@mirror:8001/model/"],   # or a callable, asked again every second
        peers=[("10.0.0.22", 6881)],                          # or a callable, asked again every second
        progress=callback,                                    # called with a SwarmStatus; raising stops the fetch
        resume_path=dest_dir.parent / ".resume",              # libtorrent's resume data, kept across kills
        stall_bytes_s=1 << 20, stall_s=20,
    )                                                # -> Fetched, or raises SwarmError with a sentence
    swarm.seed(torrent_bytes, dest_dir)              # serve files already whole, without hashing them again

Files are written straight into `dest_dir` under their paths inside the torrent (its root
folder dropped): a version `v1` of two files lands as `dest_dir/a` and `dest_dir/b`.

What counts is what libtorrent verified: a BitTorrent v2 torrent carries a SHA-256 Merkle
tree per file, so a piece is written as done only when its hash agrees, and a peer that
sent a block failing its hash is banned (it is named in `Fetched.banned`). Whole-file
hashes (a manifest's sha256) are the caller's to check: this module does not know them.

Stalls: a source (a peer, or a web seed) with requests outstanding that delivers less than
`stall_bytes_s` over `stall_s` loses them: a web seed's server is taken out of the torrent (every
URL of it: the mirror given as several URLs, one connection each, is one source, its connections
counted together), a peer's address is blocked, both for `stall_s` (then tried again), and libtorrent asks the other
sources for those pieces (it goes on to end-game, asking the last pieces of several
sources at once). When nothing has arrived from anyone for `stall_s`, `SwarmStatus.all_stalled`
is true and `SwarmStatus.why` names every source ("every source stalled: the mirror
http://mirror:8001/m/, peer 10.0.0.22:6881"); after `give_up_s` (default 10 × stall_s) of
that, `fetch` raises SwarmError (transient), every verified piece kept.

Private torrents only: the session runs without DHT, local discovery, UPnP or NAT-PMP, TCP
only; peers are whoever the caller names, and `allow` is the only gate on who connects.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import libtorrent as lt

log = logging.getLogger(__name__)

PeerList = Sequence[tuple[str, int]] | Callable[[], Sequence[tuple[str, int]]]
UrlList = Sequence[str] | Callable[[], Sequence[str]]

POLL_S = 0.5
# How often the callables for web seeds and peers are asked again (a new peer, a pass renewed): a peer
# that joined is connected to within a second, rather than after the mirror sent what it could have.
PEERS_S = 1.0
# How often resume data is written while pieces arrive: a kill loses at most this much verified work.
RESUME_EVERY_S = 1.0
ALERTS = (
    lt.alert_category.error
    | lt.alert_category.status
    | lt.alert_category.storage
    | lt.alert_category.peer
    | lt.alert_category.ip_block
)


class SwarmError(Exception):
    """A fetch that did not finish; str() is the sentence. `transient` when trying again may well succeed."""

    def __init__(self, sentence: str, transient: bool = False):
        super().__init__(sentence)
        self.transient = transient


@dataclass
class SwarmStatus:
    """What a fetch is doing, given to `progress` about twice a second."""

    bytes_done: int
    bytes_total: int
    bytes_from_peers: int
    bytes_from_web_seeds: int
    pieces_done: int
    pieces_total: int
    peers: int  # connected sources, web seeds included
    stalled: tuple[str, ...] = ()  # sources abandoned for stalling, by name, right now
    all_stalled: bool = False  # nothing has arrived for stall_s: every source there is has stalled
    why: str = ""  # when all_stalled, the sentence naming them ("every source stalled: peer 10.0.0.22:6881, ...")
    events: tuple[str, ...] = ()  # sentences since the last status: a ban, a source dropped


@dataclass
class Fetched:
    bytes_total: int
    bytes_from_peers: int
    bytes_from_web_seeds: int
    seconds: float
    banned: list[str] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)  # sources that were abandoned on the way


def torrent_info(torrent: bytes) -> lt.torrent_info:
    try:
        return lt.torrent_info(lt.bdecode(torrent))
    except (RuntimeError, TypeError, ValueError):
        raise SwarmError("the torrent given is not a torrent") from None


def info_hash_of(torrent: bytes | lt.torrent_info) -> str:
    """The v2 info-hash (hex) of a torrent: what it is known by here."""
    info = torrent if isinstance(torrent, lt.torrent_info) else torrent_info(torrent)
    hashes = info.info_hashes()
    return str(hashes.v2 if hashes.has_v2() else hashes.v1)


def _rooted(info: lt.torrent_info) -> dict[int, str]:
    """Where each file goes: its path in the torrent with the root folder dropped (for add_torrent_params.renamed_files).

    Only where the files go on this disk: the info-hash, and the paths asked of a web seed
    (libtorrent uses the torrent's own names for those), stay the torrent's.
    """
    layout = info.layout()
    renamed = {}
    for i in range(layout.num_files()):
        if layout.file_flags(i) & lt.file_storage.flag_pad_file:
            continue
        root, sep, rest = layout.file_path(i).partition("/")
        if sep:
            renamed[i] = rest
    return renamed


def _resolve(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


class _Torrent:
    """One torrent in the session: its handle and what the alert thread found for it."""

    def __init__(self, handle: lt.torrent_handle, resume_path: Path | None):
        self.handle = handle
        self.resume_path = resume_path
        self.events: deque[str] = deque()
        self.banned: list[str] = []
        self.error = ""
        self.resume_saved = threading.Event()


class Swarm:
    """One libtorrent session: a listening port, the torrents it fetches and seeds, and who may connect.

    Private torrents only: no DHT, no local discovery, no UPnP; peers are the ones the
    caller names (found through the control plane). TCP only, so the peer port is one
    TCP port a firewall can name.
    """

    def __init__(
        self,
        listen_port: int = 6881,
        listen_host: str = "0.0.0.0",
        *,
        user_agent: str = "llmgw",
        on_refused: Callable[[str], None] | None = None,
    ):
        """`on_refused(address)` is called (on the alert thread) when `allow`'s filter refuses an address: a node
        that joined since the caller last asked who the fleet is, or a stranger."""
        self.on_refused = on_refused
        self.session = lt.session(
            {
                "listen_interfaces": f"{listen_host}:{int(listen_port)}",
                "enable_dht": False,
                "enable_lsd": False,
                "enable_upnp": False,
                "enable_natpmp": False,
                "enable_incoming_utp": False,
                "enable_outgoing_utp": False,
                "alert_mask": ALERTS,
                "user_agent": user_agent,
                # Nodes behind one address (tests, NAT) are peers all the same.
                "allow_multiple_connections_per_ip": True,
                # A web seed that failed is asked again soon: it is the source of last resort.
                "urlseed_wait_retry": 3,
                # One connection per web seed URL, and a fetch may be given many of one mirror (libtorrent's 3
                # would cap them): where a link limits each connection, that is what fills it.
                "max_web_seed_connections": 64,
                "close_redundant_connections": False,
                # Rate limits for local networks would otherwise not apply: a fleet's is local.
                "rate_limit_ip_overhead": False,
            }
        )
        self._lock = threading.Lock()
        self._torrents: dict[str, _Torrent] = {}
        self._allowed: set[str] | None = None
        self._always: set[str] = set()  # web seeds' addresses: the filter must not cut off the mirror
        self._blocked: dict[str, float] = {}  # stalled peers' addresses, until when
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._alerts, name="swarm-alerts", daemon=True)
        self._pump.start()
        # A session still running when the interpreter ends aborts the process (libtorrent's
        # threads outlive Python's): closed first, whoever forgot to.
        atexit.register(self.close)

    # --- who may connect -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def listen_port(self) -> int:
        return self.session.listen_port()

    def allow(self, addresses: Iterable[str] | None) -> None:
        """Only these addresses may connect to this session or be connected to (None: anyone).

        Applied at once: a connection to an address no longer allowed is closed, and the
        next one refused. Web seeds' addresses stay allowed.
        """
        with self._lock:
            self._allowed = None if addresses is None else {a for a in map(_resolve, addresses) if a}
            self._apply_filter()

    def _apply_filter(self) -> None:
        now = time.monotonic()
        self._blocked = {a: until for a, until in self._blocked.items() if until > now}
        f = lt.ip_filter()
        if self._allowed is not None:
            f.add_rule("0.0.0.0", "255.255.255.255", 1)
            f.add_rule("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 1)
            for address in self._allowed | self._always:
                f.add_rule(address, address, 0)
        for address in self._blocked:
            if address not in self._always:
                f.add_rule(address, address, 1)
        self.session.set_ip_filter(f)

    def _block_for(self, address: str, seconds: float) -> None:
        with self._lock:
            self._blocked[address] = time.monotonic() + seconds
            self._apply_filter()

    # --- seeding ---------------------------------------------------------------------

    def seed(self, torrent: bytes, dest_dir: str | os.PathLike) -> str:
        """Serve files already whole in dest_dir (the caller verified them), without hashing them again; the info-hash.

        libtorrent takes the files as they are: a file that has rotted since it was
        verified is served as it is, and the peer that gets it finds the piece's hash
        wrong and bans this one.
        """
        info = torrent_info(torrent)
        key = info_hash_of(info)
        with self._lock:
            held = self._torrents.get(key)
        if held is not None and held.handle.is_valid() and held.handle.status().is_seeding:
            return key
        self.forget(key)
        params = lt.add_torrent_params()
        params.ti = info
        params.renamed_files = _rooted(info)
        params.save_path = str(dest_dir)
        params.have_pieces = [True] * info.num_pieces()
        params.flags = _running(lt.torrent_flags.default_flags) | lt.torrent_flags.no_verify_files
        self._add(key, params, None)
        return key

    def forget(self, info_hash: str) -> None:
        """Stop fetching or seeding a torrent; its files stay."""
        with self._lock:
            held = self._torrents.pop(info_hash, None)
        if held is not None and held.handle.is_valid():
            self.session.remove_torrent(held.handle)

    def held(self) -> dict[str, bool]:
        """{info-hash: whether it is whole here} of every torrent in the session."""
        with self._lock:
            items = list(self._torrents.items())
        return {k: t.handle.status().is_seeding for k, t in items if t.handle.is_valid()}

    def handle(self, info_hash: str) -> lt.torrent_handle | None:
        with self._lock:
            held = self._torrents.get(info_hash)
        return held.handle if held is not None else None

    def _add(self, key: str, params: lt.add_torrent_params, resume_path: Path | None) -> _Torrent:
        handle = self.session.add_torrent(params)
        held = _Torrent(handle, resume_path)
        with self._lock:
            self._torrents[key] = held
        return held

    # --- fetching --------------------------------------------------------------------

    def fetch(
        self,
        torrent: bytes,
        dest_dir: str | os.PathLike,
        *,
        web_seeds: UrlList = (),
        peers: PeerList = (),
        progress: Callable[[SwarmStatus], None] | None = None,
        resume_path: str | os.PathLike | None = None,
        stall_bytes_s: int = 1 << 20,
        stall_s: float = 20.0,
        give_up_s: float | None = None,
        keep_seeding: bool = True,
    ) -> Fetched:
        """Fetch the torrent's files into dest_dir from the web seeds and peers; returns when every piece is verified.

        Pieces already in dest_dir are kept: by `resume_path`'s record when there is one
        (written every second while pieces arrive, and at the end; a piece its file on disk
        no longer reaches is fetched again), else by hashing what is there. Raises SwarmError with a sentence: a disk error, every source stalled
        for `give_up_s` (default 10 × stall_s). An exception from `progress` stops the
        fetch (its resume data saved) and is raised as it is. Afterwards the torrent stays
        in the session, seeding, unless `keep_seeding` is false.
        """
        started = time.monotonic()
        info = torrent_info(torrent)
        key = info_hash_of(info)
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        resume = Path(resume_path) if resume_path is not None else None
        self.forget(key)
        params = None
        if resume is not None and resume.exists():
            try:
                params = lt.read_resume_data(resume.read_bytes())
            except (RuntimeError, ValueError):
                params = None  # unreadable: the files are hashed instead
            if params is not None and info_hash_of_params(params) not in ("", key):
                params = None  # the record of another torrent
            if params is not None:
                _forget_what_the_disk_lost(params, info, dest)
        if params is None:
            params = lt.add_torrent_params()
        params.ti = info
        params.renamed_files = _rooted(info)
        params.save_path = str(dest)
        params.flags = _running(params.flags | lt.torrent_flags.default_flags)
        params.url_seeds = []
        held = self._add(key, params, resume)
        give_up_s = 10 * stall_s if give_up_s is None else give_up_s
        watch = _StallWatch(stall_bytes_s, stall_s)
        seeds: dict[str, str] = {}  # the URL a web seed is known by without its credentials -> with
        # Counted by the peers' connections, which last (a web seed's may close after every answer,
        # between two looks): what did not come from a peer came from a web seed.
        peer_bytes: dict[tuple, int] = {}
        peer_banked = 0
        last_refresh = 0.0
        last_resume = 0.0
        last_done, last_arrived = -1, time.monotonic()
        handle = held.handle
        try:
            while True:
                now = time.monotonic()
                if now - last_refresh >= PEERS_S or last_refresh == 0.0:
                    last_refresh = now
                    self._refresh_web_seeds(handle, web_seeds, seeds, watch)
                    for host, port in _called(peers):
                        address = _resolve(host)
                        if address and address not in self._blocked:
                            try:
                                handle.connect_peer((address, int(port)))
                            except RuntimeError:
                                pass
                if held.error:
                    raise SwarmError(held.error)
                status = handle.status()
                infos = handle.get_peer_info()
                for p in infos:
                    if p.connection_type == lt.peer_info.standard_bittorrent:
                        ident = (p.ip, str(p.pid))
                        if p.total_download < peer_bytes.get(ident, 0):  # connected again: counting anew
                            peer_banked += peer_bytes[ident]
                        peer_bytes[ident] = p.total_download
                from_peers = min(peer_banked + sum(peer_bytes.values()), status.total_payload_download)
                from_web = status.total_payload_download - from_peers
                events = []
                while held.events:
                    events.append(held.events.popleft())
                for name in watch.observe(infos, now, seeds):
                    events.append(
                        f"{name} sent less than {stall_bytes_s:,} bytes/s for {stall_s:g} s; its pieces go to other sources"
                    )
                    self._abandon(handle, name, watch, seeds, stall_s)
                watch.expire(now, lambda name: self._restore(handle, name, seeds))
                done = status.is_seeding or (status.num_pieces == info.num_pieces() and status.is_finished)
                sources = [p for p in infos if not (p.flags & lt.peer_info.connecting)]
                if status.total_wanted_done > last_done:
                    last_done, last_arrived = status.total_wanted_done, now
                # Nothing arriving for a whole window, from anyone: every source there is has stalled
                # (or none answers at all), and the fetch says so rather than sitting at a percentage.
                all_stalled = not done and now - last_arrived >= stall_s
                if all_stalled and now - last_arrived >= give_up_s:
                    raise SwarmError(
                        f"nothing arrived for {give_up_s:g} s: {_who(watch, sources, seeds)}; what was verified "
                        "is kept and the next attempt goes on from there",
                        transient=True,
                    )
                if progress is not None:
                    progress(
                        SwarmStatus(
                            bytes_done=status.total_wanted_done,
                            bytes_total=status.total_wanted,
                            bytes_from_peers=from_peers,
                            bytes_from_web_seeds=from_web,
                            pieces_done=status.num_pieces,
                            pieces_total=info.num_pieces(),
                            peers=len(sources),
                            stalled=tuple(sorted(watch.stalled)),
                            all_stalled=all_stalled,
                            why=_who(watch, sources, seeds) if all_stalled else "",
                            events=tuple(events),
                        )
                    )
                if done:
                    break
                if resume is not None and now - last_resume >= RESUME_EVERY_S:
                    last_resume = now
                    # Flushed first: libtorrent's record counts only the pieces its disk threads have written.
                    handle.flush_cache()
                time.sleep(POLL_S)
            self._save_resume(held)
            return Fetched(
                bytes_total=_payload_bytes(info),
                bytes_from_peers=from_peers,
                bytes_from_web_seeds=from_web,
                seconds=time.monotonic() - started,
                banned=list(held.banned),
                stalled=sorted(watch.ever),
            )
        except BaseException:
            self._save_resume(held)
            self.forget(key)
            raise
        finally:
            try:
                # A seed serves from its files: the web seeds were for fetching.
                for url in list(handle.url_seeds()):
                    handle.remove_url_seed(url)
            except RuntimeError:
                pass  # removed from the session already
            if not keep_seeding:
                self.forget(key)

    def _refresh_web_seeds(self, handle, web_seeds: UrlList, seeds: dict[str, str], watch: _StallWatch) -> None:
        """Web seeds as the caller gives them now: a URL whose credentials changed (a renewed pass) replaces the
        old, and one no longer given is taken out (its connection closed, its pieces asked of the others)."""
        wanted = {}
        for url in _called(web_seeds):
            wanted[_without_credentials(url)] = url
            address = _resolve(urlsplit(url).hostname or "")
            if address and address not in self._always:
                with self._lock:
                    self._always.add(address)
                    self._apply_filter()
        current = set(handle.url_seeds())
        for bare in [b for b in seeds if b not in wanted]:
            if seeds[bare] in current:
                handle.remove_url_seed(seeds[bare])
            del seeds[bare]
        for bare, url in wanted.items():
            old = seeds.get(bare)
            if old is not None and old != url and old in current:
                handle.remove_url_seed(old)
            seeds[bare] = url
            if watch.name_of_url(bare, seeds) not in watch.stalled and url not in current:
                handle.add_url_seed(url)

    def _abandon(self, handle, name: str, watch: _StallWatch, seeds: dict[str, str], stall_s: float) -> None:
        if watch.seed_of_name(name) is not None:
            # Every URL of that server: it is one source however many connections it was asked over.
            for bare, url in seeds.items():
                if watch.name_of_url(bare, seeds) == name:
                    handle.remove_url_seed(url)
        else:
            self._block_for(name.removeprefix("peer ").rsplit(":", 1)[0], stall_s)
        log.warning("%s stalled; its pieces go to other sources", name)

    def _restore(self, handle, name: str, seeds: dict[str, str]) -> None:
        if _StallWatch.seed_of_name(name) is not None:
            for bare, url in seeds.items():
                if _StallWatch.name_of_url(bare, seeds) == name:
                    handle.add_url_seed(url)
        # A blocked peer's address frees itself when its time is up.
        with self._lock:
            self._apply_filter()

    def _save_resume(self, held: _Torrent) -> None:
        if held.resume_path is None or not held.handle.is_valid():
            return
        held.resume_saved.clear()
        try:
            held.handle.flush_cache()  # and, once flushed, the resume data (the alert thread asks for it)
        except RuntimeError:
            return
        held.resume_saved.wait(10)

    # --- the alerts ------------------------------------------------------------------

    def _owner(self, alert) -> _Torrent | None:
        handle = getattr(alert, "handle", None)
        if handle is None or not handle.is_valid():
            return None
        with self._lock:
            for held in self._torrents.values():
                if held.handle == handle:
                    return held
        return None

    def _alerts(self) -> None:
        while not self._closed.is_set():
            if self.session.wait_for_alert(500) is None:
                continue
            for alert in self.session.pop_alerts():
                try:
                    self._on_alert(alert)
                except Exception:  # an alert must never end the thread that reads them
                    log.exception("handling %s", type(alert).__name__)

    def _on_alert(self, alert) -> None:
        log.debug("alert %s: %s", type(alert).__name__, alert.message())
        if isinstance(alert, lt.listen_failed_alert):
            log.warning("the peer port could not be opened: %s", alert.message())
            return
        if isinstance(alert, lt.peer_blocked_alert):
            address = _endpoint(alert).rsplit(":", 1)[0]
            # Refused by `allow`, not for having stalled: the caller may learn the fleet anew.
            if alert.reason == lt.reason_t.ip_filter and address not in self._blocked and self.on_refused:
                self.on_refused(address)
            return
        held = self._owner(alert)
        if held is None:
            return
        if isinstance(alert, lt.save_resume_data_alert):
            if held.resume_path is not None:
                params = alert.params
                data = lt.write_resume_data_buf(params)
                tmp = held.resume_path.with_name(held.resume_path.name + ".tmp")
                tmp.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                os.replace(tmp, held.resume_path)
            held.resume_saved.set()
        elif isinstance(alert, lt.cache_flushed_alert):
            if held.resume_path is not None:
                held.handle.save_resume_data(lt.torrent_handle.save_info_dict)
        elif isinstance(alert, lt.save_resume_data_failed_alert):
            held.resume_saved.set()
        elif isinstance(alert, lt.peer_ban_alert):
            who = f"peer {_endpoint(alert)}"
            held.banned.append(who)
            held.events.append(f"{who} sent a piece that failed its hash and is banned")
            log.warning("%s sent a piece that failed its hash and is banned", who)
        elif isinstance(alert, lt.hash_failed_alert):
            held.events.append(f"piece {int(alert.piece_index)} failed its hash and is fetched again")
        elif isinstance(alert, lt.file_error_alert):
            held.error = f"writing {alert.filename()}: {alert.error.message()}"
        elif isinstance(alert, lt.torrent_error_alert):
            held.error = alert.message()
        elif isinstance(alert, lt.url_seed_alert):
            held.events.append(
                f"the web seed {_without_credentials(alert.server_url())} failed: {alert.error_message()}"
            )

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._pump.join(timeout=5)
        with self._lock:
            torrents = list(self._torrents.values())
            self._torrents.clear()
        for held in torrents:
            if held.handle.is_valid():
                self.session.remove_torrent(held.handle)
        atexit.unregister(self.close)
        self.session.pause()
        del self.session


class _StallWatch:
    """Which sources delivered less than the floor while asked for pieces, over the window.

    A source is a peer, or a web seed's server: the URLs of one server (the mirror under
    several addresses, one connection each) are one source, counted together, so one slow
    connection is not a stalled mirror and "every source stalled" names the mirror once.
    """

    def __init__(self, floor_bytes_s: int, window_s: float):
        self.floor = floor_bytes_s
        self.window = window_s
        self.samples: dict[str, deque[tuple[float, int, bool]]] = {}
        self.stalled: dict[str, float] = {}  # name -> until when it is left out
        self.ever: set[str] = set()
        # Bytes by connection, and what connections now closed had sent, by source: a source's count
        # goes on rising as its connections come and go.
        self.connections: dict[tuple, int] = {}
        self.banked: dict[str, int] = {}

    @staticmethod
    def name_of_seed(bare_url: str) -> str:
        return f"the mirror {bare_url}"

    @staticmethod
    def seed_of_name(name: str) -> str | None:
        return name.removeprefix("the mirror ") if name.startswith("the mirror ") else None

    @staticmethod
    def name_of_url(bare_url: str, seeds: dict[str, str]) -> str:
        """A web seed URL's source: its server, by the first of its URLs the caller gave."""
        server = _server(bare_url)
        return _StallWatch.name_of_seed(next((b for b in seeds if _server(b) == server), bare_url))

    def name(self, p, seeds: dict[str, str]) -> str:
        host, port = p.ip[0], p.ip[1]
        if p.connection_type != lt.peer_info.standard_bittorrent:
            for bare in seeds:
                if _server(bare) == (host, port):
                    return self.name_of_seed(bare)
            return f"the web seed {host}:{port}"
        return f"peer {host}:{port}"

    def observe(self, infos, now: float, seeds: dict[str, str]) -> list[str]:
        """The names of sources that have just stalled."""
        got_by: dict[str, int] = {}
        asked_by: dict[str, bool] = {}
        open_now: dict[tuple, int] = {}
        for p in infos:
            name = self.name(p, seeds)
            connection = (name, tuple(p.local_endpoint()))
            if p.total_download < self.connections.get(connection, 0):  # the same port again: counting anew
                self.banked[name] = self.banked.get(name, 0) + self.connections[connection]
            open_now[connection] = p.total_download
            asked = p.download_queue_length > 0 or p.downloading_piece_index >= 0
            asked_by[name] = asked_by.get(name, False) or asked
        for connection, sent in self.connections.items():
            if connection not in open_now:
                self.banked[connection[0]] = self.banked.get(connection[0], 0) + sent
        self.connections = open_now
        for (name, _), sent in open_now.items():
            got_by[name] = got_by.get(name, 0) + sent
        stalled_now = []
        for name, asked in asked_by.items():
            history = self.samples.setdefault(name, deque())
            history.append((now, self.banked.get(name, 0) + got_by.get(name, 0), asked))
            while history and now - history[0][0] > self.window + POLL_S:
                history.popleft()
            if name in self.stalled or now - history[0][0] < self.window:
                continue
            got = history[-1][1] - history[0][1]
            if all(s[2] for s in history) and got < self.floor * self.window:
                stalled_now.append(name)
        for name in list(self.samples):
            if name not in asked_by:
                del self.samples[name]
        for name in stalled_now:
            self.stalled[name] = now + self.window
            self.ever.add(name)
            self.samples.pop(name, None)
        return stalled_now

    def expire(self, now: float, restore: Callable[[str], None]) -> None:
        for name, until in list(self.stalled.items()):
            if until <= now:
                del self.stalled[name]
                restore(name)


def info_hash_of_params(params: lt.add_torrent_params) -> str:
    try:
        hashes = params.info_hashes
        return str(hashes.v2) if hashes.has_v2() else ""
    except (AttributeError, RuntimeError):
        return ""


def _forget_what_the_disk_lost(params: lt.add_torrent_params, info: lt.torrent_info, dest: Path) -> None:
    """Take out of a resume record the pieces its files no longer hold: a file cut short or removed since.

    libtorrent believes its record without looking: a file cut short after it was whole
    would be seeded as it is, the fetch would fetch nothing, and the manifest's sha256
    would then fail. A piece counts only where every one of its files on disk still
    reaches its end; the others are fetched again, the rest of the record kept.
    """
    layout = info.layout()
    paths = {i: dest / name for i, name in _rooted(info).items()}
    sizes: dict[int, int] = {}

    def size_on_disk(i: int) -> int:
        if i not in sizes:
            try:
                sizes[i] = (paths.get(i) or dest / layout.file_path(i)).stat().st_size
            except OSError:
                sizes[i] = 0
        return sizes[i]

    def held(piece: int) -> bool:
        return all(
            layout.file_flags(s.file_index) & lt.file_storage.flag_pad_file
            or size_on_disk(s.file_index) >= s.offset + s.size
            for s in info.map_block(piece, 0, info.piece_size(piece))
        )

    have = list(params.have_pieces)
    lost = [i for i in range(min(len(have), info.num_pieces())) if have[i] and not held(i)]
    for i in lost:
        have[i] = False
    unfinished = dict(params.unfinished_pieces)
    for piece in [p for p in unfinished if not held(int(p))]:
        del unfinished[piece]
    if lost:
        log.warning("%d verified piece(s) of %s are no longer on disk; they are fetched again", len(lost), dest)
    params.have_pieces = have
    params.unfinished_pieces = unfinished


@functools.lru_cache(maxsize=256)
def _server(url: str) -> tuple[str | None, int]:
    """(address, port) of a URL's server: what a web seed's connection is to."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = -1
    return _resolve(parts.hostname or ""), port


def _who(watch: _StallWatch, sources, seeds: dict[str, str]) -> str:
    """The sources of a fetch that gets nothing, by name, for the sentence."""
    names = sorted(set(watch.stalled) | watch.ever | {watch.name(p, seeds) for p in sources})
    if not names:
        return "no source answered (no peer connected, no web seed reachable)"
    return "every source stalled: " + ", ".join(names)


def _payload_bytes(info: lt.torrent_info) -> int:
    layout = info.layout()
    return sum(
        layout.file_size(i)
        for i in range(layout.num_files())
        if not layout.file_flags(i) & lt.file_storage.flag_pad_file
    )


def _running(flags):
    """Started now and kept so: not paused, and not auto-managed (libtorrent's queue would pause it again)."""
    return flags & ~lt.torrent_flags.paused & ~lt.torrent_flags.auto_managed


def _called(value):
    return list(value() if callable(value) else value)


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


def _endpoint(alert) -> str:
    try:
        host, port = alert.endpoint if hasattr(alert, "endpoint") else alert.ip
        return f"{host}:{port}"
    except (AttributeError, TypeError, ValueError):
        return "?"
