"""Applies the versioned CQL migrations in schema/cql/ idempotently (``tocsin db migrate``).

Each file ``NNN_name.cql`` is one version; statements are separated by lines holding only
``;`` and may use ``${keyspace}``. Applied versions are recorded with a checksum in
``<keyspace>.schema_migrations``; a recorded migration whose file has since changed is an
error (migrations are append-only), never re-applied.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from cassandra.cluster import Session

from base.cassandra import make_cluster
from base.clock import now_ms
from base.errors import ConfigError, StoreError
from base.settings import CassandraSettings
from schema import CQL_DIR

log = logging.getLogger("tocsin.schema")

_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.cql$")
_KEYSPACE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]
    checksum: str


def load_migrations(directory: Path = CQL_DIR, *, keyspace: str) -> list[Migration]:
    """Parse every migration file, in version order, with the keyspace substituted."""
    if not _KEYSPACE.match(keyspace):
        raise ConfigError(f"keyspace name {keyspace!r} must match {_KEYSPACE.pattern}")
    found: list[Migration] = []
    for path in sorted(directory.glob("*.cql")):
        match = _NAME.match(path.name)
        if not match:
            raise ConfigError(f"migration file {path.name} must be named NNN_name.cql")
        raw = path.read_text()
        body = Template(raw).substitute(keyspace=keyspace)
        statements: list[str] = []
        current: list[str] = []
        for line in body.splitlines():
            if line.strip() == ";":
                stmt = _strip_comments("\n".join(current))
                if stmt:
                    statements.append(stmt)
                current = []
            else:
                current.append(line)
        tail = _strip_comments("\n".join(current))
        if tail:
            statements.append(tail)
        found.append(
            Migration(
                int(match.group(1)),
                match.group(2),
                tuple(statements),
                hashlib.sha256(raw.encode()).hexdigest()[:16],
            )
        )
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ConfigError(f"duplicate migration versions in {directory}: {versions}")
    return found


def _strip_comments(text: str) -> str:
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("--")]
    return "\n".join(lines).strip()


def migrate(settings: CassandraSettings, *, session: Session | None = None) -> list[str]:
    """Create the keyspace and apply pending migrations; return the names applied."""
    keyspace = settings.keyspace
    migrations = load_migrations(keyspace=keyspace)
    cluster = None
    if session is None:
        cluster = make_cluster(settings)
        session = cluster.connect()
    try:
        session.execute(
            f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = "
            f"{settings.replication_cql()} AND durable_writes = true"
        )
        session.execute(
            f"CREATE TABLE IF NOT EXISTS {keyspace}.schema_migrations ("
            "version int PRIMARY KEY, name text, checksum text, applied_ms bigint)"
        )
        applied = {
            row.version: row.checksum
            for row in session.execute(
                f"SELECT version, checksum FROM {keyspace}.schema_migrations"
            )
        }
        done: list[str] = []
        for m in migrations:
            if m.version in applied:
                if applied[m.version] != m.checksum:
                    raise ConfigError(
                        f"migration {m.version:03d}_{m.name} changed after it was applied "
                        f"(checksum {applied[m.version]} -> {m.checksum}); add a new "
                        "migration instead of editing an applied one"
                    )
                continue
            for stmt in m.statements:
                session.execute(stmt, timeout=60)
            session.execute(
                f"INSERT INTO {keyspace}.schema_migrations (version, name, checksum, applied_ms) "
                "VALUES (%s, %s, %s, %s)",
                (m.version, m.name, m.checksum, now_ms()),
            )
            done.append(f"{m.version:03d}_{m.name}")
            log.info("migration applied", extra={"migration": done[-1], "keyspace": keyspace})
        return done
    except ConfigError:
        raise
    except Exception as exc:
        raise StoreError(f"migrating keyspace {keyspace} failed: {exc}") from exc
    finally:
        if cluster is not None:
            cluster.shutdown()
