"""A pytest plugin, loaded before Django's settings: the tests' own Redis, PostgreSQL and var/.

Loaded with `-p tests.services` so that REDIS_URL, DATABASE_URL and LLMGW_VAR are
set before pytest-django reads the settings. The tests start their own
redis-server and PostgreSQL server on free ports, so they never touch a server
somebody is using.

LLMGW_TEST_DATABASE picks the database the suite runs on: `postgres` (the
default, what a fleet runs) or `sqlite` (what `make run` uses on one machine).
`make test` runs the whole suite on PostgreSQL and the tests of what differs on
SQLite (the Makefile's SQLITE_TESTS) a second time on SQLite.
"""

import glob
import hashlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

_state: dict = {}


# Ports the tests pick for their servers: below the kernel's ephemeral range (where a connect()
# takes its source port, and where a server's bind(port 0) lands), so a port picked here and
# bound a moment later cannot meanwhile become some connection's source. Each pytest-xdist
# worker picks from a slice of its own, so two workers of one run never pick the same.
_PORTS_FROM = 10000
_handed_out: set[int] = set()


def _port_slice() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            ephemeral_from = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    # A worker started again after one crashed is gwN with N >= count: it takes a slice of the run's.
    index = int(worker) % max(count, 1) if worker.isdigit() else 0
    width = (ephemeral_from - _PORTS_FROM) // max(count, 1)
    start = _PORTS_FROM + index * width
    return range(start, start + width)


def free_port() -> int:
    """A port nothing on this host listens on (on any address), for a server a test starts.

    Never the same one twice in a test process, never one another worker of the run may
    pick (`_port_slice`), and never in the ephemeral range; bound moments later by the
    server, it is free then unless some other program on the machine took it meanwhile.
    """
    ports = _port_slice()
    if len(ports) < 100:  # an unusual ephemeral range: the kernel's own pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = ports[secrets.randbelow(len(ports))]
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} after 200 tries")


def _xdist_controller(early_config) -> bool:
    """Whether this process hands the tests to pytest-xdist's workers (`-n N`) and runs none itself."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    options = early_config.known_args_namespace
    return bool(getattr(options, "numprocesses", None) or getattr(options, "tx", None))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """This test process's var/, PostgreSQL and Redis: each xdist worker its own, the controller none."""
    var = tempfile.mkdtemp(prefix="llmgw-test-")
    _state["var"] = var
    os.environ["LLMGW_VAR"] = var
    os.environ["LLMGW_MIRROR_ROOT"] = os.path.join(var, "mirror")
    # The tests make their own database and catalog; a developer's must not leak in.
    for name in ("DATABASE_URL", "REDIS_URL", "LLMGW_CATALOG", "LLMGW_ADMIN_USER", "LLMGW_ADMIN_PASSWORD"):
        os.environ.pop(name, None)
    if _xdist_controller(early_config):
        return  # it runs no test; each worker, started with this environment, starts its own
    # pytest does not call pytest_unconfigure when this hook fails: what it started is stopped here (a
    # PostgreSQL started before a missing redis-server was found ran on, its directory behind it).
    try:
        _start_services(var)
    except BaseException:
        pytest_unconfigure(early_config)
        raise


def _start_services(var: str) -> None:
    database = os.environ.get("LLMGW_TEST_DATABASE", "postgres")
    if database not in ("postgres", "sqlite"):
        raise pytest.UsageError(f"LLMGW_TEST_DATABASE is {database!r}; it takes postgres or sqlite")
    binary = shutil.which("redis-server")
    if binary is None:
        raise pytest.UsageError("the tests need redis-server: `make test` installs it, or apt-get install redis-server")
    if database == "postgres":
        os.environ["DATABASE_URL"] = start_postgres()
    _start_redis(binary, var)


def _start_redis(binary: str, var: str) -> None:
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", var],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.05)
    else:
        process.kill()
        raise pytest.UsageError("the tests' redis-server did not start")
    _state["redis"] = process
    os.environ["REDIS_URL"] = url


def postgres_bin() -> str | None:
    """Debian's PostgreSQL server programs (/usr/lib/postgresql/N/bin, the newest), or those on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def start_postgres() -> str:
    """A private PostgreSQL server for this run: initdb in a temporary directory, a free loopback port.

    PostgreSQL refuses to run as root (CI and `make test` as root), so there it runs as
    `nobody` in a directory that user owns. Durability is off: the cluster is thrown away.
    """
    bindir = postgres_bin()
    if bindir is None:
        raise pytest.UsageError(
            "the tests need PostgreSQL's server (initdb, postgres): `make test` installs it, or "
            "apt-get install postgresql; LLMGW_TEST_DATABASE=sqlite runs them on SQLite instead"
        )
    home = tempfile.mkdtemp(prefix="llmgw-test-pg-")
    _state["pg_home"] = home
    run_as: dict = {}
    if os.geteuid() == 0:
        user = pwd.getpwnam("nobody")
        os.chown(home, user.pw_uid, user.pw_gid)
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    data = os.path.join(home, "data")
    cached = _migrated_cluster(bindir)
    if os.path.isdir(cached):
        # `cp -a`: the copy keeps the owner (nobody under root) and the modes PostgreSQL insists on.
        subprocess.run(["cp", "-a", cached, data], check=True)
        os.utime(cached)  # in use: not an older one to remove (_keep)
        process, port = _start_cluster(bindir, home, data, run_as)
        _state["migrated"] = MIGRATED
        return f"postgres://llmgw@127.0.0.1:{port}/llmgw"
    initdb = subprocess.run(
        [
            os.path.join(bindir, "initdb"),
            "-D",
            data,
            "-U",
            "llmgw",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        cwd=home,
        **run_as,
    )
    if initdb.returncode != 0:
        raise pytest.UsageError(f"the tests' PostgreSQL could not be made (initdb):\n{initdb.stderr}")
    process, port = _start_cluster(bindir, home, data, run_as)
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={port} user=llmgw dbname=postgres", autocommit=True) as conn:
        conn.execute("CREATE DATABASE llmgw")
        conn.execute(f"CREATE DATABASE {MIGRATED}")
    if _migrate(f"postgres://llmgw@127.0.0.1:{port}/{MIGRATED}"):
        _stop_cluster()
        _keep(data, cached)
        _start_cluster(bindir, home, data, run_as, port)
        _state["migrated"] = MIGRATED
    return f"postgres://llmgw@127.0.0.1:{port}/llmgw"


# A database migrated to the tree's migrations, in a cluster kept between runs (~/.cache/llmgw/test-postgres,
# one per set of migration files): each test process copies the cluster instead of running initdb, and
# the test database is made from it (CREATE DATABASE ... TEMPLATE, clone_migrated) instead of migrated
# anew, which took 5 to 8 s a process. The first run with new migrations makes it.
MIGRATED = "llmgw_migrated"
BASE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "llmgw", "test-postgres")


def _migrated_cluster(bindir: str) -> str:
    """Where the cluster migrated to this tree's migrations is kept: named for the server, Django and the migrations."""
    import django

    digest = hashlib.sha256(f"{bindir}\0{django.__version__}".encode())
    for path in sorted(glob.glob(os.path.join(BASE_DIR, "*", "migrations", "*.py"))):
        digest.update(os.path.relpath(path, BASE_DIR).encode())
        with open(path, "rb") as fh:
            digest.update(fh.read())
    return os.path.join(CACHE, digest.hexdigest()[:16])


def _migrate(url: str) -> bool:
    """`manage.py migrate` on the template database; whether it ran (a failure is left to pytest-django's own)."""
    env = {**os.environ, "DATABASE_URL": url}
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"], env=env, cwd=BASE_DIR, capture_output=True
    )
    return done.returncode == 0


def _keep(data: str, cached: str) -> None:
    """The stopped cluster copied into the cache, whole or not at all (another process may keep the same at once)."""
    os.makedirs(CACHE, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=CACHE)
    try:
        subprocess.run(["cp", "-a", data, os.path.join(staging, "data")], check=True)
        os.rename(os.path.join(staging, "data"), cached)
    except (OSError, subprocess.CalledProcessError):
        pass  # kept by another process meanwhile, or no room: the next run makes it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for other in glob.glob(os.path.join(CACHE, "*")):  # the clusters of older migrations, after a day
        if other != cached and time.time() - os.path.getmtime(other) > 86400:
            shutil.rmtree(other, ignore_errors=True)


def clone_migrated(test_database: str) -> bool:
    """The test database made from the migrated template; whether it was (else pytest-django migrates one)."""
    template = _state.get("migrated")
    if template is None:
        return False
    import psycopg

    url = os.environ["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{test_database}"')
        conn.execute(f'CREATE DATABASE "{test_database}" TEMPLATE {template}')
    return True


def _start_cluster(bindir: str, home: str, data: str, run_as: dict, port: int | None = None) -> tuple:
    """postgres on the data directory, on a free loopback port (or `port`), once it takes connections."""
    port = port or free_port()
    log = open(os.path.join(home, "postgres.log"), "ab")
    process = subprocess.Popen(
        [os.path.join(bindir, "postgres"), "-D", data, "-p", str(port), "-h", "127.0.0.1", "-k", home]
        + ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        + ["-c", "max_connections=400", "-c", "shared_buffers=64MB"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=home,
        **run_as,
    )
    _state["postgres"] = process
    import psycopg

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(f"host=127.0.0.1 port={port} user=llmgw dbname=postgres", connect_timeout=2):
                return process, port
        except psycopg.OperationalError:
            if process.poll() is not None:
                break
            time.sleep(0.1)
    process.kill()
    with open(os.path.join(home, "postgres.log"), errors="replace") as fh:
        raise pytest.UsageError(f"the tests' PostgreSQL did not start:\n{fh.read()[-2000:]}")


def _stop_cluster() -> None:
    process = _state.pop("postgres", None)
    if process is not None:
        process.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown: end the sessions, stop
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pytest_unconfigure(config):
    process = _state.pop("redis", None)
    if process is not None:
        process.terminate()
        process.wait(timeout=10)
    _stop_cluster()
    home = _state.pop("pg_home", None)
    if home and not os.environ.get("LLMGW_KEEP_TEST_VAR"):
        shutil.rmtree(home, ignore_errors=True)
    var = _state.pop("var", None)
    if var and not os.environ.get("LLMGW_KEEP_TEST_VAR"):
        shutil.rmtree(var, ignore_errors=True)
