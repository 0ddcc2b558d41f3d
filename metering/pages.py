"""Time-bucket paging for the usage and costs reports.

A report covers ``[start, end)`` cut into contiguous buckets of one width, aligned to the UTC
grid of that width. The rollup is hourly, so a range is widened to whole buckets (the start
floored, the end ceiled) and every bucket says exactly which interval it covers. A page is
``limit`` consecutive buckets; its cursor is the start of the next bucket, so pages do not
shift when usage arrives between two calls and every bucket is served exactly once.

Times stay integer Unix seconds here; ``MAX_TIME`` keeps every bucket boundary a valid
``datetime`` (its end is ceiled onto the grid, which never passes a day-aligned maximum).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

HOUR = 3600
DAY = 86400
WIDTHS = {"1h": HOUR, "1d": DAY}
MAX_TIME = 253402214400  # 9999-12-31T00:00:00Z, day-aligned
_CURSOR_VERSION = "v1"
_CURSOR_RE = re.compile(r"^v1\.(1h|1d)\.(\d{1,12})$")


class PageError(ValueError):
    """A paging input that cannot be served; ``param`` names the query parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class PageWindow:
    start: int  # first bucket's start
    end: int  # last bucket's end (exclusive)
    width: int
    has_more: bool
    next_page: str | None

    @property
    def bucket_starts(self) -> range:
        return range(self.start, self.end, self.width)


def floor_to(t: int, width: int) -> int:
    return t - t % width


def ceil_to(t: int, width: int) -> int:
    return -(-t // width) * width


def encode_cursor(bucket_width: str, bucket_start: int) -> str:
    raw = f"{_CURSOR_VERSION}.{bucket_width}.{bucket_start}".encode("ascii")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str, bucket_width: str) -> int:
    """The bucket start a cursor points at; PageError for anything we did not issue."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        raw = base64.urlsafe_b64decode(padded.encode("ascii")).decode("ascii")
    except (binascii.Error, UnicodeError, ValueError):
        raise PageError("page", "Not a page cursor this API issued.") from None
    match = _CURSOR_RE.match(raw)
    if match is None:
        raise PageError("page", "Not a page cursor this API issued.")
    if match.group(1) != bucket_width:
        raise PageError(
            "page", f"This cursor was issued for bucket_width={match.group(1)}, not {bucket_width}."
        )
    return int(match.group(2))


def plan_page(
    *,
    start_time: int,
    end_time: int | None,
    bucket_width: str,
    limit: int,
    cursor: str | None,
    now: int,
) -> PageWindow:
    """The buckets one page serves. Without ``end_time``: up to the end of the bucket that
    holds ``now``, so the current, still-filling bucket is included."""
    width = WIDTHS[bucket_width]
    if end_time is not None and end_time <= start_time:
        raise PageError("end_time", "end_time must be after start_time.")
    start = floor_to(start_time, width)
    if end_time is None:
        current_end = floor_to(min(now, MAX_TIME - 1), width) + width
        end = max(current_end, start)  # a start in the future: an empty page
    else:
        end = ceil_to(end_time, width)
    first = start
    if cursor is not None:
        first = decode_cursor(cursor, bucket_width)
        if first % width or not start <= first < end:
            raise PageError("page", "This cursor does not belong to this time range.")
    last = min(first + limit * width, end)
    has_more = last < end
    return PageWindow(
        start=first,
        end=last,
        width=width,
        has_more=has_more,
        next_page=encode_cursor(bucket_width, last) if has_more else None,
    )
