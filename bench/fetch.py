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
import subprocess
import time
from pathlib import Path

from harness import Servers, django_setup, medians, side_by_side, table, wait_for

CURL = "curl, one file after another"
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


def fetches(base: str, dest: Path, total: int, parallel: int) -> dict:
    """Each contender: a fetch of the whole set into `dest`, timed and checked whole."""
    from agent.fetch import fetch_source

    def agent(files_at_once: int) -> None:
        fetch_source(base, dest, parallel=files_at_once, any_host=True)

    def curl() -> None:
        dest.mkdir(parents=True)
        for name in NAMES:
            subprocess.run(["curl", "-sf", "-o", str(dest / name), base + name], check=True)

    def aria2c() -> None:
        dest.mkdir(parents=True)
        urls = dest / "urls.txt"
        urls.write_text("".join(base + name + "\n" for name in NAMES))
        subprocess.run(
            ["aria2c", "-x8", "-s8", "-j4", "-q", "--file-allocation=none", "-d", str(dest), "-i", str(urls)],
            check=True,
        )

    def timed_fetch(fetch):
        def run() -> float:
            shutil.rmtree(dest, ignore_errors=True)
            started = time.perf_counter()
            fetch()
            seconds = time.perf_counter() - started
            fetched = sum(p.stat().st_size for p in dest.rglob("*.safetensors"))
            if fetched != total:
                raise SystemExit(f"fetched {fetched} bytes of {total}")
            return seconds

        return run

    return {
        "agent": timed_fetch(lambda: agent(parallel)),
        "agent, 1 file at a time": timed_fetch(lambda: agent(1)),
        CURL: timed_fetch(curl),
        "aria2c -x8": timed_fetch(aria2c),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    for tool in ("curl", "aria2c"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install {'aria2' if tool == 'aria2c' else tool}")

    with Servers("llmgw-bench-fetch-") as servers:
        work = servers.work
        os.environ["LLMGW_MIRROR_ROOT"] = str(work / "mirror")
        django_setup(work / "var")

        total = write_set(work / "mirror" / "bench" / "v1", args.size_mib)
        base = servers.byte_listener(work / "mirror")[1] + "bench/v1/"
        wait_for(base)
        contenders = fetches(base, work / "dest", total, args.parallel)
        times = side_by_side(
            contenders,
            args.runs,
            each=lambda run, name, seconds: print(f"run {run + 1}: {name}: {seconds:.2f} s", flush=True),
        )

    medians_s = medians(times)
    print(f"\n{len(NAMES)} files, {total / (1 << 30):.2f} GiB, median of {args.runs} runs\n")
    table(
        ["how", "median", "throughput", "vs curl"],
        [
            (name, f"{m:.2f} s", f"{total / m / (1 << 20):,.0f} MiB/s", f"{medians_s[CURL] / m:.2f} x")
            for name, m in medians_s.items()
        ],
    )


if __name__ == "__main__":
    main()
