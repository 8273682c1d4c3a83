"""The limiter reaches Redis over a unix socket (unix://) and over TLS (rediss://), not only redis://."""

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from gateway.errors import Refusal
from gateway.limits import Limiter, Limits

from .support.waiting import wait_until


def _third_is_refused(url: str) -> None:
    async def go() -> None:
        limiter = Limiter(url)
        limits = Limits(2, 0, 0, 0, 0)
        for _ in range(2):
            assert await limiter.admit("unixsockettest01", limits) is not None, "Redis answered the limiter"
        with pytest.raises(Refusal):
            await limiter.admit("unixsockettest01", limits)
        await limiter.close()

    asyncio.run(go())


def test_a_key_of_two_requests_a_minute_gets_its_third_refused_through_a_unix_socket(tmp_path: Path):
    sock = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [
            shutil.which("redis-server"),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--save",
            "",
            "--requirepass",
            "s3cret",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(unix_socket_path=str(sock), password="s3cret")
        wait_until(lambda: sock.exists() and client.ping(), what="the unix-socket redis-server to answer")
        _third_is_refused(f"unix://:s3cret@{sock}?db=3")
        assert redis.Redis(unix_socket_path=str(sock), password="s3cret", db=3).dbsize() > 0, "counted in db 3"
    finally:
        server.terminate()
        server.wait()
