"""Another site's mirror as a pull sees it, on loopback: a version's manifest, its torrent and its files,
sent as slowly as a test says (a server that trickles, issue 34)."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import libtorrent as lt

from mirror import torrent

from .servers import LoopbackServer


class OtherMirror:
    """A real HTTP server on 127.0.0.1 answering as an llmgw byte listener does, to anyone.

    `file_rate` and `manifest_rate` are bytes a second for each answer (None: at once);
    `when_sent` is (bytes, callback): the callback runs once, in the server, when the files'
    bytes sent pass that many (something else filling the disk mid-pull, say).
    """

    def __init__(self, root: Path):
        self.root = root
        self.versions: dict[tuple[str, str], dict] = {}
        self.file_rate: int | None = None
        self.manifest_rate: int | None = None
        self.when_sent: tuple[int, callable] | None = None
        self.file_bytes_sent = 0
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.server = LoopbackServer(self._answer)
        self.url = self.server.url

    def add(self, model: str, version: str, files: dict[str, bytes]) -> str:
        """A version offered whole, with its v2 torrent; its address."""
        folder = self.root / model / version
        folder.mkdir(parents=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        entries = [lt.create_file_entry(f"{version}/{name}", len(data)) for name, data in sorted(files.items())]
        creator = lt.create_torrent(entries, torrent.PIECE_BYTES, lt.create_torrent.v2_only)
        creator.set_priv(True)
        lt.set_piece_hashes(creator, str(self.root / model))
        data = lt.bencode(creator.generate())
        self.versions[(model, version)] = {
            "files": files,
            "torrent": data,
            "info_hash": str(lt.torrent_info(data).info_hashes().v2),
        }
        return f"{self.url}{model}/{version}/"

    def stop(self) -> None:
        self._stopped.set()
        self.server.stop()

    def _answer(self, handler, method: str) -> None:
        path, _, query = handler.path.partition("?")
        parts = path.strip("/").split("/")
        offered = self.versions.get(tuple(parts[:2])) if len(parts) >= 2 else None
        if offered is None:
            return self._send(handler, 404, b'{"error": "nothing here"}', "application/json")
        if len(parts) == 2 and query == "torrent":
            return self._send(handler, 200, offered["torrent"], "application/x-bittorrent")
        if len(parts) == 2:
            manifest = {
                "model": parts[0],
                "version": parts[1],
                "files": [
                    {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                    for name, data in sorted(offered["files"].items())
                ],
                "torrent": {"info_hash": offered["info_hash"]},
            }
            body = json.dumps(manifest).encode()
            return self._send(handler, 200, body, "application/json", rate=self.manifest_rate)
        data = offered["files"].get(parts[2]) if len(parts) == 3 else None
        if data is None:
            return self._send(handler, 404, b'{"error": "nothing here"}', "application/json")
        start, end = 0, len(data) - 1
        wanted = handler.headers.get("Range", "")
        if wanted.startswith("bytes="):
            first, _, last = wanted[len("bytes=") :].partition("-")
            start, end = int(first), min(int(last), len(data) - 1) if last else len(data) - 1
        handler.send_response(206 if wanted else 200)
        if wanted:
            handler.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self._body(handler, data[start : end + 1], "application/octet-stream", self.file_rate, files=True)

    def _send(self, handler, status: int, body: bytes, content_type: str, rate: int | None = None) -> None:
        handler.send_response(status)
        self._body(handler, body, content_type, rate)

    def _body(self, handler, body: bytes, content_type: str, rate: int | None, files: bool = False) -> None:
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        step = max(1, (rate or len(body) or 1) // 10)  # a tenth of a second's worth at a time
        for at in range(0, len(body), step):
            if self._stopped.is_set():
                return
            chunk = body[at : at + step]
            handler.wfile.write(chunk)
            handler.wfile.flush()
            if files:
                self._count(len(chunk))
            if rate:
                # Sending slowly is what this server is for: nothing to poll.
                self._stopped.wait(len(chunk) / rate)

    def _count(self, sent: int) -> None:
        with self._lock:
            self.file_bytes_sent += sent
            due = self.when_sent is not None and self.file_bytes_sent >= self.when_sent[0]
            callback = self.when_sent[1] if due else None
            if due:
                self.when_sent = None
        if callback:
            callback()
