"""The supervisor as engine tests drive it: what it reported, a step until a condition, vLLM's stand-in."""

from __future__ import annotations

import textwrap

from agent import supervisor

from .waiting import wait_until


class Reports(list):
    """What the supervisor told the control plane, in order."""

    def __call__(self, replica_id, state, endpoint, reason):
        self.append((replica_id, state, endpoint, reason))

    def states(self, replica_id: int = 1) -> list[str]:
        return [r[1] for r in self if r[0] == replica_id]

    def last(self, replica_id: int = 1):
        return [r for r in self if r[0] == replica_id][-1]


def step_until(sup: supervisor.Supervisor, condition, timeout: float, what: str):
    def stepped():
        sup.step()
        return condition()

    return wait_until(stepped, timeout=timeout, interval=0.2, what=what)


STAND_IN = textwrap.dedent(
    """\
    #!{python}
    # A STAND-IN for vLLM, which needs a GPU this machine does not have: it records
    # its arguments and answers /v1/models the way an engine does, and like vLLM
    # refuses a request to /v1/ without the key in VLLM_API_KEY, when that is set.
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    with open(os.environ["VLLM_STAND_IN_LOG"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    port = int(sys.argv[sys.argv.index("--port") + 1])
    key = os.environ.get("VLLM_API_KEY")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if key and self.headers.get("Authorization") != "Bearer " + key:
                body = json.dumps({{"error": "Unauthorized"}}).encode()
                self.send_response(401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            body = json.dumps({{"object": "list", "data": [{{"id": sys.argv[2], "object": "model"}}]}}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)
