"""Session fixtures on the real local stack.

Every run gets its own topic prefix and keyspace, so runs (and leftover state) never
collide. Integration tests need the stack: locally a stack that cannot start skips them;
in CI (CI=true) it fails the run, because a skipped suite proves nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from base.settings import Settings

RUN_ID = uuid.uuid4().hex[:8]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    integration_dir = Path(__file__).parent / "integration"
    for item in items:
        if integration_dir in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def run_id() -> str:
    return RUN_ID


@pytest.fixture(scope="session")
def settings() -> Settings:
    env = dict(os.environ)
    env["TOCSIN_TOPIC_PREFIX"] = f"test.{RUN_ID}."
    env["TOCSIN_CASSANDRA_KEYSPACE"] = f"test_{RUN_ID}"
    env.setdefault("TOCSIN_COMMAND_PARTITIONS", "4")
    env.setdefault("TOCSIN_FIRE_PARTITIONS", "4")
    return Settings.from_env(env)


@pytest.fixture(scope="session")
def stack(settings: Settings) -> Settings:
    """The running local stack (started here if needed)."""
    from base.errors import InfraError
    from tocsin.infra import Stack

    local = Stack(settings)
    try:
        if not all(s.ready for s in local.status()):
            local.up()
    except InfraError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the local stack could not start in CI: {exc}")
        pytest.skip(f"local stack unavailable: {exc}")
    return settings


@pytest.fixture(scope="session")
def topics(stack: Settings) -> Iterator[Settings]:
    """The catalog's topics, created under this run's prefix; deleted at the end."""
    from confluent_kafka.admin import AdminClient

    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    specs = catalog(stack.topics).all()
    ensure_topics(stack.kafka, specs)
    yield stack
    admin = AdminClient(stack.kafka.librdkafka())
    names = [n for n in admin.list_topics(timeout=10).topics if n.startswith(stack.topics.prefix)]
    if names:
        for fut in admin.delete_topics(names, operation_timeout=30).values():
            fut.result(timeout=30)


@pytest.fixture(scope="session")
def keyspace(stack: Settings) -> Iterator[Settings]:
    """This run's keyspace, migrated; dropped at the end."""
    from base.cassandra import make_cluster
    from schema.migrate import migrate

    migrate(stack.cassandra)
    yield stack
    cluster = make_cluster(stack.cassandra)
    try:
        cluster.connect().execute(f"DROP KEYSPACE IF EXISTS {stack.cassandra.keyspace}", timeout=60)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def real_stack(topics: Settings, keyspace: Settings) -> Settings:
    """Topics and keyspace ready: the whole real stack for this run."""
    return topics
