"""The one error hierarchy of Tocsin.

    TocsinError                      root; ``retriable`` says whether trying again may help
    +-- ConfigError                  a setting is missing or malformed
    +-- InfraError                   the local stack cannot be resolved, started or stopped
    +-- TopicMismatchError           an existing topic disagrees with the catalog
    +-- StoreError                   Cassandra failed (retriable: timeouts, unavailable)
    +-- KafkaError                   Kafka failed (retriable per librdkafka's verdict)
    +-- CommandRejected              a command broke the wire contract; carries a ``code``
    +-- ApiError (api.views)         an HTTP answer: status, code, message (retriable by status)
    +-- TenantExists, TenantNotFound, RotationConflict (streams.tenant_admin)

Third-party errors are translated at the boundary with ``raise ... from exc`` so callers
only ever catch these.
"""

from __future__ import annotations


class TocsinError(Exception):
    """Raised for every failure Tocsin knows how to describe."""

    retriable: bool = False


class ConfigError(TocsinError):
    """Raised when a setting from the environment is missing or malformed."""


class InfraError(TocsinError):
    """Raised when the local Kafka or Cassandra cannot be resolved, started or stopped."""


class TopicMismatchError(TocsinError):
    """Raised when an existing topic disagrees with the catalog (e.g. partition count)."""


class StoreError(TocsinError):
    """Raised when a Cassandra operation fails."""

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class KafkaError(TocsinError):
    """Raised when a Kafka operation fails."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class CommandRejected(TocsinError):
    """Raised when a command breaks the wire contract.

    ``code`` is machine-readable (see topics.codes); the message is for humans.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
