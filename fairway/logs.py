"""Structured logs: one JSON object per line, with the request id of the request it is about.

``LOG_FORMAT=json`` switches every Fairway process (gateway, control plane, Celery workers)
to JSON lines; the default stays the plain text format. The request id travels in a context
variable: the gateway sets it per request (the id it puts in ``x-request-id``), the control
plane's ``fairway.middleware.RequestIdMiddleware`` per HTTP request, Celery per task (its
task id). asyncio copies context variables into each task, so concurrent requests never see
each other's id.

No Django import here: the gateway uses it too.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson

request_id_var: ContextVar[str | None] = ContextVar("fairway_request_id", default=None)
# The gateway's caller-supplied X-Request-Id (nginx sets one), when it differs from its own.
client_request_id_var: ContextVar[str | None] = ContextVar(
    "fairway_client_request_id", default=None
)
PLAIN_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# LogRecord attributes that are not "extra" fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def json_enabled(env: dict[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get("LOG_FORMAT", "").lower() == "json"


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record (``None`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class AccessLogRequestIdFilter(RequestIdFilter):
    """gunicorn's access lines: it logs them after the response is closed, when the
    request's context is gone, with the line's atoms as the record's arguments. The request
    id is the response's ``X-Request-Id`` (the control plane's middleware sets it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        atoms = record.args
        if isinstance(atoms, Mapping):
            rid = atoms.get("{x-request-id}o")
            if isinstance(rid, str) and rid != "-":
                record.request_id = rid
        return super().filter(record)


def gunicorn_logconfig() -> dict[str, Any]:
    """gunicorn's ``logconfig_dict`` (``fairway.gunicorn_conf``): its error and access
    loggers as JSON lines, with the request id on each access line."""
    json_handler = {"class": "logging.StreamHandler", "formatter": "json"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "root": {"level": "INFO", "handlers": ["error_console"]},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": ["error_console"], "propagate": False},
            "gunicorn.access": {"level": "INFO", "handlers": ["console"], "propagate": False},
        },
        "filters": {
            "request_id": {"()": RequestIdFilter},
            "access_request_id": {"()": AccessLogRequestIdFilter},
        },
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "console": {
                **json_handler,
                "filters": ["access_request_id"],
                "stream": "ext://sys.stdout",
            },
            "error_console": {
                **json_handler,
                "filters": ["request_id"],
                "stream": "ext://sys.stderr",
            },
        },
    }


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or request_id_var.get(),
            "pid": record.process,
        }
        client_rid = client_request_id_var.get()
        if client_rid is not None:
            payload["client_request_id"] = client_rid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in payload and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        return orjson.dumps(payload, default=repr).decode()


def handler(stream: Any = None) -> logging.Handler:
    out = logging.StreamHandler(stream)
    out.setFormatter(JsonFormatter() if json_enabled() else logging.Formatter(PLAIN_FORMAT))
    out.addFilter(RequestIdFilter())
    return out


def configure(level: str | int = "INFO", stream: Any = None) -> None:
    """The root logger of a non-Django process (the gateway): one handler on stderr."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler(stream))
    root.setLevel(level.upper() if isinstance(level, str) else level)


def accept_request_id(raw: str | None) -> str:
    """The caller's X-Request-Id when well-formed, else a new one."""
    if raw and _REQUEST_ID.fullmatch(raw):
        return raw
    return uuid.uuid4().hex
