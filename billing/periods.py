"""Billing periods: UTC calendar months, half-open [start, end)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

_PERIOD_RE = re.compile(r"^(\d{4})-(\d{2})$")


def month_start(at: datetime) -> datetime:
    """The start of the UTC month ``at`` falls in (an aware datetime is converted to UTC)."""
    if at.tzinfo is None:
        raise ValueError("billing times are aware (UTC)")
    at = at.astimezone(UTC)
    return datetime(at.year, at.month, 1, tzinfo=UTC)


def next_month(start: datetime) -> datetime:
    if start.month == 12:
        return datetime(start.year + 1, 1, 1, tzinfo=UTC)
    return datetime(start.year, start.month + 1, 1, tzinfo=UTC)


def previous_month(start: datetime) -> datetime:
    if start.month == 1:
        return datetime(start.year - 1, 12, 1, tzinfo=UTC)
    return datetime(start.year, start.month - 1, 1, tzinfo=UTC)


def month_bounds(at: datetime) -> tuple[datetime, datetime]:
    start = month_start(at)
    return start, next_month(start)


def parse_period(text: str) -> datetime:
    """``2026-11`` -> 2026-11-01T00:00Z; ValueError with a clear message otherwise."""
    match = _PERIOD_RE.match(text.strip())
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise ValueError(f"period {text!r} is not YYYY-MM")
    return datetime(int(match.group(1)), int(match.group(2)), 1, tzinfo=UTC)


def period_label(start: datetime) -> str:
    return f"{start.astimezone(UTC):%Y-%m}"
