"""The pure check of one usage.v1 message and the billing rule (no Kafka, no database)."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import orjson
import pytest

from metering.events import REASONS, Checks, Reason, Rejected, Row, validate
from metering.rules import billed_tokens

TENANT = uuid.uuid4()
KEY = uuid.uuid4()
NOW = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
CHECKS = Checks(
    now=NOW,
    oldest_day=date(2026, 2, 8),
    max_future=timedelta(minutes=5),
    tenants={str(TENANT)},
    versions={"llama-8b-2026-05": 7},
)


def event(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema_version": 1,
        "request_id": "req-1",
        "tenant_id": str(TENANT),
        "api_key_id": str(KEY),
        "model": "llama-8b",
        "model_version": "llama-8b-2026-05",
        "replica_id": "r1",
        "started_at": "2026-03-10T11:59:59.999000+00:00",
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "cached_tokens": 30,
        "ttft_ms": 12.5,
        "tpot_ms": None,
        "finish_reason": "stop",
        "status": 200,
        "is_retry": False,
    }
    base.update(changes)
    return base


def check(obj: Any) -> Row | Rejected:
    raw = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return validate(raw, CHECKS)


def reason(obj: Any) -> str:
    outcome = check(obj)
    assert isinstance(outcome, Rejected), outcome
    return outcome.reason


def test_a_good_event_becomes_a_row_with_the_catalog_id_and_a_utc_time() -> None:
    row = check(event(started_at="2026-03-10T13:30:00+01:30"))
    assert isinstance(row, Row)
    assert row.tenant_id == str(TENANT) and row.api_key_id == str(KEY)
    assert row.model_version_id == 7
    assert row.started_at == datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
    assert row.started_at.tzinfo is UTC
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (100, 30, 20)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"not json", Reason.NOT_JSON),
        (b"[1, 2]", Reason.NOT_JSON),
        (b"", Reason.NOT_JSON),
        (
            orjson.dumps({k: v for k, v in event().items() if k != "schema_version"}),
            Reason.MISSING_FIELD,
        ),
        (orjson.dumps(event(schema_version=2)), Reason.SCHEMA_VERSION),
        (orjson.dumps(event(schema_version="1")), Reason.SCHEMA_VERSION),
        (
            orjson.dumps({k: v for k, v in event().items() if k != "completion_tokens"}),
            Reason.MISSING_FIELD,
        ),
        (orjson.dumps({k: v for k, v in event().items() if k != "ttft_ms"}), Reason.MISSING_FIELD),
        (orjson.dumps(event(prompt_tokens="100")), Reason.BAD_TYPE),
        (orjson.dumps(event(prompt_tokens=1.5)), Reason.BAD_TYPE),
        (orjson.dumps(event(prompt_tokens=True)), Reason.BAD_TYPE),
        (orjson.dumps(event(request_id=5)), Reason.BAD_TYPE),
        (orjson.dumps(event(is_retry=0)), Reason.BAD_TYPE),
        (orjson.dumps(event(ttft_ms="fast")), Reason.BAD_TYPE),
        (orjson.dumps(event(request_id="")), Reason.BAD_VALUE),
        (orjson.dumps(event(request_id="x" * 65)), Reason.BAD_VALUE),
        (orjson.dumps(event(tenant_id="t-123")), Reason.BAD_VALUE),
        (orjson.dumps(event(api_key_id="k-1")), Reason.BAD_VALUE),
        (orjson.dumps(event(started_at="yesterday")), Reason.BAD_VALUE),
        (orjson.dumps(event(started_at="2026-03-10T11:00:00")), Reason.BAD_VALUE),  # naive
        (orjson.dumps(event(finish_reason="exploded")), Reason.BAD_VALUE),
        (orjson.dumps(event(status=99)), Reason.BAD_VALUE),
        (orjson.dumps(event(ttft_ms=-1.0)), Reason.BAD_VALUE),
        (orjson.dumps(event(prompt_tokens=-1, cached_tokens=0)), Reason.NEGATIVE_TOKENS),
        (orjson.dumps(event(completion_tokens=-5)), Reason.NEGATIVE_TOKENS),
        (orjson.dumps(event(prompt_tokens=10, cached_tokens=11)), Reason.CACHED_EXCEEDS_PROMPT),
        (orjson.dumps(event(tenant_id=str(uuid.uuid4()))), Reason.UNKNOWN_TENANT),
        (orjson.dumps(event(model_version="gpt-9")), Reason.UNKNOWN_MODEL_VERSION),
        (orjson.dumps(event(started_at="2026-03-10T12:05:00.001+00:00")), Reason.FUTURE_STARTED_AT),
        (orjson.dumps(event(started_at="2026-02-07T23:59:59.999+00:00")), Reason.EXPIRED),
    ],
)
def test_every_bad_kind_is_refused_with_its_reason(raw: bytes, expected: str) -> None:
    assert expected in REASONS
    assert reason(raw) == expected


def test_uuids_are_compared_in_canonical_form() -> None:
    row = check(event(tenant_id=str(TENANT).upper(), api_key_id=KEY.hex))
    assert isinstance(row, Row)
    assert (row.tenant_id, row.api_key_id) == (str(TENANT), str(KEY))


def test_the_edges_of_the_time_window_are_accepted() -> None:
    assert isinstance(check(event(started_at="2026-03-10T12:05:00+00:00")), Row)
    assert isinstance(check(event(started_at="2026-02-08T00:00:00+00:00")), Row)


def test_a_stream_cancelled_or_failed_midway_bills_what_ran_and_was_delivered() -> None:
    # Streams keep status 200 once they started: prompt and relayed tokens are billed.
    for finish in ("cancelled", "error", "timeout"):
        row = check(event(finish_reason=finish, status=200, completion_tokens=7))
        assert isinstance(row, Row)
        assert (row.prompt_tokens, row.completion_tokens) == (100, 7)


def test_an_error_status_bills_no_completion_but_the_prefill_that_ran() -> None:
    # A JSON client that left (499) or a replica failure mid-generation (502): the client
    # received no output, so no completion tokens; the prefill the gateway saw run is billed.
    row = check(event(finish_reason="cancelled", status=499, completion_tokens=40))
    assert isinstance(row, Row)
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (100, 30, 0)


def test_a_request_refused_before_any_prefill_is_billed_nothing() -> None:
    # What the gateway reports when the replica refused it or was never reached.
    row = check(
        event(
            finish_reason="error",
            status=503,
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            ttft_ms=None,
        )
    )
    assert isinstance(row, Row)
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (0, 0, 0)


def test_billed_tokens_depend_only_on_the_error_status() -> None:
    assert billed_tokens(status=200, prompt_tokens=5, cached_tokens=2, completion_tokens=3) == (
        billed_tokens(status=201, prompt_tokens=5, cached_tokens=2, completion_tokens=3)
    )
    assert (
        billed_tokens(
            status=504, prompt_tokens=5, cached_tokens=2, completion_tokens=3
        ).completion_tokens
        == 0
    )
