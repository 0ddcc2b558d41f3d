"""Periods are UTC calendar months; amounts are exact until one half-up rounding per line."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from billing.periods import month_bounds, next_month, parse_period, previous_month
from billing.pricing import round_line, to_minor_units, token_cost
from tests.billing.conftest import utc


def test_month_bounds_are_utc_half_open() -> None:
    # 2026-12-01 00:30 in UTC+01:00 is still November 30th, 23:30 UTC.
    paris = timezone(timedelta(hours=1))
    assert month_bounds(datetime(2026, 12, 1, 0, 30, tzinfo=paris)) == (
        utc(2026, 11, 1),
        utc(2026, 12, 1),
    )
    assert month_bounds(utc(2026, 12, 31, 23, 59, 59)) == (utc(2026, 12, 1), utc(2027, 1, 1))
    assert next_month(utc(2026, 12, 1)) == utc(2027, 1, 1)
    assert previous_month(utc(2027, 1, 1)) == utc(2026, 12, 1)
    with pytest.raises(ValueError):
        month_bounds(datetime(2026, 11, 5))  # noqa: DTZ001 - naive on purpose


@pytest.mark.parametrize("text", ["2026-13", "2026-1", "26-11", "november", ""])
def test_bad_periods_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="YYYY-MM"):
        parse_period(text)


def test_half_up_to_the_minor_unit_and_minor_units() -> None:
    assert round_line(Decimal("0.005"), "usd") == Decimal("0.01")
    assert round_line(Decimal("0.0049999"), "usd") == Decimal("0.00")
    assert round_line(Decimal("12.5"), "jpy") == Decimal("13")
    assert to_minor_units(Decimal("1234.56"), "usd") == 123456
    assert to_minor_units(Decimal("-0.40"), "usd") == -40  # adjustments may be credits
    # Exact: no float anywhere (0.1 + 0.2 style drift cannot happen).
    assert token_cost(3, Decimal("0.1")) + token_cost(3, Decimal("0.2")) == token_cost(
        3, Decimal("0.3")
    )
    with pytest.raises(ValueError):
        token_cost(-1, Decimal("1"))
