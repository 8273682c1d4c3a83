"""A small real HTTP server on a loopback port, answering as the test says."""

from __future__ import annotations

import http.server
import threading

from ..services import free_port


class LoopbackServer:
    """A small real HTTP server on another loopback port; `handle(handler, method)` answers,
    and every request is remembered."""

    def __init__(self, handle):
        self.requests: list[tuple[str, str]] = []
        self.sent = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append(("GET", self.path))
                try:
                    handle(self, "GET")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_HEAD(self):
                server.requests.append(("HEAD", self.path))
                handle(self, "HEAD")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *a: None
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
