"""A `llama-server` that loads, answers /v1/models, and then fails the way a bad build does.

Written onto a PATH as an executable named llama-server, it is what the agent finds
and starts in place of llama.cpp. On its first generation it does what the engine
built with AMX does on these CPUs: dies by SIGILL, a real signal killing a real
process. Or, with `hang`, it never answers. Used by tests/test_selftest.py.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """\
    #!{python}
    import http.server, json, os, signal, sys, time
    MODE = {mode!r}
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({{"object": "list", "data": [{{"id": "fake"}}]}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            if MODE == "sigill":
                print("ggml_backend_amx_mul_mat: tilezero", flush=True)
                os.kill(os.getpid(), signal.SIGILL)
            time.sleep(3600)

    print("model loaded", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def install(bin_dir: Path, mode: str = "sigill") -> Path:
    """An executable `llama-server` in `bin_dir` that crashes (`sigill`) or hangs (`hang`) on generating."""
    assert mode in ("sigill", "hang")
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "llama-server"
    path.write_text(SCRIPT.format(python=sys.executable, mode=mode))
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    print(install(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "sigill"))
