"""The swarm's libtorrent session: its listening port, the torrents it holds, who may connect, and its alerts."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import libtorrent as lt

from contracts.swarm import resume
from contracts.swarm.addresses import endpoint, resolve, without_credentials

# One logger for the whole package, as when it was one module: operators filter on its name.
log = logging.getLogger("contracts.swarm")

ALERTS = (
    lt.alert_category.error
    | lt.alert_category.status
    | lt.alert_category.storage
    | lt.alert_category.peer
    | lt.alert_category.ip_block
)


class Held:
    """One torrent in the session: its handle and what the alert thread found for it."""

    def __init__(self, handle: lt.torrent_handle, resume_path: Path | None):
        self.handle = handle
        self.resume_path = resume_path
        self.events: deque[str] = deque()
        self.banned: list[str] = []
        self.error = ""
        self.resume_saved = threading.Event()


class Session:
    """One libtorrent session: a listening port, the torrents it holds, who may connect; `Swarm` adds its verbs."""

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
        self._torrents: dict[str, Held] = {}
        self._allowed: set[str] | None = None
        self._always: set[str] = set()  # web seeds' addresses: the filter must not cut off the mirror
        self._blocked: dict[str, float] = {}  # stalled peers' addresses, until when
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._alerts, name="swarm-alerts", daemon=True)
        self._pump.start()
        # A session still running when the interpreter ends aborts the process (libtorrent's
        # threads outlive Python's): closed first, whoever forgot to.
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def listen_port(self) -> int:
        return self.session.listen_port()

    # --- who may connect -------------------------------------------------------------

    def allow(self, addresses: Iterable[str] | None) -> None:
        """Only these addresses may connect to this session or be connected to (None: anyone).

        Applied at once: a connection to an address no longer allowed is closed, and the
        next one refused. Web seeds' addresses stay allowed.
        """
        with self._lock:
            self._allowed = None if addresses is None else {a for a in map(resolve, addresses) if a}
            self._apply_filter()

    def always_allow(self, address: str) -> None:
        """A web seed's address: `allow` must not cut off the mirror."""
        if address in self._always:
            return
        with self._lock:
            self._always.add(address)
            self._apply_filter()

    def block_for(self, address: str, seconds: float) -> None:
        """A stalled peer's address, refused for a while; it frees itself at the next `refilter` after that."""
        with self._lock:
            self._blocked[address] = time.monotonic() + seconds
            self._apply_filter()

    def is_blocked(self, address: str) -> bool:
        return address in self._blocked

    def refilter(self) -> None:
        with self._lock:
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

    # --- the torrents held -----------------------------------------------------------

    def add(self, key: str, params: lt.add_torrent_params, resume_path: Path | None) -> Held:
        handle = self.session.add_torrent(params)
        held = Held(handle, resume_path)
        with self._lock:
            self._torrents[key] = held
        return held

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

    def holding(self, info_hash: str) -> Held | None:
        with self._lock:
            return self._torrents.get(info_hash)

    def handle(self, info_hash: str) -> lt.torrent_handle | None:
        held = self.holding(info_hash)
        return held.handle if held is not None else None

    # --- the alerts ------------------------------------------------------------------

    def _owner(self, alert) -> Held | None:
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
            address = endpoint(alert).rsplit(":", 1)[0]
            # Refused by `allow`, not for having stalled: the caller may learn the fleet anew.
            if alert.reason == lt.reason_t.ip_filter and address not in self._blocked and self.on_refused:
                self.on_refused(address)
            return
        held = self._owner(alert)
        if held is not None:
            _on_torrent_alert(held, alert)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # An alert wakes the pump at once from its wait (half a second at most, 0.3 s on average a close).
        self.session.post_session_stats()
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


def _on_torrent_alert(held: Held, alert) -> None:
    """What an alert about one torrent tells its fetch: its resume record, a ban, an error, an event."""
    if isinstance(alert, lt.save_resume_data_alert):
        if held.resume_path is not None:
            resume.write(held.resume_path, alert.params)
        held.resume_saved.set()
    elif isinstance(alert, lt.cache_flushed_alert):
        if held.resume_path is not None:
            held.handle.save_resume_data(lt.torrent_handle.save_info_dict)
    elif isinstance(alert, lt.save_resume_data_failed_alert):
        held.resume_saved.set()
    elif isinstance(alert, lt.peer_ban_alert):
        who = f"peer {endpoint(alert)}"
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
        held.events.append(f"the web seed {without_credentials(alert.server_url())} failed: {alert.error_message()}")
