"""The delivery proxy's settings, read from ``TOCSIN_PROXY_*`` variables.

``ProxySettings.from_env`` takes a plain mapping (never ``os.environ`` itself), so the CLI
stays the one place that reads the environment and tests build settings from dicts. Units
are in the names. This module must never do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from base.errors import ConfigError
from base.settings import _bool, _float, _get, _int, _port
from proxy.breaker import BreakerPolicy
from proxy.retry import DEFAULT_MAX_RETRY_AGE_S, RetryPolicy

Mode = Literal["fires", "generic"]


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    # fires: the fires topic, each trigger names its callback. generic: any topic(s) to one
    # endpoint with the MPS contract.
    mode: Mode = "fires"
    source_topic: str = ""  # generic mode: comma-separated topics; fires mode: default fires
    endpoint_url: str = ""  # generic mode only
    group_id: str = "tocsin-proxy"
    dead_letter_topic: str = ""  # default: the catalog's dead-letters topic
    deliveries_topic: str = ""  # fires mode; default: the catalog's deliveries topic
    retry_topic: str = ""  # parked messages (proxy/parking.py); default: the catalog's

    max_pending_messages: int = 10_000
    max_pending_bytes: int = 64 * 1024 * 1024
    resume_ratio: float = 0.5  # resume reading when held count and bytes fall under this
    concurrency: int = 100
    per_host_concurrency: int = 100
    request_timeout_s: float = 10.0  # generic mode; fires mode uses each callback's own
    connect_timeout_s: float = 5.0
    body_snippet_bytes: int = 512

    retry_base_delay_s: float = 0.2
    retry_max_delay_s: float = 60.0
    max_retry_age_s: float = DEFAULT_MAX_RETRY_AGE_S  # then dead letter; 0: no limit
    retries_6xx: int = 3
    poison_timeouts: int = 5
    # A message still failing after this long in memory is parked in the retry topic.
    park_after_s: float = 10.0
    # fires mode: a tenant holding this fraction of either pending bound has its further
    # messages parked instead of held, so it cannot make the reader pause for everyone.
    tenant_pending_share: float = 0.25

    commit_interval_s: float = 5.0
    shutdown_timeout_s: float = 20.0
    revoke_timeout_s: float = 5.0  # wait this long for in-flight attempts of a revoked partition
    max_poll_interval_s: float = 300.0
    session_timeout_s: float = 10.0
    metrics_port: int = 9465  # 0: no metrics HTTP server
    # fires mode: callbacks to loopback/private/link-local/reserved addresses are refused
    # (checked on the resolved address, see proxy/ssrf.py) unless this is set (from
    # TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS, by default TOCSIN_ALLOW_PRIVATE_TARGETS).
    allow_private_targets: bool = False
    # fires mode: one tenant may hold at most this fraction of `concurrency` writers.
    tenant_share: float = 0.5
    # fires mode: JSON file, tenant -> [secret, ...] newest first, whose secrets sign each
    # HTTP callback (proxy/callback_signing.py); re-read when it changes. Empty: unsigned.
    signing_secrets_file: str = ""
    # fires mode: a tenant with no secret in that file gets its HTTP callbacks dead-lettered
    # instead of sent unsigned.
    require_signature: bool = False
    # Outbound load per (tenant, host), proxy/hostlimits.py: requests per second by default
    # (0: no limit), and a JSON file of per-tenant and per-host rates, re-read on change.
    host_rps: float = 0.0
    host_limits_file: str = ""
    # A host's circuit breaker opens after this many consecutive failures (0: never), or
    # when breaker_failure_ratio of its last breaker_window attempts failed; it stays open
    # breaker_open_s, doubled after each failed probe up to breaker_open_max_s.
    breaker_failures: int = 5
    breaker_failure_ratio: float = 0.5
    breaker_window: int = 20
    breaker_open_s: float = 1.0
    breaker_open_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in ("fires", "generic"):
            raise ConfigError(f"TOCSIN_PROXY_MODE must be fires or generic, got {self.mode!r}")
        if self.mode == "generic" and (not self.source_topic or not self.endpoint_url):
            raise ConfigError(
                "generic mode needs TOCSIN_PROXY_SOURCE_TOPIC and TOCSIN_PROXY_ENDPOINT_URL"
            )
        positive = {
            "max_pending_messages": self.max_pending_messages,
            "max_pending_bytes": self.max_pending_bytes,
            "concurrency": self.concurrency,
            "per_host_concurrency": self.per_host_concurrency,
            "commit_interval_s": self.commit_interval_s,
            "request_timeout_s": self.request_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"TOCSIN_PROXY_{name.upper()} must be positive, got {value}")
        if self.park_after_s < 0:
            raise ConfigError("TOCSIN_PROXY_PARK_AFTER_S must be >= 0")
        if not 0 < self.tenant_pending_share <= 1:
            raise ConfigError("TOCSIN_PROXY_TENANT_PENDING_SHARE must be in (0, 1]")
        if not 0 < self.tenant_share <= 1:
            raise ConfigError("TOCSIN_PROXY_TENANT_SHARE must be in (0, 1]")
        if not 0 <= self.resume_ratio < 1:
            raise ConfigError("TOCSIN_PROXY_RESUME_RATIO must be in [0, 1)")
        self._check_signing()
        try:
            self.retry_policy()
        except ValueError as exc:
            raise ConfigError(f"bad proxy retry settings: {exc}") from exc
        self._check_outbound()

    def _check_outbound(self) -> None:
        """The host rate limit and breaker settings."""
        if not self.host_rps >= 0:
            raise ConfigError("TOCSIN_PROXY_HOST_RPS must be >= 0")
        try:
            self.breaker_policy()
        except ValueError as exc:
            raise ConfigError(f"bad proxy breaker settings: {exc}") from exc

    def _check_signing(self) -> None:
        if self.require_signature and not self.signing_secrets_file:
            raise ConfigError(
                "TOCSIN_PROXY_REQUIRE_SIGNATURE needs TOCSIN_PROXY_SIGNING_SECRETS_FILE"
            )
        if self.signing_secrets_file and self.mode != "fires":
            # Generic mode has no tenant and no trigger id to sign for.
            raise ConfigError("TOCSIN_PROXY_SIGNING_SECRETS_FILE applies to fires mode only")

    def source_topics(self, default_fires: str) -> list[str]:
        if self.source_topic:
            return [t.strip() for t in self.source_topic.split(",") if t.strip()]
        return [default_fires]

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            base_delay_s=self.retry_base_delay_s,
            max_delay_s=self.retry_max_delay_s,
            max_retry_age_s=self.max_retry_age_s,
            retries_6xx=self.retries_6xx,
            poison_timeouts=self.poison_timeouts,
        )

    def breaker_policy(self) -> BreakerPolicy:
        return BreakerPolicy(
            failures=self.breaker_failures,
            failure_ratio=self.breaker_failure_ratio,
            window=self.breaker_window,
            open_s=self.breaker_open_s,
            open_max_s=self.breaker_open_max_s,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProxySettings:
        d = cls()  # the defaults (fires mode, which needs nothing else)
        mode = _get(env, "PROXY_MODE", d.mode)
        if mode not in ("fires", "generic"):
            raise ConfigError(f"TOCSIN_PROXY_MODE must be fires or generic, got {mode!r}")
        return cls(
            mode=mode,  # type: ignore[arg-type]  # checked just above
            source_topic=_get(env, "PROXY_SOURCE_TOPIC", d.source_topic),
            endpoint_url=_get(env, "PROXY_ENDPOINT_URL", d.endpoint_url),
            group_id=_get(env, "PROXY_GROUP_ID", d.group_id),
            dead_letter_topic=_get(env, "PROXY_DEAD_LETTER_TOPIC", d.dead_letter_topic),
            deliveries_topic=_get(env, "PROXY_DELIVERIES_TOPIC", d.deliveries_topic),
            retry_topic=_get(env, "PROXY_RETRY_TOPIC", d.retry_topic),
            max_pending_messages=_int(env, "PROXY_MAX_PENDING_MESSAGES", d.max_pending_messages),
            max_pending_bytes=_int(env, "PROXY_MAX_PENDING_BYTES", d.max_pending_bytes),
            resume_ratio=_float(env, "PROXY_RESUME_RATIO", d.resume_ratio),
            concurrency=_int(env, "PROXY_CONCURRENCY", d.concurrency),
            per_host_concurrency=_int(env, "PROXY_PER_HOST_CONCURRENCY", d.per_host_concurrency),
            request_timeout_s=_float(env, "PROXY_REQUEST_TIMEOUT_S", d.request_timeout_s),
            connect_timeout_s=_float(env, "PROXY_CONNECT_TIMEOUT_S", d.connect_timeout_s),
            body_snippet_bytes=_int(env, "PROXY_BODY_SNIPPET_BYTES", d.body_snippet_bytes),
            retry_base_delay_s=_float(env, "PROXY_RETRY_BASE_DELAY_S", d.retry_base_delay_s),
            retry_max_delay_s=_float(env, "PROXY_RETRY_MAX_DELAY_S", d.retry_max_delay_s),
            max_retry_age_s=_float(env, "PROXY_MAX_RETRY_AGE_S", d.max_retry_age_s),
            retries_6xx=_int(env, "PROXY_RETRIES_6XX", d.retries_6xx),
            poison_timeouts=_int(env, "PROXY_POISON_TIMEOUTS", d.poison_timeouts),
            park_after_s=_float(env, "PROXY_PARK_AFTER_S", d.park_after_s),
            tenant_pending_share=_float(env, "PROXY_TENANT_PENDING_SHARE", d.tenant_pending_share),
            commit_interval_s=_float(env, "PROXY_COMMIT_INTERVAL_S", d.commit_interval_s),
            shutdown_timeout_s=_float(env, "PROXY_SHUTDOWN_TIMEOUT_S", d.shutdown_timeout_s),
            revoke_timeout_s=_float(env, "PROXY_REVOKE_TIMEOUT_S", d.revoke_timeout_s),
            max_poll_interval_s=_float(env, "PROXY_MAX_POLL_INTERVAL_S", d.max_poll_interval_s),
            session_timeout_s=_float(env, "PROXY_SESSION_TIMEOUT_S", d.session_timeout_s),
            metrics_port=_port(env, "PROXY_METRICS_PORT", d.metrics_port, zero_is_off=True),
            # One deployment-wide switch by default, so the worker's create-time check and
            # the proxy's delivery-time guard agree unless the proxy is told otherwise.
            allow_private_targets=_bool(
                env, "PROXY_ALLOW_PRIVATE_TARGETS", _bool(env, "ALLOW_PRIVATE_TARGETS", False)
            ),
            tenant_share=_float(env, "PROXY_TENANT_SHARE", d.tenant_share),
            signing_secrets_file=_get(env, "PROXY_SIGNING_SECRETS_FILE", d.signing_secrets_file),
            require_signature=_bool(env, "PROXY_REQUIRE_SIGNATURE", d.require_signature),
            host_rps=_float(env, "PROXY_HOST_RPS", d.host_rps),
            host_limits_file=_get(env, "PROXY_HOST_LIMITS_FILE", d.host_limits_file),
            breaker_failures=_int(env, "PROXY_BREAKER_FAILURES", d.breaker_failures),
            breaker_failure_ratio=_float(
                env, "PROXY_BREAKER_FAILURE_RATIO", d.breaker_failure_ratio
            ),
            breaker_window=_int(env, "PROXY_BREAKER_WINDOW", d.breaker_window),
            breaker_open_s=_float(env, "PROXY_BREAKER_OPEN_S", d.breaker_open_s),
            breaker_open_max_s=_float(env, "PROXY_BREAKER_OPEN_MAX_S", d.breaker_open_max_s),
        )
