"""OpenAI-shaped error bodies and the jittered Retry-After. No I/O."""

from __future__ import annotations

import orjson

from gateway.errors import BadRequest, capacity_unavailable, jittered_retry_after


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
