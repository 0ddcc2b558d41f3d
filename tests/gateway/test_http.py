"""Request-head picking: the SDK retry count. No I/O."""

from __future__ import annotations

from gateway.serving.http import pick_headers, sdk_retry


def test_sdk_retry_count_marks_retries() -> None:
    assert pick_headers({"headers": [(b"x-stainless-retry-count", b"2")]}).retry_count == b"2"
    assert [sdk_retry(v) for v in (b"1", b"12", b"0", None, b"", b"-1", b"1.5", b"x")] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
    ]
