"""Where per-tenant delivery rates come from: a JSON file, re-read when it changes.

The proxy reads no Cassandra (it keeps delivering while Cassandra is down), so a tenant's
rates cannot come from the tenant table. ``TOCSIN_PROXY_HOST_RPS`` is the default rate per
(tenant, host), and ``TOCSIN_PROXY_HOST_LIMITS_FILE`` names a JSON file (a mounted
ConfigMap, say) overriding it per tenant and per host::

    {"tenant-a": {"rps": 5, "hosts": {"api.example.com": 2, "slow.example.com:8443": 0.5}}}

The file is checked at most every ``CHECK_EVERY_S`` and read again when its inode, time or
size changed. At start a missing or bad file is a ``ConfigError`` (the proxy does not
start); later, a bad version keeps the last good limits with one ERROR log per version,
and a removed file means the default for everyone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from base.errors import ConfigError
from proxy.hostlimits import HostGate, HostLimits, parse_limits

log = logging.getLogger("tocsin.proxy")

CHECK_EVERY_S = 1.0
# The whole file is read into memory.
MAX_FILE_BYTES = 8 * 1024 * 1024


def read_limits(path: Path, default_rps: float) -> HostLimits:
    """The limits in ``path``; ValueError or OSError when it cannot be used."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    return parse_limits(doc, default_rps)


def _version(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or rewritten (a ConfigMap swaps a symlink,
    which ``stat`` follows); None: no file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class LimitsFile:
    def __init__(self, path: str, default_rps: float, gate: HostGate) -> None:
        self.path = Path(path)
        self._default_rps = default_rps
        self._gate = gate
        self._version: tuple[int, int, int] | None = None
        self._checked_s: float | None = None

    def load(self) -> None:
        """The first read, at start: a file that cannot be used stops the proxy."""
        try:
            self._version = _version(self.path)
            if self._version is None:
                raise FileNotFoundError(str(self.path))
            self._gate.set_limits(read_limits(self.path, self._default_rps))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"TOCSIN_PROXY_HOST_LIMITS_FILE {self.path}: {exc}") from exc

    def poll(self, now_s: float) -> bool:
        """Re-read the file if it changed (checked at most every ``CHECK_EVERY_S``); True
        when new limits were taken."""
        if self._checked_s is not None and now_s - self._checked_s < CHECK_EVERY_S:
            return False
        self._checked_s = now_s
        try:
            version = _version(self.path)
        except OSError as exc:
            log.error("cannot stat the host limits file", extra={"error": str(exc)})
            return False
        if version == self._version:
            return False
        self._version = version
        if version is None:
            log.warning(
                "host limits file removed: the default rate applies to every tenant",
                extra={"path": str(self.path)},
            )
            self._gate.set_limits(HostLimits(default_rps=self._default_rps))
            return True
        try:
            limits = read_limits(self.path, self._default_rps)
        except (OSError, ValueError) as exc:
            log.error(
                "host limits file cannot be used; the previous limits stay",
                extra={"path": str(self.path), "error": str(exc)},
            )
            return False
        self._gate.set_limits(limits)
        log.info(
            "host limits file read", extra={"path": str(self.path), "tenants": len(limits.tenants)}
        )
        return True
