"""Which sources of a fetch deliver less than the floor while asked for pieces, and the sentence that names them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import libtorrent as lt

from contracts.swarm.addresses import server


class StallWatch:
    """Which sources delivered less than the floor while asked for pieces, over the window.

    A source is a peer, or a web seed's server: the URLs of one server (the mirror under
    several addresses, one connection each) are one source, counted together, so one slow
    connection is not a stalled mirror and "every source stalled" names the mirror once.
    """

    def __init__(self, floor_bytes_s: int, window_s: float, look_s: float):
        """`look_s`: how often the fetch looks; a sample one look older than the window is kept."""
        self.floor = floor_bytes_s
        self.window = window_s
        self.look_s = look_s
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
        its_server = server(bare_url)
        return StallWatch.name_of_seed(next((b for b in seeds if server(b) == its_server), bare_url))

    def name(self, p, seeds: dict[str, str]) -> str:
        host, port = p.ip[0], p.ip[1]
        if p.connection_type != lt.peer_info.standard_bittorrent:
            for bare in seeds:
                if server(bare) == (host, port):
                    return self.name_of_seed(bare)
            return f"the web seed {host}:{port}"
        return f"peer {host}:{port}"

    def observe(self, infos, now: float, seeds: dict[str, str]) -> list[str]:
        """The names of sources that have just stalled."""
        got_by, asked_by = self._count(infos, seeds)
        stalled_now = []
        for name, asked in asked_by.items():
            history = self.samples.setdefault(name, deque())
            history.append((now, self.banked.get(name, 0) + got_by.get(name, 0), asked))
            while history and now - history[0][0] > self.window + self.look_s:
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

    def _count(self, infos, seeds: dict[str, str]) -> tuple[dict[str, int], dict[str, bool]]:
        """Bytes each source's open connections sent, and whether it is asked for pieces; closed ones banked."""
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
        return got_by, asked_by

    def expire(self, now: float, restore: Callable[[str], None]) -> None:
        for name, until in list(self.stalled.items()):
            if until <= now:
                del self.stalled[name]
                restore(name)

    def who(self, sources, seeds: dict[str, str]) -> str:
        """The sources of a fetch that gets nothing, by name, for the sentence."""
        names = sorted(set(self.stalled) | self.ever | {self.name(p, seeds) for p in sources})
        if not names:
            return "no source answered (no peer connected, no web seed reachable)"
        return "every source stalled: " + ", ".join(names)
