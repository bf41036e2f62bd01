"""streams.cql's binder gives the bytes the driver's own ``bind`` gives, and the driver's
errors, for every kind of value a store binds."""

from __future__ import annotations

import pytest
from cassandra.cqltypes import BytesType, Int32Type, LongType, UTF8Type
from cassandra.protocol import ColumnMetadata
from cassandra.query import UNSET_VALUE, PreparedStatement

from streams.cql import _Binder

COLUMNS = [
    ColumnMetadata("ks", "t", "tenant", UTF8Type),
    ColumnMetadata("ks", "t", "schedule_id", UTF8Type),
    ColumnMetadata("ks", "t", "due_ms", LongType),
    ColumnMetadata("ks", "t", "payload", BytesType),
    ColumnMetadata("ks", "t", "[ttl]", Int32Type),
]


def prepared(protocol_version: int = 4) -> PreparedStatement:
    return PreparedStatement(
        COLUMNS, b"id", [0, 1], "INSERT ...", "ks", protocol_version, None, None
    )


@pytest.mark.parametrize(
    "params",
    [
        ["acme", "s1", 1_763_744_400_000, b"\x00{}", 3600],
        ["acme", "s1", UNSET_VALUE, None, 3600],  # unset and null cells
        ["acme", "s1", 5],  # short: the rest unset, as the driver pads it
        ["acmé", "s1", -1, b"", 0],
    ],
)
def test_the_binder_binds_what_the_driver_binds(params: list[object]) -> None:
    stmt = prepared()
    ours = _Binder(stmt).bind(params)
    theirs = stmt.bind(list(params))
    assert ours.values == theirs.values
    assert ours.raw_values == theirs.raw_values
    assert ours.routing_key == theirs.routing_key
    assert ours.prepared_statement is stmt
    assert (ours.keyspace, ours.is_idempotent) == (theirs.keyspace, theirs.is_idempotent)


@pytest.mark.parametrize(
    ("params", "error"),
    [
        (["acme", "s1", "not a number", None, 1], TypeError),  # the driver's message
        (["acme", UNSET_VALUE, 1, None, 1], ValueError),  # unset in the routing key
        (["acme", "s1", 1, None, 1, "one too many"], ValueError),
    ],
)
def test_the_binder_raises_what_the_driver_raises(
    params: list[object], error: type[Exception]
) -> None:
    stmt = prepared()
    with pytest.raises(error) as theirs:
        stmt.bind(list(params))
    with pytest.raises(error) as ours:
        _Binder(stmt).bind(params)
    assert str(ours.value) == str(theirs.value)


def test_a_protocol_without_unset_is_left_to_the_driver() -> None:
    stmt = prepared(protocol_version=3)
    assert not _Binder(stmt).direct
    assert (
        _Binder(stmt).bind(["acme", "s1", 1, b"", 1]).values
        == stmt.bind(["acme", "s1", 1, b"", 1]).values
    )
