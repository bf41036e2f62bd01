"""What the API does, independent of HTTP: authentication, tenants, schedule commands over
Kafka, reads from Cassandra. The native routes (api/server.py) and the go-scheduler facade
(api/goscheduler.py) are two thin HTTP shapes over this one service."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, overload

import orjson

from api.bridge import CommandBridge, Expected, ResultDoc, new_reply_nonce
from api.views import (
    BULK_TOGGLES,
    ApiError,
    cancel_command,
    decode_cursor,
    effective_state,
    encode_cursor,
    http_status,
    matches,
    simple_command,
)
from base.clock import now_ms
from base.errors import CommandRejected, KafkaError, StoreError, TocsinError
from base.settings import Settings
from streams.cache import TtlCache
from streams.commands import ADMITTED_REFUSED, TenantCache
from streams.decisions import check_tenant_limits, own_topics
from streams.model import ScheduleEvent, ScheduleRow, ScheduleState, trigger_for
from streams.ports import CqlRow
from streams.refusals import COMMAND_REFUSED
from streams.store import Store
from streams.tenant_admin import RegisteredTenant, TenantExists, issue_key, register_tenant
from streams.tenants import AdmissionQuota, TenantConfig, check_api_key, split_api_key
from topics.admission import admissible, fresh, keys_of, stamp
from topics.codec import encode_trigger, trigger_headers
from topics.codes import Code
from topics.fields import check_text
from topics.models import CreateCommand
from topics.signing import sign_headers
from topics.validation import Limits, decode_command

log = logging.getLogger("tocsin.api")

MAX_BULK = 10_000
# A bulk pause/resume reads at most this many index rows (listing-index entries plus
# recurring ids) per request, whatever it selects: a window of mostly other states or
# other prefixes would otherwise be read whole before the limit applies. Past it the
# answer is ``truncated`` with a ``next_cursor`` to go on from.
MAX_BULK_SCAN_ROWS = 50_000
_SCAN_PAGE = 500
# The cursor of a scan that reached the recurring schedules: (this, last id examined).
_RECURRING = -1
# Rows of one bulk request in flight at once.
BULK_CONCURRENCY = 200

T = TypeVar("T")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (by API key) or the admin."""

    tenant: str | None
    admin: bool = False
    key_id: str | None = None

    def require_tenant(self) -> str:
        if self.tenant is None:
            raise ApiError(
                403,
                "tenant_key_required",
                "schedule endpoints need a tenant API key, not the admin key",
            )
        return self.tenant

    def require_admin(self) -> None:
        if not self.admin:
            raise ApiError(403, "admin_required", "this endpoint needs the admin key")


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        sched = settings.scheduler
        self.limits = Limits.from_settings(sched)
        self.store = Store(settings.cassandra, retention_s=sched.fired_retention_s)
        self.bridge = CommandBridge(settings)
        ttl = settings.api.tenant_cache_ttl_s
        self.tenants = TenantCache(self.store, ttl_s=ttl)
        # API key rows by key id (None: no such key, re-read sooner), one read in flight.
        self._keys: TtlCache[str, CqlRow | None] = TtlCache(
            self.store.get_api_key, ttl_s=lambda row: ttl if row else 1.0
        )
        self.timeout_s = settings.api.request_timeout_s
        # Admission (topics.admission): with a key, a synchronous one-shot create whose id
        # the API generated is answered at Kafka's acknowledgement, once this API has run
        # every check its worker would, this instance's share of the create quota included.
        adm = settings.admission
        self.admission = keys_of(adm.current, adm.previous)
        self.admission_quota = AdmissionQuota(adm.api_instances)
        self.internal_topics = own_topics(self.bridge.catalog.command_results.name)
        self.started = False

    async def start(self) -> None:
        await self.store.connect()
        await self.bridge.start()
        self.started = True

    async def close(self) -> None:
        self.started = False
        await self.bridge.close()
        await self.store.close()

    async def ready(self) -> dict[str, bool]:
        checks = {"kafka": self.bridge.ready, "cassandra": False}
        try:
            await self.store.get_tenant("__readiness_probe__")
            checks["cassandra"] = True
        except StoreError:
            pass
        return checks

    # -- authentication --------------------------------------------------------------------

    async def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise ApiError(
                401,
                "unauthenticated",
                "send an API key: 'Authorization: Bearer <key>' or 'X-Api-Key'",
            )
        admin = self.settings.api.admin_key
        if admin and hmac.compare_digest(token.encode(), admin.encode()):
            return Principal(tenant=None, admin=True)
        parts = split_api_key(token)
        if parts is None:
            raise ApiError(401, "unauthenticated", "the API key is malformed or unknown")
        key_id, secret = parts
        row = await self._key_row(key_id)
        if (
            row is None
            or row.get("revoked")
            or not check_api_key(secret, salt=row["salt"], expected=row["hash"])
        ):
            raise ApiError(401, "unauthenticated", "the API key is malformed or unknown")
        tenant = row["tenant"]
        trow = await self.tenants.get(tenant)
        if trow is None:
            raise ApiError(401, "unauthenticated", "the API key's tenant no longer exists")
        if not trow.get("active"):
            raise ApiError(403, "inactive_tenant", f"tenant {tenant!r} is deactivated")
        return Principal(tenant=tenant, key_id=key_id)

    async def _key_row(self, key_id: str) -> CqlRow | None:
        return await self._keys.get(key_id)

    # -- tenants ---------------------------------------------------------------------------

    async def register_tenant(
        self, name: object, config: object, *, active: bool = True
    ) -> RegisteredTenant:
        """Register a tenant; ``config`` as a request gives it (a JSON object, or empty for
        the defaults). Returns its keys (once)."""
        cfg = self._config(config or {})
        try:
            created = await register_tenant(self.store, name, cfg, active=active)
        except ValueError as exc:
            raise ApiError(400, "invalid_field", str(exc)) from None
        except TenantExists as exc:
            raise ApiError(409, "tenant_exists", str(exc)) from None
        self.tenants.invalidate(created["tenant"])
        return created

    async def new_key(self, tenant: str) -> dict[str, str]:
        return await issue_key(self.store, tenant)

    async def revoke_key(self, tenant: str, key_id: str) -> None:
        row = await self.store.get_api_key(key_id)
        if row is None or row["tenant"] != tenant:
            raise ApiError(404, "not_found", f"no key {key_id!r} for tenant {tenant!r}")
        await self.store.revoke_api_key(key_id)
        self._keys.invalidate(key_id)

    async def get_tenant(self, name: str) -> CqlRow:
        row = await self.store.get_tenant(name)
        if row is None:
            raise ApiError(404, "not_found", f"no tenant {name!r}")
        return row

    async def update_tenant(
        self, name: str, *, config: dict[str, object] | None, active: bool | None
    ) -> CqlRow:
        row = await self.get_tenant(name)
        current = TenantConfig.from_json(row.get("config"))
        cfg = current
        if config is not None:
            try:
                cfg = current.merged(config)
            except ValueError as exc:
                raise ApiError(400, "invalid_config", str(exc)) from None
        await self.store.put_tenant(
            name, active=active, created_ms=None, config=cfg.to_json(), updated_ms=now_ms()
        )
        self.tenants.invalidate(name)
        return await self.get_tenant(name)

    async def list_tenants(self) -> list[CqlRow]:
        return sorted(await self.store.list_tenants(), key=lambda r: r["tenant"])

    @staticmethod
    def _config(config: object) -> TenantConfig:
        try:
            return TenantConfig.from_dict(config)
        except ValueError as exc:
            raise ApiError(400, "invalid_config", str(exc)) from None

    # -- commands --------------------------------------------------------------------------

    @overload
    async def send(
        self,
        command: dict[str, object],
        *,
        wait: Literal[True],
        timeout_s: float | None = None,
        admit: bool = False,
    ) -> ResultDoc: ...

    @overload
    async def send(
        self,
        command: dict[str, object],
        *,
        wait: Literal[False],
        timeout_s: float | None = None,
        admit: bool = False,
    ) -> None: ...

    async def send(
        self,
        command: dict[str, object],
        *,
        wait: bool,
        timeout_s: float | None = None,
        admit: bool = False,
    ) -> ResultDoc | None:
        """Validate locally (fast 4xx), sign with the tenant's key, produce; with ``wait``
        the command's result, else None once Kafka has it. Raises ApiError(504) when no
        result arrives in time.

        ``admit``: the caller generated the schedule id (so no store but this create's can
        hold it); with an admission key, a one-shot create is then admitted here and
        answered at Kafka's acknowledgement (``_admit``)."""
        if admit and wait and self.admission.enabled and _one_shot_create(command):
            return await self._admit(command, timeout_s)
        tenant = str(command["tenant"])
        sid = str(command["schedule_id"])
        request_id = str(command["request_id"])
        expected = None
        if wait:
            # The answer must bring this back (api.bridge): a request id alone is guessable.
            expected = Expected(reply_nonce=new_reply_nonce(), tenant=tenant, schedule_id=sid)
            command = {**command, "reply_nonce": expected.reply_nonce}
        value = orjson.dumps(command)
        key = sid.encode("utf-8")
        try:
            decode_command(value, key=key, now_ms=now_ms(), limits=self.limits)
        except CommandRejected as exc:
            raise ApiError(http_status(exc.code), exc.code, exc.message, schedule_id=sid) from None
        trow = await self.tenants.get(tenant)
        headers: list[tuple[str, bytes]] = []
        secret = trow.get("signing_secret") if trow else None
        if secret:
            headers = sign_headers(secret, signed_at_ms=now_ms(), key=key, value=value)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        result = await self.bridge.send_command(
            key,
            value,
            headers,
            request_id=request_id,
            expected=expected,
            timeout_s=timeout,
        )
        if wait and result is None:
            raise ApiError(
                504,
                "timeout",
                f"no result within {timeout:g}s; the command may still be applied: "
                f"GET /v1/schedules/{sid} to see",
                schedule_id=sid,
                request_id=request_id,
            )
        return result

    async def _admit(self, command: dict[str, object], timeout_s: float | None) -> ResultDoc:
        """Decide a one-shot create as its worker would (decoded, the tenant active, its
        limits, this instance's share of its create quota), produce it stamped with the
        admission key, and answer once Kafka has acknowledged it (acks=all): the worker
        stores it without deciding again (docs/api.md says what this 201 promises)."""
        tenant = str(command["tenant"])
        sid = str(command["schedule_id"])
        request_id = str(command["request_id"])
        # Its worker's answer is caught too: needed when the stamp turns out unverifiable.
        expected = Expected(reply_nonce=new_reply_nonce(), tenant=tenant, schedule_id=sid)
        command = {**command, "reply_nonce": expected.reply_nonce}
        value = orjson.dumps(command)
        key = sid.encode("utf-8")
        now = now_ms()
        entry = await self.tenants.entry(tenant)
        try:
            decoded = decode_command(value, key=key, now_ms=now, limits=self.limits)
            if isinstance(decoded, CreateCommand) and not admissible(
                decoded.due_ms, decoded.misfire_tolerance_s, now
            ):
                # It may be missed before its worker reads it: the worker answers.
                return await self.send(command, wait=True, timeout_s=timeout_s)
            # As its worker decides (streams.commands._check_sender): only active=false is
            # a deactivated tenant; a row whose column is unset is an active one.
            if entry.row is None:
                raise CommandRejected(Code.UNKNOWN_TENANT, f"tenant {tenant!r} is not registered")
            if entry.row.get("active") is False:
                raise CommandRejected(Code.INACTIVE_TENANT, f"tenant {tenant!r} is deactivated")
            check_tenant_limits(
                decoded,
                entry.config,
                now_ms=now,
                default_retention_s=self.settings.scheduler.fired_retention_s,
                internal_topics=self.internal_topics,
            )
            quota = entry.config.create_quota_per_s
            if not self.admission_quota.allow(tenant, quota, time.monotonic()):
                raise CommandRejected(
                    Code.QUOTA_EXCEEDED,
                    f"tenant {tenant!r} exceeded its create quota of {quota:g} commands/s; "
                    "nothing was applied, retry later",
                )
        except CommandRejected as exc:
            raise ApiError(http_status(exc.code), exc.code, exc.message, schedule_id=sid) from None
        headers: list[tuple[str, bytes]] = []
        if entry.keys.current:
            headers = sign_headers(entry.keys.current, signed_at_ms=now, key=key, value=value)
        assert self.admission.current is not None  # enabled
        headers.append(
            stamp(self.admission.current, admitted_at_ms=now, record_key=key, value=value)
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        # The producer keeps retrying an unanswered create (up to its message timeout), so
        # a GET's 404 proves nothing, and the body re-sent without an id is a second one.
        retry = (
            f'it may still be applied: re-send the same body with "schedule_id": "{sid}" '
            "(a duplicate if it was)"
        )
        try:
            position = await self.bridge.send_admitted(
                key, value, headers, timeout_s=timeout, request_id=request_id, expected=expected
            )
            if position is not None and not fresh(now, position[2]):
                # No worker can check the stamp against the broker's time, so each decides
                # the create in full: a 201 would promise what it may refuse. Its answer.
                log.error(
                    "admitted create appended outside the admission window of this API's "
                    "clock; answering with its worker's result (check this host's clock "
                    "and the commands topic's message.timestamp.type=LogAppendTime)",
                    extra={"admitted_at_ms": now, "append_ms": position[2], "schedule_id": sid},
                )
                answer = await self.bridge.answer(request_id, deadline - time.monotonic())
                if answer is None:
                    raise ApiError(
                        504,
                        "timeout",
                        f"no result within {timeout:g}s; {retry}",
                        schedule_id=sid,
                        request_id=request_id,
                    )
                return answer
        except KafkaError as exc:
            if exc.retriable:
                raise ApiError(503, "unavailable", str(exc), schedule_id=sid) from None
            raise ApiError(500, "kafka_refused", str(exc), schedule_id=sid) from None
        finally:
            self.bridge.forget(request_id)
        if position is None:
            raise ApiError(
                504,
                "timeout",
                f"Kafka did not acknowledge the create within {timeout:g}s; {retry}",
                schedule_id=sid,
                request_id=request_id,
            )
        return ResultDoc(
            schedule_id=sid,
            tenant=tenant,
            request_id=request_id,
            command="create",
            status="accepted",
            code=Code.OK,
            message="admitted: durable in Kafka; its worker stores it and it fires",
            at_ms=now,
            partition=position[0] if position[0] is not None else -1,
            offset=position[1] if position[1] is not None else -1,
        )

    def new_schedule_id(self) -> str:
        return uuid.uuid4().hex

    def check_schedule_id(self, sid: object) -> str:
        try:
            return check_text(sid, "schedule_id", max_len=self.limits.max_id_len)
        except CommandRejected as exc:
            raise ApiError(400, "invalid_field", exc.message) from None

    # -- reads -----------------------------------------------------------------------------

    async def get_schedule(self, tenant: str, sid: str) -> tuple[CqlRow, list[CqlRow]]:
        row = await self.store.get_schedule(tenant, sid)
        if row is None:
            raise await self._missing(tenant, sid)
        events = await self.store.list_events(tenant, sid)
        return row, events

    async def _missing(self, tenant: str, sid: str) -> ApiError:
        """Why a schedule has no row: 410 ``refused`` for a create answered 201 at Kafka's
        acknowledgement that its worker could not store (its history says why), else 404
        (which, for a moment after such a 201, is also a create not stored yet)."""
        if self.admission.enabled:
            for event in await self.store.list_events(tenant, sid):
                detail = str(event.get("detail") or "")
                if event.get("event") == COMMAND_REFUSED and detail.startswith(ADMITTED_REFUSED):
                    return ApiError(410, "refused", f"schedule {sid!r}: {detail}")
        return ApiError(404, "not_found", f"no schedule {sid!r}")

    async def list_schedules(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        statuses: frozenset[str] | None,
        limit: int,
        after: tuple[int, str] | None,
        max_scan: int = 5000,
    ) -> tuple[list[CqlRow], tuple[int, str] | None]:
        """Rows in the window matching ``statuses``, in due order, and the cursor to
        continue from (None when the window is exhausted)."""
        out: list[CqlRow] = []
        scanned = 0
        cursor = after
        while len(out) < limit and scanned < max_scan:
            page = await self.store.read_index(
                tenant,
                from_ms=from_ms,
                to_ms=to_ms,
                after=cursor,
                limit=min(500, max(limit - len(out), 100)),
            )
            if not page:
                return out, None
            rows = await self.store.get_schedules(tenant, [sid for _, sid in page])
            for due, sid in page:
                scanned += 1
                cursor = (due, sid)
                row = rows.get(sid)
                # Skip entries left by a reschedule (the row's due moved elsewhere).
                if row is None or int(row["due_ms"]) != due or not matches(row, statuses):
                    continue
                out.append(row)
                if len(out) >= limit:
                    return out, cursor
        return out, cursor

    async def collect(
        self, tenant: str, from_ms: int, to_ms: int, statuses: frozenset[str]
    ) -> tuple[list[CqlRow], bool]:
        """Every matching row of a window for bulk actions (at most MAX_BULK; True when
        truncated)."""
        rows: list[CqlRow] = []
        cursor: tuple[int, str] | None = None
        while len(rows) < MAX_BULK:
            page, cursor = await self.list_schedules(
                tenant,
                from_ms=from_ms,
                to_ms=to_ms,
                statuses=statuses,
                limit=min(1000, MAX_BULK - len(rows)),
                after=cursor,
            )
            rows.extend(page)
            if cursor is None:
                return rows, False
        return rows, True

    # -- bulk ------------------------------------------------------------------------------

    async def bulk_cancel(self, tenant: str, from_ms: int, to_ms: int) -> dict[str, object]:
        """Cancel every scheduled row of the window, each on its own: a row whose command
        fails is listed in ``failed`` and the others proceed."""
        rows, truncated = await self.collect(
            tenant, from_ms, to_ms, frozenset({ScheduleState.SCHEDULED})
        )
        results = await each_row(rows, lambda row: self._cancel(tenant, row["schedule_id"]))
        codes: dict[str, int] = {}
        failed: list[dict[str, object]] = []
        missing = 0
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, ApiError) and result.status == 504:
                missing += 1  # sent, unanswered in time: it may still apply
            elif isinstance(result, Exception):
                failed.append(row_failure(row["schedule_id"], result))
            else:
                codes[result] = codes.get(result, 0) + 1
        return {
            "matched": len(rows),
            "cancelled": codes.get(Code.OK, 0),
            "codes": codes,
            "no_result": missing,
            "failed": failed,
            "truncated": truncated,
        }

    async def _cancel(self, tenant: str, schedule_id: str) -> str:
        """Cancel one schedule; the result code the scheduler answered."""
        cmd = cancel_command(
            tenant=tenant, schedule_id=schedule_id, request_id=self.bridge.new_request_id()
        )
        res = await self.send(cmd, wait=True)
        return res["code"]

    async def bulk_toggle(
        self,
        tenant: str,
        kind: str,
        from_ms: int,
        to_ms: int,
        id_prefix: str = "",
        cursor: str | None = None,
    ) -> dict[str, object]:
        """Pause (``kind`` "pause") every scheduled schedule of the tenant, or resume every
        paused one, as ``toggle_targets`` selects them from ``cursor`` (a previous
        answer's ``next_cursor``). At most MAX_BULK selected and MAX_BULK_SCAN_ROWS index
        rows read per request; when it stopped before the end, ``truncated`` and
        ``next_cursor`` say where to go on: repeating the request without it would read
        again the rows it passed over (other states, other prefixes, ones that failed) and
        could never get past them. Each is its own command,
        answered on its own: one that fails is listed in ``failed`` and the others
        proceed."""
        state, done = BULK_TOGGLES[kind]
        rows, stopped_at = await toggle_targets(
            self.store,
            tenant,
            state,
            from_ms=from_ms,
            to_ms=to_ms,
            id_prefix=id_prefix,
            cursor=decode_cursor(cursor),
        )
        results = await each_row(
            rows, lambda row: self._simple(kind, tenant, str(row["schedule_id"]))
        )
        codes: dict[str, int] = {}
        failed: list[dict[str, object]] = []
        missing = 0
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, ApiError) and result.status == 504:
                missing += 1  # sent, unanswered in time: it may still apply
            elif isinstance(result, Exception):
                failed.append(row_failure(row["schedule_id"], result))
            else:
                codes[result] = codes.get(result, 0) + 1
        return {
            "matched": len(rows),
            done: codes.get(Code.OK, 0),
            "codes": codes,
            "no_result": missing,
            "failed": failed,
            "truncated": stopped_at is not None,
            "next_cursor": encode_cursor(*stopped_at) if stopped_at is not None else None,
        }

    async def _simple(self, kind: str, tenant: str, schedule_id: str) -> str:
        """Send one cancel, pause, resume or trigger; the result code the scheduler
        answered."""
        cmd = simple_command(
            kind, tenant=tenant, schedule_id=schedule_id, request_id=self.bridge.new_request_id()
        )
        res = await self.send(cmd, wait=True)
        return res["code"]

    async def bulk_refire(
        self, tenant: str, from_ms: int, to_ms: int, statuses: frozenset[str]
    ) -> dict[str, object]:
        """Emit the trigger of each matching fired/missed schedule again (reconcile), each
        on its own: a row that fails is listed in ``failed`` and the others proceed.

        The trigger keeps its trigger_id (it is the same trigger), with the next emission
        attempt number; a 'refired' event is added to the schedule's history."""
        rows, truncated = await self.collect(tenant, from_ms, to_ms, statuses)
        rows = [
            r
            for r in rows
            if effective_state(r) != ScheduleState.SCHEDULED
            and r.get("state") != ScheduleState.CANCELLED
        ]
        results = await each_row(rows, lambda row: self._refire(ScheduleRow(**row)))
        failed = [
            row_failure(row["schedule_id"], result)
            for row, result in zip(rows, results, strict=True)
            if isinstance(result, Exception)
        ]
        return {
            "matched": len(rows),
            "refired": len(rows) - len(failed),
            "failed": failed,
            "truncated": truncated,
        }

    async def _refire(self, row: ScheduleRow) -> None:
        """Emit ``row``'s trigger again with the next attempt number, and record it."""
        events = await self.store.list_events(row.tenant, row.schedule_id)
        attempt = 1 + sum(
            1 for e in events if e["event"] in (ScheduleEvent.FIRED, ScheduleEvent.REFIRED)
        )
        at = now_ms()
        trig = trigger_for(row, emitted_ms=at, attempt=attempt)
        await self.bridge.send_record(
            self.bridge.catalog.fires.name,
            trig.order_key.encode(),
            encode_trigger(trig),
            trigger_headers(trig),
        )
        was = " (was missed)" if row.state == ScheduleState.MISSED else ""
        await self.store.record_event(
            row.tenant,
            row.schedule_id,
            ScheduleEvent.REFIRED,
            at_ms=at,
            trigger_id=trig.trigger_id,
            due_ms=trig.due_ms,
            detail="re-fired by bulk reconcile" + was,
        )


def _one_shot_create(command: dict[str, object]) -> bool:
    """Whether a command (wire JSON) is a one-shot create: the only command admitted."""
    return command.get("type") == "create" and command.get("recurrence") is None


@dataclass
class _Scan:
    """One bulk selection in progress: what it picked, the rows it may still read, and
    the position after the last row it examined."""

    state: str
    id_prefix: str
    limit: int
    budget_rows: int
    out: list[CqlRow]
    at: tuple[int, str] | None = None

    def full(self) -> bool:
        return len(self.out) >= self.limit


async def toggle_targets(
    store: Store,
    tenant: str,
    state: str,
    *,
    from_ms: int,
    to_ms: int,
    id_prefix: str = "",
    limit: int = MAX_BULK,
    cursor: tuple[int, str] | None = None,
) -> tuple[list[CqlRow], tuple[int, str] | None]:
    """The tenant's schedules in ``state`` (scheduled: to pause; paused: to resume) whose
    id starts with ``id_prefix``: one-shots due in [from_ms, to_ms) from the listing
    index, in due order, then recurring schedules whatever their times, each as its
    schedule id only. Starts after ``cursor`` (a previous call's position) and stops at
    ``limit`` selected or ``MAX_BULK_SCAN_ROWS`` rows read, answering then the position to
    go on from (None: nothing is left). Shared by the API's bulk routes and ``tocsin
    schedule pause|resume --all``."""
    scan = _Scan(state, id_prefix, limit, MAX_BULK_SCAN_ROWS, [])
    if cursor is None or cursor[0] != _RECURRING:
        if not await _scan_index(store, tenant, scan, from_ms, to_ms, cursor):
            return scan.out, scan.at
        cursor = (_RECURRING, "")
    if not await _scan_recurring(store, tenant, scan, cursor[1]):
        return scan.out, scan.at
    return scan.out, None


async def _scan_index(
    store: Store,
    tenant: str,
    scan: _Scan,
    from_ms: int,
    to_ms: int,
    after: tuple[int, str] | None,
) -> bool:
    """Select from the listing index after ``after``; True when it was read to its end."""
    while True:
        if scan.budget_rows <= 0:
            scan.at = after if after is not None else (from_ms, "")
            return False
        want = min(_SCAN_PAGE, scan.budget_rows)
        page = await store.read_index(tenant, from_ms=from_ms, to_ms=to_ms, after=after, limit=want)
        scan.budget_rows -= len(page)
        wanted = [sid for _, sid in page if sid.startswith(scan.id_prefix)]
        rows = await store.get_schedules(tenant, wanted) if wanted else {}
        for due, sid in page:
            after = (due, sid)
            row = rows.get(sid)
            # A row whose due moved elsewhere is listed there (a reschedule's old entry).
            if row is None or int(row["due_ms"]) != due or effective_state(row) != scan.state:
                continue
            scan.out.append({"schedule_id": sid})  # not the row: up to ``limit`` payloads
            if scan.full():
                scan.at = after
                return False
        if len(page) < want:
            return True


async def _scan_recurring(store: Store, tenant: str, scan: _Scan, after: str) -> bool:
    """Select from the recurring schedules after id ``after``; True when read to the end."""
    while True:
        if scan.budget_rows <= 0:
            scan.at = (_RECURRING, after)
            return False
        want = min(_SCAN_PAGE, scan.budget_rows)
        ids = await store.list_recurring_page(tenant, after=after, limit=want)
        scan.budget_rows -= len(ids)
        wanted = [i for i in ids if i.startswith(scan.id_prefix)]
        rows = await store.get_schedules(tenant, wanted) if wanted else {}
        for sid in ids:
            after = sid
            row = rows.get(sid)
            if row is None or not row.get("recurrence") or row.get("state") != scan.state:
                continue
            scan.out.append({"schedule_id": sid})
            if scan.full():
                scan.at = (_RECURRING, after)
                return False
        if len(ids) < want:
            return True


async def each_row(
    rows: Sequence[CqlRow], work: Callable[[CqlRow], Awaitable[T]]
) -> list[T | Exception]:
    """``work`` for every row, BULK_CONCURRENCY at a time, each row's result or error in
    row order: no row's error is lost and none stops the others."""
    sem = asyncio.Semaphore(BULK_CONCURRENCY)

    async def one(row: CqlRow) -> T:
        async with sem:
            return await work(row)

    results = await asyncio.gather(*(one(r) for r in rows), return_exceptions=True)
    out: list[T | Exception] = []
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancellation or interpreter exit: not a row's outcome
        out.append(result)
    return out


def row_failure(schedule_id: str, exc: Exception) -> dict[str, object]:
    """One bulk row's failure as the answer reports it: the API's own code, ``unavailable``
    for a retriable backend error (the same request may succeed later), ``failed`` for a
    backend error that will not pass on retry, ``internal`` for anything unforeseen."""
    if isinstance(exc, ApiError):
        code, message, retriable = exc.code, exc.message, exc.retriable
    elif isinstance(exc, TocsinError):
        code = "unavailable" if exc.retriable else "failed"
        message, retriable = str(exc), exc.retriable
    else:
        log.error("bulk row failed", exc_info=exc, extra={"schedule_id": schedule_id})
        code, message, retriable = "internal", "internal error", False
    if code != "internal":
        log.warning(
            "bulk row failed",
            extra={"schedule_id": schedule_id, "code": code, "error": message},
        )
    return {"schedule_id": schedule_id, "code": code, "message": message, "retriable": retriable}
