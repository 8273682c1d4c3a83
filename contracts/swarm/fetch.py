"""A fetch: a torrent's pieces from web seeds and peers into a directory, looked at twice a second until whole.

Each look asks the caller's web seeds and peers again (every `PEERS_S`), counts what came
from peers and what from web seeds, takes a stalled source's pieces to the others
(contracts/swarm/stall.py), and gives up when nothing has arrived from anyone for
`give_up_s`. `Swarm.fetch` is the entry point and says what the caller gets.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import libtorrent as lt

from contracts.swarm import resume
from contracts.swarm.addresses import called, resolve, without_credentials
from contracts.swarm.session import Held, Session
from contracts.swarm.stall import StallWatch
from contracts.swarm.torrent import SwarmError, info_hash_of, payload_bytes, rooted, running, torrent_info

# One logger for the whole package, as when it was one module: operators filter on its name.
log = logging.getLogger("contracts.swarm")

PeerList = Sequence[tuple[str, int]] | Callable[[], Sequence[tuple[str, int]]]
UrlList = Sequence[str] | Callable[[], Sequence[str]]

POLL_S = 0.5
# How often the callables for web seeds and peers are asked again (a new peer, a pass renewed): a peer
# that joined is connected to within a second, rather than after the mirror sent what it could have.
PEERS_S = 1.0
# How often resume data is written while pieces arrive: a kill loses at most this much verified work.
RESUME_EVERY_S = 1.0


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


def fetch(
    swarm: Session,
    torrent: bytes,
    dest_dir: str | os.PathLike,
    *,
    web_seeds: UrlList,
    peers: PeerList,
    progress: Callable[[SwarmStatus], None] | None,
    resume_path: str | os.PathLike | None,
    stall_bytes_s: int,
    stall_s: float,
    give_up_s: float | None,
    keep_seeding: bool,
) -> Fetched:
    """The torrent's files fetched into dest_dir by the swarm's session (`Swarm.fetch` says what it does)."""
    started = time.monotonic()
    info = torrent_info(torrent)
    key = info_hash_of(info)
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    resume_at = Path(resume_path) if resume_path is not None else None
    held = _start(swarm, info, key, dest, resume_at)
    give_up_s = 10 * stall_s if give_up_s is None else give_up_s
    run = _Fetch(swarm, held, info, web_seeds, peers, stall_bytes_s, stall_s, give_up_s)
    try:
        while True:
            now = time.monotonic()
            status = run.look(now)
            if progress is not None:
                progress(status)
            if run.done:
                break
            if resume_at is not None and now - run.last_resume >= RESUME_EVERY_S:
                run.last_resume = now
                # Flushed first: libtorrent's record counts only the pieces its disk threads have written.
                held.handle.flush_cache()
            time.sleep(POLL_S)
        resume.save(held)
        return Fetched(
            bytes_total=payload_bytes(info),
            bytes_from_peers=status.bytes_from_peers,
            bytes_from_web_seeds=status.bytes_from_web_seeds,
            seconds=time.monotonic() - started,
            banned=list(held.banned),
            stalled=sorted(run.watch.ever),
        )
    except BaseException:
        resume.save(held)
        swarm.forget(key)
        raise
    finally:
        run.drop_web_seeds()
        if not keep_seeding:
            swarm.forget(key)


def _start(swarm: Session, info: lt.torrent_info, key: str, dest: Path, resume_at: Path | None) -> Held:
    """The torrent added to the session anew, with what its resume record says is verified already."""
    swarm.forget(key)
    params = resume.read(resume_at, info, key, dest) or lt.add_torrent_params()
    params.ti = info
    params.renamed_files = rooted(info)
    params.save_path = str(dest)
    params.flags = running(params.flags | lt.torrent_flags.default_flags)
    params.url_seeds = []
    return swarm.add(key, params, resume_at)


class _Fetch:
    """One fetch between two looks: its sources, what each delivered, and when anything last arrived."""

    def __init__(
        self,
        swarm: Session,
        held: Held,
        info: lt.torrent_info,
        web_seeds: UrlList,
        peers: PeerList,
        stall_bytes_s: int,
        stall_s: float,
        give_up_s: float,
    ):
        self.swarm = swarm
        self.held = held
        self.handle = held.handle
        self.info = info
        self.web_seeds = web_seeds
        self.peers = peers
        self.stall_bytes_s = stall_bytes_s
        self.stall_s = stall_s
        self.give_up_s = give_up_s
        self.watch = StallWatch(stall_bytes_s, stall_s, look_s=POLL_S)
        self.seeds: dict[str, str] = {}  # the URL a web seed is known by without its credentials -> with
        # Counted by the peers' connections, which last (a web seed's may close after every answer,
        # between two looks): what did not come from a peer came from a web seed.
        self.peer_bytes: dict[tuple, int] = {}
        self.peer_banked = 0
        self.last_refresh = 0.0
        self.last_resume = 0.0
        self.last_done, self.last_arrived = -1, time.monotonic()
        self.done = False

    def look(self, now: float) -> SwarmStatus:
        """One look: sources asked again, stalls handled; raises SwarmError on a disk error or on giving up."""
        if now - self.last_refresh >= PEERS_S or self.last_refresh == 0.0:
            self.last_refresh = now
            self._refresh_web_seeds()
            self._connect_peers()
        if self.held.error:
            raise SwarmError(self.held.error)
        status = self.handle.status()
        infos = self.handle.get_peer_info()
        from_peers = self._from_peers(infos, status.total_payload_download)
        events = []
        while self.held.events:
            events.append(self.held.events.popleft())
        for name in self.watch.observe(infos, now, self.seeds):
            events.append(
                f"{name} sent less than {self.stall_bytes_s:,} bytes/s for {self.stall_s:g} s; "
                "its pieces go to other sources"
            )
            self._abandon(name)
        self.watch.expire(now, self._restore)
        self.done = status.is_seeding or (status.num_pieces == self.info.num_pieces() and status.is_finished)
        sources = [p for p in infos if not (p.flags & lt.peer_info.connecting)]
        if status.total_wanted_done > self.last_done:
            self.last_done, self.last_arrived = status.total_wanted_done, now
        # Nothing arriving for a whole window, from anyone: every source there is has stalled
        # (or none answers at all), and the fetch says so rather than sitting at a percentage.
        all_stalled = not self.done and now - self.last_arrived >= self.stall_s
        if all_stalled and now - self.last_arrived >= self.give_up_s:
            raise SwarmError(
                f"nothing arrived for {self.give_up_s:g} s: {self.watch.who(sources, self.seeds)}; what was verified "
                "is kept and the next attempt goes on from there",
                transient=True,
            )
        return SwarmStatus(
            bytes_done=status.total_wanted_done,
            bytes_total=status.total_wanted,
            bytes_from_peers=from_peers,
            bytes_from_web_seeds=status.total_payload_download - from_peers,
            pieces_done=status.num_pieces,
            pieces_total=self.info.num_pieces(),
            peers=len(sources),
            stalled=tuple(sorted(self.watch.stalled)),
            all_stalled=all_stalled,
            why=self.watch.who(sources, self.seeds) if all_stalled else "",
            events=tuple(events),
        )

    def _from_peers(self, infos, total_payload_download: int) -> int:
        """Bytes from peers so far, by their connections (a connection made again counts anew, the old banked)."""
        for p in infos:
            if p.connection_type == lt.peer_info.standard_bittorrent:
                ident = (p.ip, str(p.pid))
                if p.total_download < self.peer_bytes.get(ident, 0):  # connected again: counting anew
                    self.peer_banked += self.peer_bytes[ident]
                self.peer_bytes[ident] = p.total_download
        return min(self.peer_banked + sum(self.peer_bytes.values()), total_payload_download)

    def _connect_peers(self) -> None:
        for host, port in called(self.peers):
            address = resolve(host)
            if address and not self.swarm.is_blocked(address):
                try:
                    self.handle.connect_peer((address, int(port)))
                except RuntimeError:
                    pass

    def _refresh_web_seeds(self) -> None:
        """Web seeds as the caller gives them now: a URL whose credentials changed (a renewed pass) replaces the
        old, and one no longer given is taken out (its connection closed, its pieces asked of the others)."""
        handle, seeds = self.handle, self.seeds
        wanted = {}
        for url in called(self.web_seeds):
            wanted[without_credentials(url)] = url
            address = resolve(urlsplit(url).hostname or "")
            if address:
                self.swarm.always_allow(address)
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
            if self.watch.name_of_url(bare, seeds) not in self.watch.stalled and url not in current:
                handle.add_url_seed(url)

    def _abandon(self, name: str) -> None:
        if self.watch.seed_of_name(name) is not None:
            # Every URL of that server: it is one source however many connections it was asked over.
            for bare, url in self.seeds.items():
                if self.watch.name_of_url(bare, self.seeds) == name:
                    self.handle.remove_url_seed(url)
        else:
            self.swarm.block_for(name.removeprefix("peer ").rsplit(":", 1)[0], self.stall_s)
        log.warning("%s stalled; its pieces go to other sources", name)

    def _restore(self, name: str) -> None:
        if self.watch.seed_of_name(name) is not None:
            for bare, url in self.seeds.items():
                if self.watch.name_of_url(bare, self.seeds) == name:
                    self.handle.add_url_seed(url)
        # A blocked peer's address frees itself when its time is up.
        self.swarm.refilter()

    def drop_web_seeds(self) -> None:
        """A seed serves from its files: the web seeds were for fetching."""
        try:
            for url in list(self.handle.url_seeds()):
                self.handle.remove_url_seed(url)
        except RuntimeError:
            pass  # removed from the session already
