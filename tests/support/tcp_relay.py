"""A TCP relay in front of a server, cut at will: that server "away" for one process alone.

A process given the relay's port instead of the server's sees the server go away when
the relay is cut (its connections reset, new ones refused), while every other process
of the test session goes on using the server itself: no shared PostgreSQL stopped
under the other tests. Listening on a bridge's address, it is also how hosts in network
namespaces reach a server that listens on loopback only.
"""

from __future__ import annotations

import socket
import threading


class TcpRelay:
    def __init__(self, upstream: tuple[str, int], listen: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self._listener = socket.create_server((listen, 0))
        self.port = self._listener.getsockname()[1]
        self.address = (listen, self.port)
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """New connections refused, and every open one reset."""
        self._listener.close()
        with self._lock:
            for end in self._open:
                end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # RST, not FIN
                end.close()
            self._open.clear()
