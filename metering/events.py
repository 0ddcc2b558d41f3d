"""Parse and check one ``usage.v1`` message: a billed row, or the reason it is refused.

``validate`` is a pure function of the message bytes and what it is checked against (the
known tenants and model versions, the clock, the oldest day still kept), so every refusal
is unit-testable without Kafka or a database.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Container, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, NamedTuple

import orjson

from metering.rules import FINISH_REASONS, billed_tokens

SCHEMA_VERSION = 1


class Reason:
    """Dead-letter reason codes (stable: alerting and support queries key on them)."""

    NOT_JSON = "not_json"  # not JSON, or not a JSON object, or an empty message
    SCHEMA_VERSION = "schema_version"  # a schema_version this consumer does not know
    MISSING_FIELD = "missing_field"
    BAD_TYPE = "bad_type"  # a field of the wrong JSON type
    BAD_VALUE = "bad_value"  # right type, impossible value (not a UUID, unknown finish...)
    NEGATIVE_TOKENS = "negative_tokens"
    CACHED_EXCEEDS_PROMPT = "cached_exceeds_prompt"
    UNKNOWN_TENANT = "unknown_tenant"
    UNKNOWN_MODEL_VERSION = "unknown_model_version"
    FUTURE_STARTED_AT = "future_started_at"  # further ahead than the allowed clock skew
    EXPIRED = "expired"  # started on a day whose request_log partition is dropped


REASONS: tuple[str, ...] = tuple(
    value for name, value in vars(Reason).items() if name.isupper() and isinstance(value, str)
)

_STR_FIELDS = {
    "request_id": 64,
    "tenant_id": 64,
    "api_key_id": 64,
    "model": 100,
    "model_version": 100,
    "replica_id": 100,
    "started_at": 64,
    "finish_reason": 16,
}
_INT_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "status")
_OPTIONAL_FLOAT_FIELDS = ("ttft_ms", "tpot_ms")


class Row(NamedTuple):
    """One request as it goes into ``request_log`` (billed counts) and ``usage``; the
    fields in the table's column order (a tuple: cheap to build, copied as is)."""

    request_id: str
    started_at: datetime  # UTC
    tenant_id: str  # canonical UUID text (lowercase, hyphenated)
    api_key_id: str
    model: str
    model_version_id: int
    replica_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    finish_reason: str
    status: int
    is_retry: bool


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str  # a DeadLetter.Reason value
    detail: str


@dataclass(frozen=True, slots=True)
class Checks:
    """What an event is checked against."""

    now: datetime
    oldest_day: date  # events that started before this UTC day are refused (partition gone)
    max_future: timedelta
    tenants: Container[str]  # canonical UUID text
    versions: Mapping[str, int]  # model version name -> catalog id


_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def canonical_uuid(value: str) -> str | None:
    """The UUID's canonical text, or None if it is not one (fast path: already canonical,
    as the gateway writes them)."""
    if _CANONICAL_UUID.fullmatch(value):
        return value
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def _parse_time(value: str) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None  # a naive time is ambiguous; the gateway always writes UTC offsets
    return parsed.astimezone(UTC)


def parse(raw: bytes) -> dict[str, Any] | Rejected:
    """The message as a dict whose fields are all present and of the right type."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Rejected(Reason.NOT_JSON, str(exc)[:200])
    if not isinstance(obj, dict):
        return Rejected(Reason.NOT_JSON, f"a JSON {type(obj).__name__}, not an object")
    version = obj.get("schema_version")
    if version is None:
        return Rejected(Reason.MISSING_FIELD, "schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        return Rejected(Reason.SCHEMA_VERSION, f"schema_version {version!r}")
    for name, max_len in _STR_FIELDS.items():
        value = obj.get(name)
        if value is None:
            return Rejected(Reason.MISSING_FIELD, name)
        if type(value) is not str:
            return Rejected(Reason.BAD_TYPE, f"{name} must be a string")
        if not value or len(value) > max_len:
            return Rejected(Reason.BAD_VALUE, f"{name} must be 1-{max_len} characters")
    for name in _INT_FIELDS:
        value = obj.get(name)
        if value is None:
            return Rejected(Reason.MISSING_FIELD, name)
        if type(value) is not int:  # bool is an int subclass: refused too
            return Rejected(Reason.BAD_TYPE, f"{name} must be an integer")
    for name in _OPTIONAL_FLOAT_FIELDS:
        if name not in obj:
            return Rejected(Reason.MISSING_FIELD, name)
        value = obj[name]
        if value is not None and type(value) not in (int, float):
            return Rejected(Reason.BAD_TYPE, f"{name} must be a number or null")
    if "is_retry" not in obj:
        return Rejected(Reason.MISSING_FIELD, "is_retry")
    if type(obj["is_retry"]) is not bool:
        return Rejected(Reason.BAD_TYPE, "is_retry must be a boolean")
    return obj


def validate(raw: bytes, checks: Checks) -> Row | Rejected:
    """The whole check of one message: ``check(parse(raw))``."""
    obj = parse(raw)
    return obj if isinstance(obj, Rejected) else check(obj, checks)


def check(obj: dict[str, Any], checks: Checks) -> Row | Rejected:
    """The value checks of a parsed message, then the billing rule."""
    tenant_id = canonical_uuid(obj["tenant_id"])
    if tenant_id is None:
        return Rejected(Reason.BAD_VALUE, "tenant_id is not a UUID")
    api_key_id = canonical_uuid(obj["api_key_id"])
    if api_key_id is None:
        return Rejected(Reason.BAD_VALUE, "api_key_id is not a UUID")
    started_at = _parse_time(obj["started_at"])
    if started_at is None:
        return Rejected(Reason.BAD_VALUE, "started_at is not an ISO-8601 time with an offset")
    if obj["finish_reason"] not in FINISH_REASONS:
        return Rejected(Reason.BAD_VALUE, f"finish_reason {obj['finish_reason']!r}")
    status = obj["status"]
    if not 100 <= status <= 599:
        return Rejected(Reason.BAD_VALUE, f"status {status}")
    prompt, cached, completion = (
        obj["prompt_tokens"],
        obj["cached_tokens"],
        obj["completion_tokens"],
    )
    if prompt < 0 or cached < 0 or completion < 0:
        return Rejected(Reason.NEGATIVE_TOKENS, f"{prompt}/{cached}/{completion}")
    if cached > prompt:
        return Rejected(Reason.CACHED_EXCEEDS_PROMPT, f"cached {cached} > prompt {prompt}")
    for name in _OPTIONAL_FLOAT_FIELDS:
        if obj[name] is not None and not 0 <= obj[name] < 1e12:
            return Rejected(Reason.BAD_VALUE, f"{name} {obj[name]}")
    if started_at > checks.now + checks.max_future:
        return Rejected(Reason.FUTURE_STARTED_AT, started_at.isoformat())
    if started_at.date() < checks.oldest_day:
        return Rejected(Reason.EXPIRED, started_at.isoformat())
    if tenant_id not in checks.tenants:
        return Rejected(Reason.UNKNOWN_TENANT, tenant_id)
    version_id = checks.versions.get(obj["model_version"])
    if version_id is None:
        return Rejected(Reason.UNKNOWN_MODEL_VERSION, obj["model_version"])
    billed = billed_tokens(
        status=status, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion
    )
    ttft, tpot = obj["ttft_ms"], obj["tpot_ms"]
    return Row(
        obj["request_id"],
        started_at,
        tenant_id,
        api_key_id,
        obj["model"],
        version_id,
        obj["replica_id"],
        billed.prompt_tokens,
        billed.cached_tokens,
        billed.completion_tokens,
        None if ttft is None else float(ttft),
        None if tpot is None else float(tpot),
        obj["finish_reason"],
        status,
        obj["is_retry"],
    )
