"""The one money rule: exact decimals per token type, rounded once per invoice line.

Prices are Decimal per 1,000,000 tokens (``catalog.ModelVersion``). A line's exact amount is
``tokens × price / 1,000,000`` — a Decimal with no rounding at all (at most 6 + 6 decimal
places, well inside the default 28-digit context for any realistic token count). An invoice
line is then rounded to the currency's minor unit, half up, exactly once; totals are sums of
rounded lines. Reports that are not invoices (the costs API) show exact amounts.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

TOKENS_PER_PRICE_UNIT = 1_000_000
# Minor-unit exponent per ISO-4217 currency (lower case, as Stripe writes them).
_MINOR_UNITS = {"usd": 2, "eur": 2, "gbp": 2, "jpy": 0}


def token_cost(tokens: int, price_per_mtok: Decimal) -> Decimal:
    """Exact cost of ``tokens`` at ``price_per_mtok`` (no rounding)."""
    if tokens < 0:
        raise ValueError("token counts are never negative")
    return Decimal(tokens) * price_per_mtok / TOKENS_PER_PRICE_UNIT


def minor_unit_exponent(currency: str) -> int:
    try:
        return _MINOR_UNITS[currency.lower()]
    except KeyError:
        raise ValueError(f"unsupported currency {currency!r}") from None


def round_line(amount: Decimal, currency: str) -> Decimal:
    """Round one invoice line to the currency's minor unit, half up (the only rounding)."""
    quantum = Decimal(1).scaleb(-minor_unit_exponent(currency))
    return amount.quantize(quantum, rounding=ROUND_HALF_UP)


def to_minor_units(amount: Decimal, currency: str) -> int:
    """A rounded amount as an integer count of minor units (what Stripe takes)."""
    rounded = round_line(amount, currency)
    scaled = rounded.scaleb(minor_unit_exponent(currency))
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{amount} is not a whole number of minor units")
    return int(scaled)
