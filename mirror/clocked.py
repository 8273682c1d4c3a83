"""HTTP requests with a clock of their whole, not only of each read (issue 34).

A read timeout counts from the last byte: a server that sends one every few seconds, in
its TLS handshake, its headers or its body, never trips it and holds the request, and
the worker making it, for hours. Within `with Cut(seconds), session() as s:` every
socket the session opens is shut down once `seconds` have passed (`Cut.cut` then says
so), wherever the request is.
"""

from __future__ import annotations

import socket
import threading

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import ProxyManager

_watching = threading.local()  # the Cut of the request this thread is making, if any


class Cut:
    """The sockets a request opens within it, shut down `seconds` after it was made."""

    def __init__(self, seconds: float):
        self.cut = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True

    def add(self, sock: socket.socket) -> None:
        # A duplicate of its descriptor: the same connection, still ours to shut down once TLS
        # has wrapped (and detached) the socket urllib3 made.
        duplicate = socket.fromfd(sock.fileno(), sock.family, sock.type)
        with self._lock:
            self._sockets.append(duplicate)
            if self.cut:
                _shut(duplicate)

    def _fire(self) -> None:
        with self._lock:
            self.cut = True
            for sock in self._sockets:
                _shut(sock)

    def __enter__(self) -> Cut:
        _watching.cut = self
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        _watching.cut = None
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets = []


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class _Watched:
    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        if (cut := getattr(_watching, "cut", None)) is not None:
            cut.add(sock)
        return sock


class _WatchedHTTPConnection(_Watched, HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, HTTPSConnection):
    pass


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


WATCHED_POOLS = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


class _WatchedAdapter(HTTPAdapter):
    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = WATCHED_POOLS

    def proxy_manager_for(self, proxy, **proxy_kwargs):
        # Through an HTTP proxy (HTTPS_PROXY) too; a SOCKS proxy's pools are its own, with their per-read timeouts.
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, ProxyManager):
            manager.pool_classes_by_scheme = WATCHED_POOLS
        return manager


def session() -> requests.Session:
    session = requests.Session()
    session.mount("http://", _WatchedAdapter())
    session.mount("https://", _WatchedAdapter())
    return session
