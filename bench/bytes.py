#!/usr/bin/env python
"""Byte listener vs nginx: the same file over loopback, measured in one run.

    .venv/bin/python bench/bytes.py [--size-mib 2048] [--runs 5] [--streams 8]

Writes a file of --size-mib into a temporary mirror, serves that directory from
llmgw's byte listener (gunicorn, gevent, sendfile) and from nginx (Debian's
package, sendfile on), and fetches it with curl, alternating between the two so
that neither gets a warmer machine. Prints medians and ratios (llmgw / nginx):

  one stream      throughput of a whole-file GET
  ranged          throughput of a GET for the second half (Range: bytes=N-)
  N streams       total throughput of N concurrent GETs, and each one's time to first byte

Needs nginx (apt-get install nginx-light) and curl. Only loopback is used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from harness import Servers, free_port, side_by_side, table, wait_for


def start_nginx(servers: Servers, root: Path) -> str:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        raise SystemExit("nginx is not installed: apt-get install nginx-light")
    port = free_port()
    work = servers.work
    conf = work / "nginx.conf"
    conf.write_text(f"""
{"user root;" if os.geteuid() == 0 else ""}
worker_processes auto;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
    }}
}}
""")
    servers.spawn([nginx, "-c", str(conf), "-p", str(work)], "nginx")
    return f"http://127.0.0.1:{port}/"


def curl(url: str, range_header: str | None = None) -> subprocess.Popen:
    argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{size_download} %{time_starttransfer} %{time_total}"]
    if range_header:
        argv += ["-H", f"Range: {range_header}"]
    return subprocess.Popen(argv + [url], stdout=subprocess.PIPE, text=True)


def one(url: str, range_header: str | None = None) -> float:
    out = curl(url, range_header).communicate()[0].split()
    size, total = int(out[0]), float(out[2])
    return size / total


def parallel(url: str, streams: int) -> dict[str, float]:
    """All streams' bytes over the wall time, and the slowest first byte."""
    start = time.monotonic()
    processes = [curl(url) for _ in range(streams)]
    results = [p.communicate()[0].split() for p in processes]
    wall = time.monotonic() - start
    return {"total": sum(int(r[0]) for r in results) / wall, "first byte": max(float(r[1]) for r in results)}


def gib(rate: float) -> str:
    return f"{rate / (1 << 30):6.2f} GiB/s"


def write_file(path: Path, size_mib: int) -> None:
    path.parent.mkdir(parents=True)
    with open(path, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(size_mib):
            fh.write(block)
    # Read once so both servers start from a warm page cache.
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    size = args.size_mib << 20

    with Servers() as servers:
        root = servers.work / "mirror"
        write_file(root / "m" / "v1" / "big.gguf", args.size_mib)
        urls = {"llmgw": servers.byte_listener(root)[1], "nginx": start_nginx(servers, root)}
        urls = {name: url + "m/v1/big.gguf" for name, url in urls.items()}
        for url in urls.values():
            wait_for(url)

        def whole_and_ranged(url: str):
            return lambda: {"whole": one(url), "ranged": one(url, f"bytes={size // 2}-")}

        singles = side_by_side({name: whole_and_ranged(url) for name, url in urls.items()}, args.runs)
        streams = side_by_side(
            {name: (lambda url=url: parallel(url, args.streams)) for name, url in urls.items()}, args.runs
        )

    def med(samples: dict, name: str, figure: str) -> float:
        return statistics.median(s[figure] for s in samples[name])

    print(f"file: {args.size_mib} MiB, {args.runs} runs each, alternating; medians")
    rows = []
    for label, samples, figure in (
        ("one stream", singles, "whole"),
        ("ranged (2nd half)", singles, "ranged"),
        (f"{args.streams} streams, total", streams, "total"),
    ):
        a, b = med(samples, "llmgw", figure), med(samples, "nginx", figure)
        rows.append((label, gib(a), gib(b), f"{a / b:.2f}"))
    a, b = med(streams, "llmgw", "first byte"), med(streams, "nginx", "first byte")
    rows.append(("slowest first byte", f"{a * 1000:.1f} ms", f"{b * 1000:.1f} ms", ""))
    table(["", "llmgw", "nginx", "ratio"], rows)
    print(f"ranged / whole (llmgw): {med(singles, 'llmgw', 'ranged') / med(singles, 'llmgw', 'whole'):.2f}")


if __name__ == "__main__":
    main()
