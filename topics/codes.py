"""Machine-readable outcome codes carried by every command result.

A result's ``status`` is ``accepted`` exactly when its code is in ``ACCEPTED_CODES``; every
other code is a rejection. Codes are part of the public wire contract: clients branch on
them, so a code's spelling and meaning must never change once released (add new ones
instead). This module must never do I/O.
"""

from __future__ import annotations

from enum import StrEnum


class Code(StrEnum):
    """One code per outcome a client may want to act on differently."""

    OK = "ok"
    DUPLICATE = "duplicate"
    MALFORMED_JSON = "malformed_json"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_COMMAND_TYPE = "unknown_command_type"
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    INVALID_DUE = "invalid_due"
    DUE_IN_PAST = "due_in_past"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_URL = "invalid_url"
    INVALID_CALLBACK = "invalid_callback"
    UNKNOWN_TENANT = "unknown_tenant"
    INACTIVE_TENANT = "inactive_tenant"
    NOT_FOUND = "not_found"
    ALREADY_FIRED = "already_fired"
    ALREADY_CANCELLED = "already_cancelled"
    CONFLICT = "conflict"
    KEY_MISMATCH = "key_mismatch"
    NOTHING_TO_UPDATE = "nothing_to_update"
    TOO_LARGE = "too_large"
    WRONG_PARTITION = "wrong_partition"
    QUOTA_EXCEEDED = "quota_exceeded"
    BAD_SIGNATURE = "bad_signature"
    CALLBACK_NOT_ALLOWED = "callback_not_allowed"
    BEYOND_HORIZON = "beyond_horizon"
    SIGNING_KEY_RETIRED = "signing_key_retired"
    STALE_COMMAND = "stale_command"
    REPLAYED_COMMAND = "replayed_command"
    NOT_RECURRING = "not_recurring"
    WINDOW_IN_FUTURE = "window_in_future"
    STORE_REJECTED = "store_rejected"
    INTERNAL_ERROR = "internal_error"

    @property
    def doc(self) -> str:
        """One line saying what the code means to a client."""
        return DOCS[self]


DOCS: dict[Code, str] = {
    Code.OK: "The command was applied.",
    Code.DUPLICATE: (
        "A create repeated an existing schedule with identical content; nothing changed "
        "(an idempotent retry)."
    ),
    Code.MALFORMED_JSON: "The message value is not valid UTF-8 JSON.",
    Code.NOT_AN_OBJECT: "The message value is JSON but not a JSON object.",
    Code.UNKNOWN_COMMAND_TYPE: "The `type` field is not one of create, update, cancel.",
    Code.MISSING_FIELD: "A field required for this command type is absent.",
    Code.INVALID_FIELD: "A field has the wrong type or value, or is not part of the contract.",
    Code.INVALID_DUE: "`due` is neither an ISO-8601 time with an offset nor integer epoch ms.",
    Code.DUE_IN_PAST: "`due` is further in the past than the misfire tolerance allows.",
    Code.PAYLOAD_TOO_LARGE: "The payload exceeds the configured maximum size.",
    Code.INVALID_URL: "The HTTP callback URL is not an absolute http(s) URL Tocsin may call.",
    Code.INVALID_CALLBACK: "The callback is malformed (type, method, headers, timeout, topic).",
    Code.UNKNOWN_TENANT: "The tenant is not registered.",
    Code.INACTIVE_TENANT: "The tenant exists but is deactivated.",
    Code.NOT_FOUND: "An update or cancel named a schedule that does not exist.",
    Code.ALREADY_FIRED: "The schedule has already fired (or was missed); it can no longer change.",
    Code.ALREADY_CANCELLED: "The schedule was cancelled earlier; it can no longer change.",
    Code.NOT_RECURRING: "A backfill named a one-shot schedule; only recurring ones have runs.",
    Code.WINDOW_IN_FUTURE: (
        "A backfill's window starts at or after the scheduler's now; only past runs backfill."
    ),
    Code.CONFLICT: "A create reused an existing schedule id with different content.",
    Code.KEY_MISMATCH: "The Kafka message key is not the command's schedule_id.",
    Code.NOTHING_TO_UPDATE: "An update carried none of due, payload, callback.",
    Code.TOO_LARGE: "The whole message exceeds the hard size cap; it was not parsed.",
    Code.WRONG_PARTITION: (
        "The command arrived on another partition than murmur2(schedule_id) picks; produce "
        "with Kafka's default partitioner so all commands of a schedule share a partition."
    ),
    Code.QUOTA_EXCEEDED: (
        "The tenant sent commands faster than its create quota (commands/s); retry later."
    ),
    Code.BAD_SIGNATURE: (
        "The command lacks a valid tocsin-signature header for its tenant (HMAC-SHA256 with "
        "the tenant's signing key)."
    ),
    Code.CALLBACK_NOT_ALLOWED: (
        "The callback host or Kafka topic is not in the tenant's allowed list, or is internal."
    ),
    Code.BEYOND_HORIZON: (
        "`due`, or a recurring schedule's first run, is further ahead than the tenant's "
        "maximum horizon."
    ),
    Code.SIGNING_KEY_RETIRED: (
        "The command is signed with a signing key of the tenant that was rotated out and "
        "retired; sign with the tenant's current key."
    ),
    Code.STALE_COMMAND: (
        "The command is correctly signed but its tocsin-signed-at is too far from the time "
        "the broker appended it (a late replay), or the commands topic does not stamp "
        "broker time (LogAppendTime); sign again when producing."
    ),
    Code.REPLAYED_COMMAND: (
        "The same signed record (identical signature) was already read at another offset "
        "of the partition within the signature window, or the command is signed before the "
        "last signed command applied to its schedule (or in that millisecond with the same "
        "signature); a copy, or a command overtaken by a later one, is not applied."
    ),
    Code.STORE_REJECTED: (
        "Cassandra or Kafka refused this command's data for good (the message says why); "
        "nothing was applied, and repeating the same command gets the same answer."
    ),
    Code.INTERNAL_ERROR: (
        "The worker failed on this command in a way it did not expect (a bug, logged with "
        "its traceback); nothing was applied. The other commands of its batch proceeded."
    ),
}

ACCEPTED_CODES: frozenset[Code] = frozenset({Code.OK, Code.DUPLICATE})

# Decided by the scheduler (from stored state or the partition a message arrived on), never
# by ``decode_command``, which sees only the bytes and the key.
STATEFUL_CODES: frozenset[Code] = frozenset(
    {
        Code.DUPLICATE,
        Code.UNKNOWN_TENANT,
        Code.INACTIVE_TENANT,
        Code.NOT_FOUND,
        Code.ALREADY_FIRED,
        Code.ALREADY_CANCELLED,
        Code.CONFLICT,
        Code.WRONG_PARTITION,
        Code.QUOTA_EXCEEDED,
        Code.BAD_SIGNATURE,
        Code.STORE_REJECTED,
        Code.INTERNAL_ERROR,
        Code.CALLBACK_NOT_ALLOWED,
        Code.BEYOND_HORIZON,
        Code.SIGNING_KEY_RETIRED,
        Code.STALE_COMMAND,
        Code.REPLAYED_COMMAND,
        Code.NOT_RECURRING,
        Code.WINDOW_IN_FUTURE,
    }
)
