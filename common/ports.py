"""What the two uvicorn commands (`manage.py admin_server`, `manage.py gateway`) share."""

from __future__ import annotations

import resource

from django.core.management.base import CommandError


def add_workers_argument(parser, default: int, port: str, setting: str) -> None:
    parser.add_argument(
        "--workers",
        type=int,
        default=default,
        help=f"processes answering the {port} (default {setting}, 1); each is one event loop, so more use "
        "more cores. Keys' limits are counted in Redis and usage is added in the database, so the "
        "processes share them.",
    )


def checked_workers(workers: int) -> int:
    if workers < 1:
        raise CommandError(f"--workers takes a number of processes, 1 or more, not {workers}.")
    return workers


def raise_open_files() -> None:
    """A thousand streams hold two thousand sockets; the usual soft limit of 1024 open files
    would refuse them long before that."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
