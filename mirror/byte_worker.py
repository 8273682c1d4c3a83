"""The byte listener's gunicorn worker: gevent, so a slow client costs a greenlet, not a thread.

With threads (gthread) a request's head is read in a worker thread, so a hundred
clients sending one header line every few seconds held every thread and no download
could start. Under gevent, reading heads is the event loop's business: a thousand
such clients cost memory, and gunicorn closes any whose head has not arrived within
the keep-alive time (`LLMGW_BYTES_HEADER_TIMEOUT_S`), idle kept-alive ones alike.

gevent's own `socket.sendfile` copies the file through Python 8 KiB at a time (its
comment: os.sendfile is not cooperative), which would cost the zero-copy path that
keeps the byte listener level with nginx. Calling os.sendfile on the non-blocking
socket from the event loop keeps it zero-copy but returns each time the socket buffer
is full, and those round trips cost 10-30 % against nginx (docs/benchmarks.md). So a
body goes out as gthread sent it, one long blocking sendfile(2) in a thread (gevent's
pool), in pieces; the socket's SO_SNDTIMEO bounds how long a thread waits for room, and
a reader slower than that is waited for on the hub, holding no thread.
"""

from __future__ import annotations

import io
import os
import socket
import struct

import gevent
from gunicorn.workers.ggevent import GeventWorker

# A body goes out in pieces of this size, each one blocking sendfile(2) in a thread of
# gevent's pool: the kernel loops inside it as it did under gthread.
PIECE_BYTES = 64 << 20
# The longest a thread waits for room in a socket; a reader slower than that is waited for on the hub.
SEND_TIMEOUT = struct.pack("ll", 0, 200_000)
THREADS = 32


def cooperative_sendfile(self, file, offset: int = 0, count: int | None = None) -> int:
    """socket.sendfile for a gevent socket: long blocking sendfiles in a thread, waits for room on the hub."""
    self._check_sendfile_params(file, offset, count)
    try:
        source = file.fileno()
        if count is None:
            count = os.fstat(source).st_size - offset
    except (AttributeError, io.UnsupportedOperation, OSError):
        return self._sendfile_use_send(file, offset, count)
    target = self.fileno()
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, SEND_TIMEOUT)

    def send(start: int, size: int) -> int:
        os.set_blocking(target, True)
        try:
            return os.sendfile(target, source, start, size)
        except BlockingIOError:
            return -1  # no room within SO_SNDTIMEO
        finally:
            os.set_blocking(target, False)

    pool = gevent.get_hub().threadpool
    sent = 0
    try:
        while sent < count:
            size = min(count - sent, PIECE_BYTES)
            done = pool.apply(send, (offset + sent, size))
            if done == 0:
                break  # the file is shorter than it was said to be
            if done > 0:
                sent += done
            if done < size:
                # A slow reader: wait for room on the hub rather than hold a thread for it.
                self._wait(self._write_event)
        return sent
    finally:
        if sent and hasattr(file, "seek"):
            file.seek(offset + sent)


class ByteWorker(GeventWorker):
    def patch(self) -> None:
        super().patch()
        from gevent import socket

        socket.socket.sendfile = cooperative_sendfile
        gevent.get_hub().threadpool.maxsize = THREADS
