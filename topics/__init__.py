"""The wire contract: what travels on Tocsin's topics and how it is checked.

``models`` (shapes), ``codes`` (result codes), ``validation`` (untrusted command bytes ->
``Command`` or ``CommandRejected``) with the checks it is built from (``fields``: limits,
ids, due times, payloads; ``callbacks``; ``recurrence``: cron and time zones), ``codec``
(every other encode/decode), ``ids`` (stable trigger ids, time format), ``addresses``
(which callback addresses are refused), ``signing`` and ``catalog`` (topic names and their
configuration). Everything
here is pure: it must never do I/O or read the clock (``tocsin.topic_admin`` creates the
topics).
"""

from topics.codec import (
    callback_from_dict,
    callback_from_json,
    callback_to_dict,
    callback_to_json,
    command_to_dict,
    decode_result,
    decode_trigger,
    encode_command,
    encode_result,
    encode_trigger,
    trigger_headers,
)
from topics.codes import ACCEPTED_CODES, Code
from topics.ids import format_iso_ms, parse_iso_ms, trigger_id
from topics.models import (
    Callback,
    CancelCommand,
    Command,
    CommandResult,
    CommandType,
    CreateCommand,
    DeliveryRetry,
    HttpCallback,
    KafkaCallback,
    PayloadType,
    ResultStatus,
    Trigger,
    UpdateCommand,
)
from topics.validation import Limits, canonical_json, decode_command, salvage_ids

__all__ = [
    "ACCEPTED_CODES",
    "Callback",
    "CancelCommand",
    "Code",
    "Command",
    "CommandResult",
    "CommandType",
    "CreateCommand",
    "DeliveryRetry",
    "HttpCallback",
    "KafkaCallback",
    "Limits",
    "PayloadType",
    "ResultStatus",
    "Trigger",
    "UpdateCommand",
    "callback_from_dict",
    "callback_from_json",
    "callback_to_dict",
    "callback_to_json",
    "canonical_json",
    "command_to_dict",
    "decode_command",
    "decode_result",
    "decode_trigger",
    "encode_command",
    "encode_result",
    "encode_trigger",
    "format_iso_ms",
    "parse_iso_ms",
    "salvage_ids",
    "trigger_headers",
    "trigger_id",
]
