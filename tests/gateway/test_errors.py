"""OpenAI-shaped error bodies and the jittered Retry-After. No I/O."""

from __future__ import annotations

import math
import random

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import (
    RETRY_AFTER_CAP_MS,
    BadRequest,
    RateLimited,
    capacity_unavailable,
    jittered_retry_after,
    retry_after_headers,
)


def test_error_body_is_openai_shaped() -> None:
    error = BadRequest("nope", param="messages", code="invalid_type")
    assert orjson.loads(error.body()) == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_type",
        }
    }
    assert error.status == 400


def test_retry_after_is_jittered_within_bounds() -> None:
    seen = set()
    for _ in range(200):
        headers = jittered_retry_after(5.0, 5.0)
        ms = int(headers["retry-after-ms"])
        assert 5000 <= ms <= 10000
        seen.add(ms)
    assert len(seen) > 50  # no two clients told the same instant (jitter)
    error = capacity_unavailable("busy")
    assert error.status == 503 and error.code == "capacity" and "retry-after" in error.headers


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ({"retry-after": "120"}, {"retry-after": "60", "retry-after-ms": "60000"}),
        ({"retry-after-ms": "90000"}, {"retry-after": "60", "retry-after-ms": "60000"}),
        (
            {"retry-after": "3", "retry-after-ms": "2500"},
            {"retry-after": "3", "retry-after-ms": "2500"},
        ),
        ({"retry-after": "2"}, {"retry-after": "2", "retry-after-ms": "2000"}),
        ({"x-other": "1"}, {"x-other": "1"}),
    ],
)
def test_every_refusals_retry_after_is_capped_and_said_the_same_in_both_headers(
    given: dict[str, str], sent: dict[str, str]
) -> None:
    """Whichever refusal sets a retry-after (the auth failure limiter and the idempotency
    quota write whole seconds only), the response carries both headers saying one wait, at
    most 60 s: the openai SDK reads ``retry-after-ms`` first and ignores anything longer."""
    error = RateLimited("slow down", headers=given)
    assert error.headers == sent
    assert RETRY_AFTER_CAP_MS == 60_000


@given(st.floats(min_value=0, max_value=1e9), st.floats(min_value=0, max_value=1e9))
def test_jittered_retry_after_never_above_60_s(base_s: float, spread_s: float) -> None:
    headers = jittered_retry_after(base_s, spread_s, random.Random(0))
    ms = int(headers["retry-after-ms"])
    assert 1 <= ms <= RETRY_AFTER_CAP_MS
    assert int(headers["retry-after"]) == math.ceil(ms / 1000)
    assert retry_after_headers(ms) == headers
