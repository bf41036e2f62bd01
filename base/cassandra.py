"""Building a cassandra-driver Cluster from settings (auth, TLS, local DC) in one place."""

from __future__ import annotations

import socket
import ssl

from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
from cassandra.policies import (
    ConstantSpeculativeExecutionPolicy,
    DCAwareRoundRobinPolicy,
    NoSpeculativeExecutionPolicy,
    SpeculativeExecutionPolicy,
    TokenAwarePolicy,
)

from base.settings import CassandraSettings


def make_cluster(
    settings: CassandraSettings,
    *,
    protocol_version: int | None = None,
    profile: dict[str, object] | None = None,
    **overrides: object,
) -> Cluster:
    """A Cluster for these settings; the caller connects and shuts it down.

    ``protocol_version``: None takes ``settings.protocol_version`` (4 by default, settings
    say why; 0 there lets the driver negotiate). ``profile``: more options of the default
    execution profile (consistency, row factory...). ``overrides``: other Cluster
    arguments (e.g. ``connect_timeout``)."""
    profile_options: dict[str, object] = {
        # Token-aware routing sends each prepared statement straight to a replica.
        "load_balancing_policy": TokenAwarePolicy(
            DCAwareRoundRobinPolicy(local_dc=settings.local_dc)
        ),
        "request_timeout": settings.request_timeout_s,
        # Only statements marked idempotent are ever executed speculatively (the driver
        # checks); CassandraSettings says why and when.
        "speculative_execution_policy": speculative_policy(settings),
        **(profile or {}),
    }
    kwargs: dict[str, object] = {
        "contact_points": list(settings.contact_points),
        "port": settings.port,
        "execution_profiles": {EXEC_PROFILE_DEFAULT: ExecutionProfile(**profile_options)},
        "connect_timeout": 5,
        # The driver leaves Nagle's algorithm on, and a request over about 4 KB (here an
        # 11-row batch: every grouped write of the command agent and the ticker) then waits
        # for the server's delayed ACK: 43.6 ms instead of 0.9 ms for a lone 11-row batch;
        # smaller requests are not delayed (make bench-cassandra, BENCHMARKS.md).
        "sockopts": [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        # A hung node is marked down after a few seconds instead of a minute (settings).
        "idle_heartbeat_interval": settings.heartbeat_interval_s,
        "idle_heartbeat_timeout": settings.heartbeat_timeout_s,
    }
    version = settings.protocol_version if protocol_version is None else protocol_version
    if version:
        kwargs["protocol_version"] = version
    if settings.username:
        kwargs["auth_provider"] = PlainTextAuthProvider(settings.username, settings.password or "")
    if settings.ssl_ca_location:
        ctx = ssl.create_default_context(cafile=settings.ssl_ca_location)
        # The driver connects by IP (contact points and peers discovered through gossip)
        # and passes no server name, so the certificate is verified against the CA but not
        # against a host name.
        ctx.check_hostname = False
        kwargs["ssl_context"] = ctx
    kwargs.update(overrides)
    return Cluster(**kwargs)


def speculative_policy(settings: CassandraSettings) -> SpeculativeExecutionPolicy:
    """The speculative execution policy for these settings (none when turned off)."""
    if settings.speculative_executions <= 0:
        return NoSpeculativeExecutionPolicy()
    return ConstantSpeculativeExecutionPolicy(
        delay=max(0, settings.speculative_delay_ms) / 1000,
        max_attempts=settings.speculative_executions,
    )
