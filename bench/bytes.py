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
import tempfile
import time
from pathlib import Path

from benchlib import free_port, start_byte_listener, wait_for


def start_nginx(root: Path, work: Path) -> tuple[subprocess.Popen, str]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        raise SystemExit("nginx is not installed: apt-get install nginx-light")
    port = free_port()
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
    process = subprocess.Popen([nginx, "-c", str(conf), "-p", str(work)], stderr=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}/"


def curl(url: str, range_header: str | None = None) -> subprocess.Popen:
    argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{size_download} %{time_starttransfer} %{time_total}"]
    if range_header:
        argv += ["-H", f"Range: {range_header}"]
    return subprocess.Popen(argv + [url], stdout=subprocess.PIPE, text=True)


def one(url: str, range_header: str | None = None) -> float:
    out = curl(url, range_header).communicate()[0].split()
    size, total = int(out[0]), float(out[2])
    return size / total


def parallel(url: str, streams: int) -> tuple[float, list[float]]:
    start = time.monotonic()
    processes = [curl(url) for _ in range(streams)]
    results = [p.communicate()[0].split() for p in processes]
    wall = time.monotonic() - start
    total_bytes = sum(int(r[0]) for r in results)
    first_bytes = [float(r[1]) for r in results]
    return total_bytes / wall, first_bytes


def gib(rate: float) -> str:
    return f"{rate / (1 << 30):6.2f} GiB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    root = work / "mirror"
    (root / "m" / "v1").mkdir(parents=True)
    path = root / "m" / "v1" / "big.gguf"
    size = args.size_mib << 20
    with open(path, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(args.size_mib):
            fh.write(block)
    # Read once so both servers start from a warm page cache.
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass

    servers = {}
    try:
        servers["nginx"] = start_nginx(root, work)
        servers["llmgw"] = start_byte_listener(root, work)
        for _, url in servers.values():
            wait_for(url + "m/v1/big.gguf")
        urls = {name: url + "m/v1/big.gguf" for name, (_, url) in servers.items()}

        whole = {name: [] for name in servers}
        ranged = {name: [] for name in servers}
        for _ in range(args.runs):
            for name in ("llmgw", "nginx"):
                whole[name].append(one(urls[name]))
                ranged[name].append(one(urls[name], f"bytes={size // 2}-"))

        totals = {name: [] for name in servers}
        first_byte_worst = {name: [] for name in servers}
        for _ in range(args.runs):
            for name in ("llmgw", "nginx"):
                rate, first = parallel(urls[name], args.streams)
                totals[name].append(rate)
                first_byte_worst[name].append(max(first))

        med = statistics.median
        print(f"file: {args.size_mib} MiB, {args.runs} runs each, alternating; medians")
        print(f"{'':22}{'llmgw':>14}{'nginx':>14}{'ratio':>9}")
        for label, data in (
            ("one stream", whole),
            ("ranged (2nd half)", ranged),
            (f"{args.streams} streams, total", totals),
        ):
            a, b = med(data["llmgw"]), med(data["nginx"])
            print(f"{label:22}{gib(a):>14}{gib(b):>14}{a / b:>9.2f}")
        a, b = med(first_byte_worst["llmgw"]), med(first_byte_worst["nginx"])
        print(f"{'slowest first byte':22}{a * 1000:>11.1f} ms{b * 1000:>11.1f} ms")
        print(f"ranged / whole (llmgw): {med(ranged['llmgw']) / med(whole['llmgw']):.2f}")
    finally:
        for process, _ in servers.values():
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
