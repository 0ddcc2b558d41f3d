"""Reads for the model registry, and the prices in force at an hour."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import OuterRef, Prefetch, QuerySet, Subquery
from django.utils import timezone

from catalog.models import ModelFamily, ModelPrice, ModelVersion

PRICE_COLUMNS = (
    "price_prompt_per_mtok",
    "price_cached_prompt_per_mtok",
    "price_completion_per_mtok",
)


def _in_force(version: Any, at: Any) -> QuerySet[ModelPrice]:
    return (
        ModelPrice.live()
        .filter(version=version, effective_from__lte=at)
        .order_by("-effective_from")
    )


def price_in_force(*, version: ModelVersion | int, at: datetime) -> ModelPrice | None:
    """The version's price row in force at ``at`` (the latest one from at or before it)."""
    return _in_force(version, at).first()


def price_history(*, version: ModelVersion) -> QuerySet[ModelPrice]:
    """The version's prices, latest effective first (scheduled and withdrawn ones included)."""
    return (
        ModelPrice.objects.filter(version=version)
        .select_related("replaces")
        .order_by("-effective_from", "-created_at")
    )


def family_list() -> QuerySet[ModelFamily]:
    """Families with their active versions, newest name last; each version carries the
    prices in force now (``price_*_per_mtok``)."""
    now = timezone.now()
    active = (
        ModelVersion.objects.filter(is_active=True)
        .annotate(
            **{
                column: Subquery(_in_force(OuterRef("pk"), now).values(column)[:1])
                for column in PRICE_COLUMNS
            }
        )
        .order_by("name")
    )
    return ModelFamily.objects.prefetch_related(
        Prefetch("versions", queryset=active, to_attr="active_versions")
    )


class PriceBook:
    """Every price in force during [start, end), read once: the hour ranges in which no
    version's price changes (``windows``), and a version's price at a time (``at``).

    Readers of ``usage`` query once per window with a plain GROUP BY and price each
    version's sums with the window's price: price changes are rare, so a month is one or a
    few windows, where a per-row lookup of the price would cost a subquery per usage row.
    """

    def __init__(self, *, start: datetime, end: datetime) -> None:
        self.start, self.end = start, end
        self._rows: dict[int, list[ModelPrice]] = {}
        cuts = set()
        for row in (
            ModelPrice.live()
            .filter(effective_from__lt=end)
            .order_by("version_id", "effective_from")
        ):
            self._rows.setdefault(row.version_id, []).append(row)
            if row.effective_from > start:
                cuts.add(row.effective_from)
        self._cuts = [start, *sorted(cuts), end]

    def windows(self) -> list[tuple[datetime, datetime]]:
        return list(itertools.pairwise(self._cuts))

    def at(self, version_id: int, when: datetime) -> ModelPrice | None:
        """The version's row in force at ``when`` (None before its first price)."""
        rows = self._rows.get(version_id, [])
        i = bisect.bisect_right([r.effective_from for r in rows], when)
        return rows[i - 1] if i else None


@dataclass(frozen=True, slots=True)
class PricePeriod:
    """A price row and the part of a window [start, end) it is in force for."""

    start: datetime
    end: datetime
    price: ModelPrice


def price_periods(
    *, version_ids: Iterable[int], start: datetime, end: datetime
) -> dict[int, list[PricePeriod]]:
    """Per version, the price rows in force during [start, end), in order, clipped to it.
    A version with no price at ``start`` has its first period start later (it never
    happens for a version written through catalog.services: its first price is from the
    epoch)."""
    ids = set(version_ids)
    rows: dict[int, list[ModelPrice]] = {v: [] for v in ids}
    for row in (
        ModelPrice.live()
        .filter(version_id__in=ids, effective_from__lt=end)
        .order_by("version_id", "effective_from")
    ):
        rows[row.version_id].append(row)
    out: dict[int, list[PricePeriod]] = {}
    for version_id, history in rows.items():
        periods: list[PricePeriod] = []
        for i, row in enumerate(history):
            until = history[i + 1].effective_from if i + 1 < len(history) else end
            lo, hi = max(row.effective_from, start), min(until, end)
            if lo < hi:
                periods.append(PricePeriod(start=lo, end=hi, price=row))
        out[version_id] = periods
    return out
