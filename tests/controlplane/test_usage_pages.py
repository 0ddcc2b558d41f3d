"""metering.pages: the bucket grid and the cursor, as pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering.pages import MAX_TIME, WIDTHS, PageError, decode_cursor, encode_cursor, plan_page

NOW = 1_780_000_000


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, MAX_TIME - 1),
    span=st.integers(1, 400 * 86400),
    width=st.sampled_from(list(WIDTHS)),
    limit=st.integers(1, 200),
)
def test_pages_tile_the_widened_range_exactly_once(
    start: int, span: int, width: str, limit: int
) -> None:
    end = min(start + span, MAX_TIME)
    if end <= start:
        return
    step = WIDTHS[width]
    cursor = None
    starts: list[int] = []
    for _ in range(10_000):
        window = plan_page(
            start_time=start, end_time=end, bucket_width=width, limit=limit, cursor=cursor, now=NOW
        )
        assert len(window.bucket_starts) <= limit
        starts += list(window.bucket_starts)
        if not window.has_more:
            assert window.next_page is None
            break
        cursor = window.next_page
    first, last = start - start % step, -(-end // step) * step
    assert starts == list(range(first, last, step))
    assert first <= start and end <= last  # widened, never narrowed


def test_cursor_round_trip_and_rejections() -> None:
    cursor = encode_cursor("1h", 7200)
    assert decode_cursor(cursor, "1h") == 7200
    assert cursor.isascii() and "=" not in cursor
    for bad in ["", "!!!", "djE", encode_cursor("1h", 7200) + "x", "djIuMWguNzIwMA"]:
        with pytest.raises(PageError) as caught:
            decode_cursor(bad, "1h")
        assert caught.value.param == "page"
    with pytest.raises(PageError, match="bucket_width=1h"):
        decode_cursor(cursor, "1d")


def test_default_end_includes_the_current_bucket() -> None:
    window = plan_page(
        start_time=NOW - 3600, end_time=None, bucket_width="1h", limit=24, cursor=None, now=NOW
    )
    assert window.end == NOW - NOW % 3600 + 3600 and not window.has_more
