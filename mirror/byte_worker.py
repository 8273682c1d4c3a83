"""The byte listener's gunicorn worker: gevent, so a slow client costs a greenlet, not a thread.

With threads (gthread) a request's head is read in a worker thread, so a hundred
clients sending one header line every few seconds held every thread and no download
could start. Under gevent, reading heads is the event loop's business: a thousand
such clients cost memory, and gunicorn closes any whose head has not arrived within
the keep-alive time (`LLMGW_BYTES_HEADER_TIMEOUT_S`), idle kept-alive ones alike.

gevent's own `socket.sendfile` copies the file through Python 8 KiB at a time (its
comment: os.sendfile is not cooperative), which cost the zero-copy path that keeps
the byte listener level with nginx. `os.sendfile` on the non-blocking socket is
cooperative enough: it sends what the socket buffer takes, and the greenlet waits
for the socket to be writable before the next call, like nginx's event loop.
"""

from __future__ import annotations

import io
import os

import gevent
from gunicorn.workers.ggevent import GeventWorker

# A reader as fast as the disk never fills the socket, so the greenlet would never wait:
# after this many bytes it lets this worker's other connections, and its heartbeat, have a turn.
TURN_BYTES = 16 << 20


def cooperative_sendfile(self, file, offset: int = 0, count: int | None = None) -> int:
    """socket.sendfile for a gevent socket: os.sendfile, waiting on the hub whenever the socket is full."""
    self._check_sendfile_params(file, offset, count)
    try:
        source = file.fileno()
        if count is None:
            count = os.fstat(source).st_size - offset
    except (AttributeError, io.UnsupportedOperation, OSError):
        return self._sendfile_use_send(file, offset, count)
    sent = turn = 0
    try:
        while sent < count:
            try:
                done = os.sendfile(self.fileno(), source, offset + sent, count - sent)
            except BlockingIOError:
                self._wait(self._write_event)
                continue
            if done == 0:
                break  # the file is shorter than it was said to be
            sent += done
            if sent - turn >= TURN_BYTES:
                turn = sent
                gevent.sleep(0)
        return sent
    finally:
        if sent and hasattr(file, "seek"):
            file.seek(offset + sent)


class ByteWorker(GeventWorker):
    def patch(self) -> None:
        super().patch()
        from gevent import socket

        socket.socket.sendfile = cooperative_sendfile
