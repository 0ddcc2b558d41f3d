"""The usage event: one per admitted request, the record the spool holds and Kafka
``usage.v1`` carries (the consumer in ``metering/`` reads it)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

USAGE_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class UsageEvent:
    request_id: str
    tenant_id: str
    api_key_id: str
    model: str  # the name the client asked for (alias or pinned version)
    model_version: str  # the weights version that served it
    replica_id: str
    started_at: str  # UTC ISO-8601
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    finish_reason: str  # stop | length | cancelled | error | timeout
    status: int  # HTTP status the client saw (200 even when a stream failed midway)
    is_retry: bool

    def to_json(self) -> bytes:
        # orjson serialises a dataclass natively (dataclasses.asdict would cost ~100 µs);
        # the schema version goes first so that a reader can branch before parsing on.
        return b'{"schema_version":%d,' % USAGE_SCHEMA_VERSION + orjson.dumps(self)[1:]


# An in-flight mark: the terminal event a request would get if its process died now, spooled
# while it runs (at dispatch, at the first token, then every few seconds of a stream) and
# never sent. The request's real event supersedes it; a spool adopted from a dead process
# turns each mark that has no event after it into that event (``settled_record``).
MARK_PREFIX = b'{"inflight":true,'
_REQUEST_ID = b'"request_id":"'


def mark_record(event: UsageEvent) -> bytes:
    return MARK_PREFIX + event.to_json()[1:]


def settled_record(mark: bytes) -> bytes:
    """The usage event a mark stands for: the same bytes without the mark's field."""
    return b"{" + mark[len(MARK_PREFIX) :]


def record_request_id(record: bytes) -> bytes | None:
    """The ``request_id`` of a spooled event or mark, found without parsing the line (the
    writer does this for every record); None for a line that has none."""
    start = record.find(_REQUEST_ID)
    if start < 0:
        return None
    start += len(_REQUEST_ID)
    end = record.find(b'"', start)
    return record[start:end] if end > start else None


def record_key(record: bytes) -> tuple[bytes | None, str]:
    """The Kafka key (tenant id) of a spooled line, or None and why it cannot be sent
    (``inflight`` for a mark, which is skipped rather than quarantined)."""
    if record.startswith(MARK_PREFIX):
        return None, "inflight"
    try:
        obj = orjson.loads(record)
    except orjson.JSONDecodeError:
        return None, "not_json"
    if not isinstance(obj, dict):
        return None, "not_an_object"
    tenant = obj.get("tenant_id")
    if not isinstance(tenant, str) or not tenant:
        return None, "no_tenant_id"
    return tenant.encode(), ""
