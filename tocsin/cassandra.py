"""Building a cassandra-driver Cluster from settings (auth, TLS, local DC) in one place."""

from __future__ import annotations

import ssl
from typing import Any

from tocsin.settings import CassandraSettings


def make_cluster(settings: CassandraSettings, **overrides: Any) -> Any:
    """A Cluster for these settings; the caller connects and shuts it down."""
    from cassandra.auth import PlainTextAuthProvider
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import DCAwareRoundRobinPolicy, TokenAwarePolicy

    profile = ExecutionProfile(
        load_balancing_policy=TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=settings.local_dc)),
        request_timeout=settings.request_timeout_s,
    )
    kwargs: dict[str, Any] = {
        "contact_points": list(settings.contact_points),
        "port": settings.port,
        "protocol_version": 5,
        "execution_profiles": {EXEC_PROFILE_DEFAULT: profile},
        "connect_timeout": 5,
    }
    if settings.username:
        kwargs["auth_provider"] = PlainTextAuthProvider(settings.username, settings.password or "")
    if settings.ssl_ca_location:
        ctx = ssl.create_default_context(cafile=settings.ssl_ca_location)
        # The driver connects by IP and passes no server name, so the certificate is
        # verified against the CA but not against a host name.
        ctx.check_hostname = False
        kwargs["ssl_context"] = ctx
    kwargs.update(overrides)
    return Cluster(**kwargs)
