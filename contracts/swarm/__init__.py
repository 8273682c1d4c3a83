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

The package by topic: `Swarm` here (the session and its two verbs), `session` (the
libtorrent session, who may connect, its alerts),
`fetch` (a fetch's loop and what it counts), `seeding` (serving files already whole),
`stall` (which source delivers too little), `resume` (libtorrent's record of verified
pieces, trimmed to what the disk still holds), `torrent` (a torrent's info, hash and
layout on disk) and `addresses` (sources' names and addresses).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from contracts.swarm import fetch as fetching
from contracts.swarm import seeding
from contracts.swarm.fetch import Fetched, PeerList, SwarmStatus, UrlList
from contracts.swarm.session import Session
from contracts.swarm.torrent import SwarmError, info_hash_of, torrent_info

__all__ = ["Fetched", "Swarm", "SwarmError", "SwarmStatus", "info_hash_of", "torrent_info"]


class Swarm(Session):
    """One libtorrent session (contracts/swarm/session.py) and its two verbs: fetch a torrent, seed one.

    Private torrents only: no DHT, no local discovery, no UPnP; peers are the ones the
    caller names (found through the control plane). TCP only, so the peer port is one
    TCP port a firewall can name.
    """

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
        return fetching.fetch(
            self,
            torrent,
            dest_dir,
            web_seeds=web_seeds,
            peers=peers,
            progress=progress,
            resume_path=resume_path,
            stall_bytes_s=stall_bytes_s,
            stall_s=stall_s,
            give_up_s=give_up_s,
            keep_seeding=keep_seeding,
        )

    def seed(self, torrent: bytes, dest_dir: str | os.PathLike) -> str:
        """Serve files already whole in dest_dir (the caller verified them), without hashing them again; the info-hash.

        libtorrent takes the files as they are: a file that has rotted since it was
        verified is served as it is, and the peer that gets it finds the piece's hash
        wrong and bans this one.
        """
        return seeding.seed(self, torrent, dest_dir)
