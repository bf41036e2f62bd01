"""CommandClient's signing-key cache when Cassandra cannot be reached (no servers needed:
the store address points at a closed port)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from base.settings import Settings
from streams.client import SIGNING_KEY_REFRESH_S, CommandClient


def client_without_cassandra() -> CommandClient:
    base = Settings.from_env({})
    return CommandClient(replace(base, cassandra=replace(base.cassandra, port=1)))


def test_an_expired_key_is_kept_when_the_refresh_cannot_reach_cassandra() -> None:
    client = client_without_cassandra()
    # Read long ago: due for a refresh, which fails; sending goes on with the cached key.
    client._signing_keys["acme"] = (-2 * SIGNING_KEY_REFRESH_S, "cached-secret")
    assert client.signing_key_of("acme") == "cached-secret"
    # ...and the failed refresh is not retried on every command (it counts as a read).
    assert client._signing_keys["acme"][0] > 0


def test_without_a_cached_key_the_failure_is_raised() -> None:
    client = client_without_cassandra()
    with pytest.raises(Exception, match="Unable to connect"):
        client.signing_key_of("acme")
