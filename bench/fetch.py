#!/usr/bin/env python
"""The agent's set fetch vs curl and aria2c: one 4-file set from the byte listener, in one run.

    .venv/bin/python bench/fetch.py [--size-mib 2048] [--runs 3] [--parallel 4]

Writes a version of four files (--size-mib in all) into a temporary mirror, serves
it from llmgw's byte listener, and fetches the whole set, alternating the order
of the contenders each run so that none gets a warmer machine:

  agent            agent.fetch.fetch_source on the version's address (files in parallel)
  agent, 1 file    the same with one file at a time
  curl             curl, one file after another
  aria2c -x8       aria2c with 8 connections a file, the files at once

Prints each one's median time and throughput, and its ratio to curl. The agent
also fsyncs every file before renaming it into place (a crash must not leave a
whole-looking file that is not); curl and aria2c do not. Only loopback is used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import ROOT, start_byte_listener, wait_for

NAMES = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def write_set(directory: Path, total_mib: int) -> int:
    directory.mkdir(parents=True)
    block = os.urandom(4 << 20)
    each = (total_mib << 20) // len(NAMES)
    for index, name in enumerate(NAMES):
        with open(directory / name, "wb") as fh:
            left = each
            salt = index.to_bytes(8, "little")
            while left:
                chunk = (salt + block)[: min(left, len(block) + 8)]
                fh.write(chunk)
                left -= len(chunk)
    return each * len(NAMES)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    for tool in ("curl", "aria2c"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install {'aria2' if tool == 'aria2c' else tool}")

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-fetch-"))
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
            "LLMGW_VAR": str(work / "var"),
            "LLMGW_MIRROR_ROOT": str(work / "mirror"),
        }
    )
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from agent.fetch import fetch_source

    total = write_set(work / "mirror" / "bench" / "v1", args.size_mib)
    listener, url = start_byte_listener(work / "mirror", work)
    base = url + "bench/v1/"
    try:
        wait_for(base)

        def agent(dest: Path, parallel: int) -> None:
            fetch_source(base, dest, parallel=parallel, any_host=True)

        def curl(dest: Path) -> None:
            dest.mkdir(parents=True)
            for name in NAMES:
                subprocess.run(["curl", "-sf", "-o", str(dest / name), base + name], check=True)

        def aria2c(dest: Path) -> None:
            dest.mkdir(parents=True)
            urls = dest / "urls.txt"
            urls.write_text("".join(base + name + "\n" for name in NAMES))
            subprocess.run(
                ["aria2c", "-x8", "-s8", "-j4", "-q", "--file-allocation=none", "-d", str(dest), "-i", str(urls)],
                check=True,
            )

        contenders = {
            "agent": lambda d: agent(d, args.parallel),
            "agent, 1 file at a time": lambda d: agent(d, 1),
            "curl, one file after another": curl,
            "aria2c -x8": aria2c,
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders)
        for run in range(args.runs):
            for name in order[run % len(order) :] + order[: run % len(order)]:
                dest = work / "dest"
                shutil.rmtree(dest, ignore_errors=True)
                started = time.perf_counter()
                contenders[name](dest)
                times[name].append(time.perf_counter() - started)
                fetched = sum(p.stat().st_size for p in dest.rglob("*.safetensors"))
                if fetched != total:
                    raise SystemExit(f"{name} fetched {fetched} bytes of {total}")
                print(f"run {run + 1}: {name}: {times[name][-1]:.2f} s", flush=True)
        shutil.rmtree(work / "dest", ignore_errors=True)

        curl_median = statistics.median(times["curl, one file after another"])
        print(f"\n{len(NAMES)} files, {total / (1 << 30):.2f} GiB, median of {args.runs} runs\n")
        print("| how | median | throughput | vs curl |")
        print("| --- | --- | --- | --- |")
        for name, values in times.items():
            median = statistics.median(values)
            rate = total / median / (1 << 20)
            print(f"| {name} | {median:.2f} s | {rate:,.0f} MiB/s | {curl_median / median:.2f} x |")
    finally:
        os.killpg(listener.pid, 15)
        listener.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
