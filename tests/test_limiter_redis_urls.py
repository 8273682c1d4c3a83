"""The limiter reaches Redis over a unix socket (unix://) and over TLS (rediss://), not only redis://."""

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from gateway.errors import Refusal
from gateway.limits import Limiter, Limits

from .services import free_port
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


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    work = tmp_path_factory.mktemp("tls-redis")
    ca, ca_key, cert, key, csr = (work / n for n in ("ca.crt", "ca.key", "redis.crt", "redis.key", "redis.csr"))
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(csr))
    ext = work / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(ext),
        "-out",
        str(cert),
    )
    port = free_port()
    server = subprocess.Popen(
        [
            shutil.which("redis-server"),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--requirepass",
            "s3cret",
            "--dir",
            str(work),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password="s3cret", ssl=True, ssl_ca_certs=str(ca))

        def answers():
            try:
                return client.ping()
            except redis.ConnectionError:
                return False

        wait_until(answers, what="the TLS redis-server to answer")
        yield port, ca
    finally:
        server.terminate()
        server.wait()


def test_a_key_of_two_requests_a_minute_gets_its_third_refused_through_redis_over_tls(tls_redis):
    port, ca = tls_redis
    _third_is_refused(f"rediss://:s3cret@localhost:{port}/2?ssl_ca_certs={ca}")


def test_a_tls_redis_whose_certificate_is_not_trusted_is_not_counted_on(tls_redis):
    port, _ = tls_redis

    async def go():
        limiter = Limiter(f"rediss://:s3cret@localhost:{port}/2")  # verifies against the system's CAs: refused
        assert await limiter.admit("untrustedtls0001", Limits(2, 0, 0, 0, 0)) is None
        await limiter.close()

    asyncio.run(go())
