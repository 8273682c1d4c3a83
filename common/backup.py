"""The control plane's state in one file, and back (`manage.py backup`, `manage.py restore`; docs/running.md).

What is state: the database (every node's token hash, every replica the fleet runs and
where, the catalog, people and keys) and, when DJANGO_SECRET_KEY is not set, the key this
host made under LLMGW_VAR (sessions and the Redis passwords of LLMGW_REDIS_ACL are made from
it). The mirror is files, as big as the models: copied with the operator's own tools, never
into the archive. Redis holds only what the next heartbeats say again.

The archive is a tar file, mode 0600, of `manifest.json` (what it holds, when, and each
member's SHA-256), the database (pg_dump's custom format, or SQLite's online backup) and the
key file if there is one. A restore checks the whole archive before it changes anything,
refuses a database that holds tables unless --force, and restores in one transaction
(pg_restore --single-transaction; SQLite: a file renamed into place): never half.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.db import connection, connections
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

FORMAT = "llmgw-backup"
VERSION = 1
MANIFEST = "manifest.json"
PG_DUMP = "database.pgdump"
SQLITE_DUMP = "database.sqlite3"
SECRET_KEY_FILE = "secret_key"
# Ids handed out after the backup are still named by what runs (a node's engine for replica 42)
# and by Redis: the restored database moves every id sequence on by this, so none is given again.
IDS_SKIPPED = 1_000_000


class BackupError(Exception):
    """Said to the operator as it is: one sentence, nothing changed."""


@dataclass
class Restored:
    database: str
    made_at: str
    notes: list[str] = field(default_factory=list)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_fingerprint(key: str) -> str:
    """Which SECRET_KEY a backup was taken with, without the key."""
    return hmac.new(key.encode(), b"llmgw-backup-key-fingerprint", hashlib.sha256).hexdigest()[:16]


def _pg_env() -> dict[str, str]:
    db = settings.DATABASES["default"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    for name, value in (("PGHOST", db.get("HOST")), ("PGPORT", db.get("PORT")), ("PGUSER", db.get("USER"))):
        if value:
            env[name] = str(value)
    if db.get("PASSWORD"):
        env["PGPASSWORD"] = db["PASSWORD"]
    env["PGDATABASE"] = db["NAME"]
    return env


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, env=_pg_env(), capture_output=True, text=True, timeout=3600)
    except FileNotFoundError:
        raise BackupError(
            f"{argv[0]} is not installed on this host; {what} needs it (apt install postgresql-client)."
        ) from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise BackupError(f"{argv[0]} failed, so {what} did not happen: {said}")


def _dump_database(into: Path) -> str:
    """The database into `into`; returns the member's name."""
    if connection.vendor == "postgresql":
        target = into / PG_DUMP
        _run(["pg_dump", "--format=custom", "--no-owner", "--no-privileges", "--file", str(target)], "the backup")
        return PG_DUMP
    if connection.vendor == "sqlite":
        target = into / SQLITE_DUMP
        source = sqlite3.connect(settings.DATABASES["default"]["NAME"])
        copy = sqlite3.connect(target)
        try:
            # The online backup API: a consistent copy while the control plane keeps writing.
            source.backup(copy)
        finally:
            copy.close()
            source.close()
        return SQLITE_DUMP
    raise BackupError(f"llmgw backs up PostgreSQL and SQLite, not {connection.vendor}.")


def _latest_migrations() -> dict[str, str]:
    latest: dict[str, str] = {}
    for app, name in MigrationRecorder(connection).migration_qs.order_by("app", "name").values_list("app", "name"):
        latest[app] = name
    return latest


def make_backup(path: Path, now: datetime | None = None) -> dict:
    """Write the archive at `path` (mode 0600, whole or not at all); returns its manifest."""
    path = Path(path)
    if path.exists():
        raise BackupError(f"{path} exists already; a backup never overwrites a file. Name a new one.")
    if not path.parent.is_dir():
        raise BackupError(f"{path.parent} is not a directory; the backup is written there.")
    with tempfile.TemporaryDirectory(prefix=".llmgw-backup-", dir=path.parent) as work:
        work_dir = Path(work)
        members = {_dump_database(work_dir): None}
        key_file = settings.VAR_DIR / "secret_key"
        if getattr(settings, "SECRET_KEY_MADE_HERE", False) and key_file.exists():
            shutil.copyfile(key_file, work_dir / SECRET_KEY_FILE)
            members[SECRET_KEY_FILE] = None
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "made_at": (now or datetime.now(UTC)).isoformat(timespec="seconds"),
            "database": connection.vendor,
            "migrations": _latest_migrations(),
            "secret_key": "in the archive"
            if SECRET_KEY_FILE in members
            else "DJANGO_SECRET_KEY, in control.env: not in the archive; keep it with the backup",
            "secret_key_fingerprint": key_fingerprint(settings.SECRET_KEY),
            "not_in_the_archive": {
                "mirror": f"the mirror's files under {settings.MIRROR_ROOT}: copy them with rsync or the like",
                "redis": "what nodes say again in their next heartbeats and reports",
            },
            "members": {name: _sha256((work_dir / name).read_bytes()) for name in members},
        }
        partial = work_dir / "archive.tar"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w") as archive:
            raw = json.dumps(manifest, indent=2).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mode, info.mtime = len(raw), 0o600, int(time.time())
            archive.addfile(info, io.BytesIO(raw))
            for name in members:
                archive.add(work_dir / name, arcname=name, recursive=False, filter=_private)
        # A link, not a rename: a file that appeared at `path` meanwhile is never replaced.
        try:
            os.link(partial, path)
        except FileExistsError:
            raise BackupError(f"{path} appeared while the backup was written; it was left as it is.") from None
    return manifest


def _private(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mode, info.uid, info.gid, info.uname, info.gname = 0o600, 0, 0, "", ""
    return info


def read_archive(path: Path, into: Path) -> dict:
    """Check the whole archive and unpack its members into `into`; its manifest, or a sentence why not."""
    path = Path(path)
    if not path.is_file():
        raise BackupError(f"{path} is not a file; name the archive `manage.py backup` wrote.")
    try:
        with tarfile.open(path, mode="r:") as archive:
            names = archive.getnames()
            if MANIFEST not in names:
                raise BackupError(f"{path} is a tar file but not an llmgw backup: it has no {MANIFEST}.")
            manifest = json.loads(archive.extractfile(MANIFEST).read())
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise BackupError(f"{path} is not an llmgw backup: its {MANIFEST} does not say {FORMAT}.")
            if manifest.get("version") != VERSION:
                raise BackupError(
                    f"{path} is a backup of format {manifest.get('version')!r}; this llmgw reads format {VERSION}."
                )
            members = manifest.get("members")
            if not isinstance(members, dict) or not members:
                raise BackupError(f"{path}'s manifest lists no members; the archive is damaged.")
            for name, digest in members.items():
                if name not in (PG_DUMP, SQLITE_DUMP, SECRET_KEY_FILE):
                    raise BackupError(f"{path}'s manifest lists {name!r}, which no llmgw backup holds.")
                if name not in names:
                    raise BackupError(f"{path} is missing {name}, which its manifest lists; the archive is damaged.")
                data = archive.extractfile(name).read()
                if _sha256(data) != digest:
                    raise BackupError(
                        f"{path}'s {name} does not match its manifest's SHA-256: the archive is damaged; "
                        "nothing was changed."
                    )
                target = into / name
                target.touch(mode=0o600)
                target.write_bytes(data)
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise BackupError(
            f"{path} cannot be read as an llmgw backup ({error}); the archive is damaged or another file."
        ) from None
    return manifest


def _tables() -> list[str]:
    return connection.introspection.table_names()


def restore_backup(path: Path, force: bool = False) -> Restored:
    """Restore the archive into this control plane's database, whole or not at all."""
    with tempfile.TemporaryDirectory(prefix="llmgw-restore-") as work:
        work_dir = Path(work)
        manifest = read_archive(path, work_dir)
        if manifest.get("database") != connection.vendor:
            raise BackupError(
                f"{path} holds a {manifest.get('database')} database and this control plane's DATABASE_URL "
                f"names {connection.vendor}; restore it into a control plane of the same kind."
            )
        tables = _tables()
        if tables and not force:
            raise BackupError(
                f"The database already holds {len(tables)} tables; a restore goes into an empty one "
                "(createdb a new one and point DATABASE_URL at it), or pass --force to replace what it holds."
            )
        if connection.vendor == "postgresql":
            _restore_postgresql(work_dir / PG_DUMP, clean=bool(tables))
        else:
            _restore_sqlite(work_dir / SQLITE_DUMP)
        # After the database, which is the part that may refuse: a key of a database that was not restored is no use.
        notes = _restore_key(work_dir, manifest)
        _skip_ids()
        missing = _migrations_behind()
        if missing:
            notes.append(f"The backup is older than this llmgw's code: run `manage.py migrate` ({missing}).")
        return Restored(database=connection.vendor, made_at=str(manifest.get("made_at")), notes=notes)


def _restore_key(work_dir: Path, manifest: dict) -> list[str]:
    """The backup's key file into LLMGW_VAR; a key this host made meanwhile is of a database that was empty."""
    notes = []
    key_file = settings.VAR_DIR / "secret_key"
    kept = work_dir / SECRET_KEY_FILE
    if kept.exists():
        key = kept.read_text().strip()
        settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
        partial = settings.VAR_DIR / f".secret_key.restore.{os.getpid()}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(key)
        os.replace(partial, key_file)
        if settings.SECRET_KEY != key:
            notes.append(f"{key_file} holds the backup's key now: restart every control-plane process of this host.")
    elif manifest.get("secret_key_fingerprint") != key_fingerprint(settings.SECRET_KEY):
        notes.append(
            "This control plane's DJANGO_SECRET_KEY is not the one the backup was taken with: sessions end, "
            "and with LLMGW_REDIS_ACL the Redis passwords made from it change (`manage.py redis_acl`)."
        )
    return notes


def _restore_postgresql(dump: Path, clean: bool) -> None:
    for conn in connections.all():
        conn.close()
    argv = ["pg_restore", "--single-transaction", "--exit-on-error", "--no-owner", "--no-privileges"]
    if clean:
        argv += ["--clean", "--if-exists"]
    db = settings.DATABASES["default"]["NAME"]
    _run([*argv, "--dbname", db, str(dump)], "the restore (one transaction: nothing was changed)")


def _restore_sqlite(dump: Path) -> None:
    target = Path(settings.DATABASES["default"]["NAME"])
    for conn in connections.all():
        conn.close()
    partial = target.with_name(f".{target.name}.restore.{os.getpid()}")
    shutil.copyfile(dump, partial)
    # One rename: the old file or the whole new one, never a mix. SQLite's side files belong to the old one.
    os.replace(partial, target)
    for side in ("-wal", "-shm", "-journal"):
        target.with_name(target.name + side).unlink(missing_ok=True)


def _skip_ids() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT schemaname, sequencename, coalesce(last_value, 0) FROM pg_sequences "
                "WHERE schemaname = current_schema()"
            )
            for schema, name, last in cursor.fetchall():
                sequence = connection.ops.quote_name(schema) + "." + connection.ops.quote_name(name)
                cursor.execute("SELECT setval(%s, %s)", [sequence, last + IDS_SKIPPED])
        elif "sqlite_sequence" in _tables():
            cursor.execute("UPDATE sqlite_sequence SET seq = seq + %s", [IDS_SKIPPED])


def _migrations_behind() -> str:
    """The code's latest migrations the restored database has not had, in a phrase; "" when none."""
    loader = MigrationLoader(connection, ignore_no_migrations=True)
    return ", ".join(
        f"{app} {name}"
        for app, name in sorted(loader.graph.leaf_nodes())
        if (app, name) not in loader.applied_migrations
    )
