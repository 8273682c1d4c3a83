"""The node's one libtorrent session: fetching sets from the mirror and the other nodes, seeding what it holds.

One session per node, in a process of its own beside the worker (`start`, from `manage.py
agent`): Celery forks its pool, and libtorrent's threads do not survive a fork, and one
listening port is one process's. Fetches in the pool's children ask it over a Unix socket
in the cache (`fetch`), and get its progress back as it goes. Where there is no such
process (`manage.py fetch` on its own, a test calling `fetch_source`) the fetch makes a
session in its own process instead, on a port of its own, the same code either way.

The session listens on LLMGW_PEER_PORT and serves the verified pieces of every set it holds
(complete sets from the cache, what it has verified of sets it is fetching) to the fleet
only:

- Peers are found through the control plane: the node announces what it holds to the byte
  listener's tracker (`/announce`, the node's pass required), which answers the other
  enrolled nodes that hold each torrent, and the addresses of every enrolled node that
  announced lately (`fleet`). It announces every 5 s, and while a fetch runs at its start
  and then every second, and at once when an address it does not know yet connects (a
  node that just joined): nodes that start a fetch together find each other in a second
  or two, rather than after the mirror has sent each of them what the others could have.
- Only those addresses may connect to this node, or be connected to (libtorrent's IP filter,
  set again at every answer): a host that is not an enrolled node gets no piece, and a
  revoked node drops out of the next answer, so its connections are closed and it is
  refused from then on. What this does not stop is in docs/fleet.md. The revoked node's
  own announce is refused: it serves nobody, and its fetches stop with the refusal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis
import requests
from django.conf import settings

from contracts import credentials, keys, signing
from contracts.sources import seed_alias
from contracts.swarm import Swarm, SwarmError, info_hash_of, torrent_info

from . import runtime, session_socket
from .download import new_session
from .progress import redis_client
from .session_socket import socket_path
from .sources import TIMEOUT, describe, origin, refusal_of, status_error

log = logging.getLogger(__name__)

ANNOUNCE_S = 5.0
# While a fetch runs: a node that started its fetch a moment later is a peer a second later.
ANNOUNCE_FETCHING_S = 1.0
# A connection to the mirror for every this many pieces of the set, up to LLMGW_FETCH_CONNECTIONS: one with
# fewer pieces of its own to ask would ask for the others' (libtorrent's end-game), and the mirror send them twice.
PIECES_PER_CONNECTION = 4
# The tracker's cap on the torrents one announce names (mirror.tracker.MAX_INFO_HASHES).
ANNOUNCE_MAX_TORRENTS = 100
# A web seed's pass is made anew this often; a pass is good for an hour (contracts.credentials).
RENEW_PASS_S = 600.0


def state_dir(cache: Path) -> Path:
    return Path(cache) / ".swarm"


def resume_path(cache: Path, info_hash: str) -> Path:
    return state_dir(cache) / "resume" / info_hash


def web_seeds(source: str, single_file: bool, connections: int | None = None) -> list[str]:
    """The byte listener as the torrent's web seeds, with this node's pass as their Basic credentials.

    BEP 19 puts the torrent's own path after the URL: a version of several files is a folder
    named for the version, so the seed is the model's address; a version of one file is
    that file, asked at the version's address. libtorrent opens one connection per URL, so
    this node's byte listener is offered under LLMGW_FETCH_CONNECTIONS addresses (its plain
    one first, then its aliases, contracts.sources.SEED_ALIAS): where a link limits each
    connection, or its round trip is long, several fill it (`connections` of them, when
    given, else as many as the setting says). Another server has no aliases.
    """
    base = urlsplit(source if single_file else source.rstrip("/").rsplit("/", 1)[0] + "/")
    ours = origin(source) == origin(settings.BYTES_URL)
    paths = [base.path]
    if ours:
        root = urlsplit(settings.BYTES_URL).path
        if connections is None:
            connections = getattr(settings, "FETCH_CONNECTIONS", 8)
        for n in range(1, connections):
            if (alias := seed_alias(root, base.path, n)) != base.path:
                paths.append(alias)
    bases = [base._replace(path=path).geturl() for path in paths]
    node, token = runtime.node_name(), runtime.token()
    if not (node and token and ours):
        return bases
    secret = credentials.bytes_pass(signing.token_hash(token), node)
    return [urlsplit(b)._replace(netloc=f"{node}:{secret}@{urlsplit(b).netloc}").geturl() for b in bases]


class NodeSwarm:
    """The session, and what keeps it in the fleet: announcing, the allow-list, seeding complete sets."""

    def __init__(self, cache: Path, listen_port: int, listen_host: str = "0.0.0.0"):
        self.cache = Path(cache)
        self.peers: dict[str, list[tuple[str, int]]] = {}
        self.fleet: set[str] = set()
        self.fetching: set[str] = set()
        self._lock = threading.Lock()
        self._announcing = threading.Lock()
        self._stop = threading.Event()
        self._announce_now = threading.Event()
        self._http = requests.Session()
        self._said = ""
        self.swarm = Swarm(listen_port, listen_host, on_refused=self._refused)
        self.swarm.allow([])  # nobody until the tracker has said who the fleet is
        # Why the tracker refused this node's pass, while it does: each fetch in progress then asks the mirror.
        self.tracker_refused = ""
        threading.Thread(target=self._keep_announcing, name="swarm-announce", daemon=True).start()

    # --- the fleet ---------------------------------------------------------------

    def announce(self) -> None:
        """Tell the tracker what this node holds; take who else holds it, and who the fleet is."""
        with self._announcing:
            self._announce()

    def _announce(self) -> None:
        # What it fetches first, then what it seeds, up to the tracker's cap: past it the tracker refuses the announce.
        fetching = sorted(self.fetching)
        held = (fetching + sorted(set(self.swarm.held()) - self.fetching))[:ANNOUNCE_MAX_TORRENTS]
        node, token = runtime.node_name(), runtime.token()
        if not (node and token):
            return
        url = settings.BYTES_URL + "announce"
        params = [("info_hash", h) for h in held] or [("info_hash", "0" * 64)]
        # No address: the tracker takes the one this request comes from (or the node's enrolled one).
        params.append(("port", str(self.swarm.listen_port)))
        secret = credentials.bytes_pass(signing.token_hash(token), node)
        try:
            response = self._http.get(url, params=params, headers=credentials.bearer(secret), timeout=TIMEOUT)
        except requests.RequestException as error:
            self._from_redis(held, node, f"the tracker {url} did not answer ({describe(error)})")
            return
        if response.status_code >= 500:
            self._from_redis(held, node, f"the tracker {url} answered {response.status_code}")
            return
        if response.status_code == 401:
            # Revoked (or its token issued anew): the fleet will not serve this node, and it serves nobody.
            self.swarm.allow([])
            with self._lock:
                self.peers = {}
            self.tracker_refused = f"the tracker {url} refused this node's pass (401): {refusal_of(response)}"
            self._say(f"{self.tracker_refused}; it serves no peer and gets none")
            return
        try:
            said = response.json()
            fleet = [str(a) for a in said["fleet"]]
            peers = {h: [(p["host"], int(p["port"])) for p in ps] for h, ps in said["peers"].items()}
        except (ValueError, KeyError, TypeError):
            self._say(f"the tracker {url} answered {response.status_code} without a peer list")
            return
        self._said = self.tracker_refused = ""
        self.swarm.allow(fleet)
        self.fleet = set(fleet)
        with self._lock:
            self.peers.update(peers)

    def _from_redis(self, held: list[str], node: str, why: str) -> None:
        """The tracker away: peers as its records in Redis last said, and the fleet as it was plus whoever they name.

        The byte listener's host gone is the case (issue 38): the records it wrote are still
        there (kept 10 × the tracker's 30 s after a node's last announce), and this node may
        read them. Nobody leaves the fleet meanwhile: the tracker's check of each node's
        enrolment is the byte listener's, so a node revoked while it is away is dropped when
        it is back (docs/fleet.md).
        """
        try:
            client = redis_client()
            pipe = client.pipeline()
            pipe.hgetall(keys.SWARM_FLEET)
            for h in held:
                pipe.hgetall(keys.SWARM_PREFIX + h)
            fleet_raw, *held_raw = pipe.execute()
        except redis.RedisError as error:
            self._say(f"{why}, and Redis neither ({error}); peers stay as they were")
            return
        fleet = {host for host, _ in _records(fleet_raw, node).values()}
        if fleet - self.fleet:
            self.fleet |= fleet
            self.swarm.allow(self.fleet)
        with self._lock:
            for h, raw in zip(held, held_raw, strict=True):
                found = sorted(set(_records(raw, node).values()))
                if found:
                    self.peers[h] = found
        with self._lock:
            known = sum(len(self.peers.get(h, ())) for h in held)
        self._say(
            f"{why}; peers are taken from the tracker's records in Redis meanwhile "
            f"({len(self.fleet)} addresses let in, {known} peers known for the {len(held)} torrents this node holds)"
        )

    def _refused(self, address: str) -> None:
        # An address the filter does not know connected: a node that enrolled or started since the last
        # answer, most likely. Asked at once, so that it is let in now rather than at the next round.
        if address not in self.fleet:
            self._announce_now.set()

    def _say(self, sentence: str) -> None:
        if sentence != self._said:
            self._said = sentence
            log.warning("%s", sentence)

    def _keep_announcing(self) -> None:
        while not self._stop.is_set() and not self.swarm.closed:
            self._announce_now.clear()
            try:
                self.seed_complete_sets()
                self.announce()
            except Exception:
                log.exception("announcing this node's torrents")
            # At most once a second, however often strangers knock.
            self._stop.wait(ANNOUNCE_FETCHING_S)
            if not self.fetching:
                self._announce_now.wait(ANNOUNCE_S - ANNOUNCE_FETCHING_S)

    def peers_of(self, info_hash: str) -> list[tuple[str, int]]:
        with self._lock:
            return list(self.peers.get(info_hash, []))

    # --- seeding -------------------------------------------------------------------

    def remember(self, torrent: bytes, directory: Path) -> str:
        """Keep a set's torrent beside the cache's records, so that a restarted node seeds it again."""
        key = info_hash_of(torrent)
        where = state_dir(self.cache) / "torrents"
        where.mkdir(parents=True, exist_ok=True)
        (where / f"{key}.torrent").write_bytes(torrent)
        (where / f"{key}.json").write_text(json.dumps({"directory": str(directory)}))
        return key

    def seed_complete_sets(self) -> None:
        """Every set whose `.complete` is there is seeded; one no longer complete is not."""
        where = state_dir(self.cache) / "torrents"
        held = self.swarm.held()
        for meta in where.glob("*.json") if where.exists() else []:
            key = meta.stem
            if key in self.fetching:
                continue
            try:
                directory = Path(json.loads(meta.read_text())["directory"])
            except (OSError, ValueError, KeyError):
                continue
            complete = (directory / ".complete").exists()
            if complete and not held.get(key):
                try:
                    self.swarm.seed((where / f"{key}.torrent").read_bytes(), directory)
                except (OSError, SwarmError) as error:
                    log.warning("not seeding %s: %s", directory, error)
            elif not complete and key in held:
                self.swarm.forget(key)

    # --- fetching ------------------------------------------------------------------

    def fetch(self, torrent: bytes, directory: Path, source: str, single_file: bool, progress, **stall) -> dict:
        key = info_hash_of(torrent)
        self.remember(torrent, directory)
        self.fetching.add(key)
        self._announce_now.set()  # and then every second while it runs
        try:
            self.announce()
            seeds_made = {"at": 0.0, "urls": []}
            pieces = torrent_info(torrent).num_pieces()
            connections = min(getattr(settings, "FETCH_CONNECTIONS", 8), max(1, pieces // PIECES_PER_CONNECTION))

            def seeds_now() -> list[str]:
                if time.monotonic() - seeds_made["at"] >= RENEW_PASS_S:
                    seeds_made.update(at=time.monotonic(), urls=web_seeds(source, single_file, connections))
                # Once a peer is known for the set, the mirror is one connection: more would ask it for
                # pieces the peers hold, and eight nodes would each take the whole set from it.
                return seeds_made["urls"][:1] if self.peers_of(key) else seeds_made["urls"]

            asked_after = {"refusal": ""}

            def progress_unless_refused(status) -> None:
                # Refused by the tracker: the mirror is asked once whether it refuses this node too (it
                # does unless it is open to anyone), and the fetch stops with its sentence, as over HTTP,
                # rather than waiting on a web seed that refuses it until every source counts as stalled.
                if self.tracker_refused and asked_after["refusal"] != self.tracker_refused:
                    asked_after["refusal"] = self.tracker_refused
                    if refusal := mirror_refusal(source):
                        raise SwarmError(refusal)  # not transient: a revoked node stays revoked
                progress(status)

            done = self.swarm.fetch(
                torrent,
                directory,
                web_seeds=seeds_now,
                peers=lambda: self.peers_of(key),
                progress=progress_unless_refused,
                resume_path=resume_path(self.cache, key),
                **stall,
            )
        finally:
            self.fetching.discard(key)
        return {
            "bytes_from_peers": done.bytes_from_peers,
            "bytes_from_mirror": done.bytes_from_web_seeds,
            "banned": done.banned,
            "stalled": done.stalled,
            "seconds": done.seconds,
        }

    def close(self) -> None:
        self._stop.set()
        self._announce_now.set()
        self.swarm.close()


def _records(raw: dict, node: str) -> dict[str, tuple[str, int]]:
    """{node: (host, port)} of a tracker hash in Redis, this node's own record and malformed ones left out."""
    out = {}
    for name, value in raw.items():
        name = name.decode() if isinstance(name, bytes) else name
        try:
            record = json.loads(value)
            out[name] = (str(record["host"]), int(record["port"]))
        except (ValueError, KeyError, TypeError):
            continue
    out.pop(node, None)
    return out


def mirror_refusal(source: str) -> str:
    """The byte listener's sentence when it refuses this node the source (401), else ""."""
    try:
        response = new_session(source).get(source, timeout=TIMEOUT, stream=True)
    except requests.RequestException:
        return ""  # not an answer either way: the web seed's own failures say the rest
    with response:
        return str(status_error(source, 401, response)) if response.status_code == 401 else ""


# --- the session's process, and a fetch through it -----------------------------------------


_local: NodeSwarm | None = None
_local_lock = threading.Lock()


def fetch(torrent: bytes, directory: Path, source: str, single_file: bool, progress, **stall) -> dict:
    """Fetch through the node's session (its process, else one made in this process); raises SwarmError.

    `progress(status_dict)` is called as it goes; raising from it stops the fetch.
    """
    cache = runtime.cache_dir()
    conn = session_socket.connect(cache)
    if conn is None:
        global _local
        with _local_lock:
            if _local is None:
                _local = NodeSwarm(cache, 0)
        return _local.fetch(torrent, directory, source, single_file, lambda s: progress(s.__dict__), **stall)
    return session_socket.ask(conn, torrent, directory, source, single_file, progress, stall)


def start():
    """Called by the agent command: the session as a process of its own beside the worker."""
    import subprocess

    env = dict(os.environ, LLMGW_NODE_TOKEN=runtime.token())
    argv = [sys.executable, "-m", "agent.peers", "--cache", str(runtime.cache_dir()), "--parent", str(os.getpid())]
    return subprocess.Popen(argv, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="This node's libtorrent session: fetch sets, seed what it holds.")
    parser.add_argument("--cache", required=True, type=Path)
    parser.add_argument("--parent", type=int, default=0, help="exit when this process (the agent) is gone")
    options = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agent.settings")
    import django

    django.setup()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s peers: %(message)s")
    os.environ[runtime.AGENT_CACHE] = str(options.cache)
    state_dir(options.cache).mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if options.parent:
        threading.Thread(target=runtime.stop_with_parent, args=(options.parent, stop), daemon=True).start()
    node_swarm = NodeSwarm(options.cache, settings.PEER_PORT)
    log.info("serving the fleet on port %d", node_swarm.swarm.listen_port)
    threading.Thread(
        target=session_socket.serve, args=(node_swarm.fetch, socket_path(options.cache), stop), daemon=True
    ).start()
    stop.wait()
    node_swarm.close()
    socket_path(options.cache).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
