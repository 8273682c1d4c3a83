"""How the worker's fetches reach the node's libtorrent session (agent/peers.py): a Unix socket in the cache.

One connection per fetch: the fetch sends what it wants, the session sends its progress
back as it goes and then the outcome. Only the agent's processes may talk to it: the
key is made from the node's token.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from contracts.swarm import SwarmError

from . import runtime, unix_address

log = logging.getLogger("agent.peers")


def socket_path(cache: Path) -> Path:
    return Path(cache) / ".swarm" / "session.sock"  # in agent.peers.state_dir


def _authkey() -> bytes:
    # Whoever may talk to the session is whoever has the node's token: the agent's processes.
    return hashlib.sha256(b"llmgw-swarm:" + runtime.token().encode()).digest()


def serve(fetch: Callable[..., dict], path: Path, stop: threading.Event) -> None:
    """Answer fetches from the worker's processes with `fetch` (NodeSwarm.fetch): one connection per fetch,
    progress sent back as it goes."""
    path.unlink(missing_ok=True)
    with unix_address.reachable(path) as address:
        listener = Listener(address, family="AF_UNIX", authkey=_authkey())
    # multiprocessing unlinks the address it bound when the listener closes: that may be the
    # short /proc/self/fd/N/ form, whose descriptor is closed by then, so the real path is unlinked here.
    if (unlink := getattr(getattr(listener, "_listener", None), "_unlink", None)) is not None:
        unlink.cancel()
    os.chmod(path, 0o600)
    threading.Thread(target=lambda: (stop.wait(), listener.close(), path.unlink(missing_ok=True)), daemon=True).start()
    while not stop.is_set():
        try:
            conn = listener.accept()
        except (OSError, EOFError):
            if stop.is_set():
                return
            continue
        threading.Thread(target=_answer, args=(fetch, conn), name="swarm-fetch", daemon=True).start()


def _answer(fetch: Callable[..., dict], conn: Connection) -> None:
    with conn:
        try:
            ask = conn.recv()

            def progress(status) -> None:
                conn.send(("status", status.__dict__))  # a closed connection stops the fetch here

            result = fetch(
                ask["torrent"],
                Path(ask["directory"]),
                ask["source"],
                ask["single_file"],
                progress,
                **ask["stall"],
            )
            conn.send(("done", result))
        except SwarmError as error:
            _send(conn, ("error", str(error), error.transient))
        except (EOFError, OSError, BrokenPipeError):
            pass  # the fetch that asked is gone (cancelled, killed)
        except Exception as error:
            log.exception("a fetch through the session failed")
            _send(conn, ("error", f"the node's libtorrent session failed: {error}", True))


def _send(conn: Connection, message) -> None:
    try:
        conn.send(message)
    except (OSError, BrokenPipeError):
        pass


def connect(cache: Path) -> Connection | None:
    """A connection to the node's session process; None when there is none."""
    path = socket_path(cache)
    if not path.exists():
        return None
    try:
        with unix_address.reachable(path) as address:
            return Client(address, family="AF_UNIX", authkey=_authkey())
    except (OSError, EOFError):
        return None  # left behind by a session that is gone


def ask(
    conn: Connection, torrent: bytes, directory: Path, source: str, single_file: bool, progress, stall: dict
) -> dict:
    """A fetch through the session's process: `progress(status_dict)` as it goes; raises SwarmError."""
    with conn:
        conn.send(
            {
                "torrent": torrent,
                "directory": str(directory),
                "source": source,
                "single_file": single_file,
                "stall": stall,
            }
        )
        while True:
            try:
                kind, *said = conn.recv()
            except EOFError:
                raise SwarmError("the node's libtorrent session went away during the fetch", transient=True) from None
            if kind == "status":
                progress(said[0])
            elif kind == "done":
                return said[0]
            else:
                raise SwarmError(said[0], transient=said[1])
