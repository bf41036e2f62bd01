"""Structured logging: one JSON object per line (or plain text), quiet at INFO.

Context goes in ``extra={...}``; every extra key becomes a field of the record.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

# Chatty third-party loggers that would drown our INFO lines.
_NOISY = ("faust", "mode", "aiokafka", "kafka", "aiohttp.access", "venusian")
# Cassandra's driver logs every server-side batch warning at WARNING: only errors, please.
_QUIET = ("cassandra",)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={v}"
            for k, v in record.__dict__.items()
            if k not in _STANDARD and not k.startswith("_")
        )
        base = f"{record.levelname.lower():7s} {record.name}: {record.getMessage()}"
        text = f"{base} {extras}" if extras else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def logging_dict(level: str = "INFO", fmt: str = "json") -> dict[str, object]:
    """The same setup as a dictConfig, for runners that configure logging themselves
    (Faust's worker takes it as ``logging_config``)."""
    formatter = "base.logs.JsonFormatter" if fmt == "json" else "base.logs.TextFormatter"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tocsin": {"()": formatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "tocsin",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {
            **{name: {"level": "WARNING"} for name in _NOISY},
            **{name: {"level": "ERROR"} for name in _QUIET},
        },
    }


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
