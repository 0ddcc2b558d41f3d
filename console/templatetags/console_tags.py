"""Small presentation helpers: times for the viewer's clock, exact money, percentages."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import template
from django.contrib.humanize.templatetags.humanize import intcomma
from django.utils.html import format_html
from django.utils.safestring import mark_safe

register = template.Library()


@register.filter
def ts(value: datetime | date | int | None, kind: str = "") -> str:
    """``<time datetime=…>`` in UTC; console.js rewrites the text to local time and keeps
    the UTC time as the title. Without JavaScript the UTC time shows."""
    if value is None or value == "":
        return mark_safe('<span class="muted">—</span>')  # noqa: S308 - a constant
    if isinstance(value, int):
        value = datetime.fromtimestamp(value, tz=UTC)
    if isinstance(value, datetime):
        value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        iso = value.strftime("%Y-%m-%dT%H:%M:%SZ")
        text = value.strftime("%Y-%m-%d %H:%M UTC")
        extra = ""
    else:
        iso = value.isoformat()
        text = iso
        extra = " data-date"
    if kind == "date":
        extra = " data-date"
    return format_html('<time datetime="{}" data-local{}>{}</time>', iso, extra, text)


@register.filter
def money(value: Decimal | None, currency: str = "usd") -> str:
    """Exact amounts shown to the cent (rounded half-up for display only) with separators."""
    if value is None:
        return "—"
    cents = Decimal(value).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    sign = "-" if cents < 0 else ""
    whole, frac = f"{abs(cents):.2f}".split(".")
    symbol = "$" if currency.lower() == "usd" else f"{currency.upper()} "
    return f"{sign}{symbol}{intcomma(int(whole))}.{frac}"


@register.filter
def num(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return intcomma(round(value, 1))
    return str(intcomma(int(value)))


@register.filter
def get(mapping: dict[str, Any] | None, key: str) -> Any:
    return None if mapping is None else mapping.get(key)


@register.filter
def sum_values(values: Any) -> float:
    return sum(values or ())
