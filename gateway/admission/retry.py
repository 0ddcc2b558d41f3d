"""Retry-After jitter and the retry budget (docs/design.md R6): no two clients are told the
same instant, none is told more than 60 s (``RETRY_AFTER_CAP_MS``: the longest wait every
openai SDK release honours), and retries above a share of admitted traffic are shed first.
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Literal

from contracts.schema import AdmissionClass
from gateway.admission.config import AdmissionConfig
from gateway.errors import RETRY_AFTER_CAP_MS, retry_after_headers

# A wait past the cap (RETRY_AFTER_CAP_MS) is told as a range that ends at the cap and is this
# wide (or the jitter's own width, when less): clients refused together still come back
# spread out, not all at the cap's instant.
CAPPED_SPREAD_MS = 10_000


def told_range(base_ms: float, width_ms: float) -> tuple[float, float]:
    """The range [low, high] a retry-after is drawn from: [base, base + width], or, when that
    ends past ``RETRY_AFTER_CAP_MS``, one ending at the cap, at least
    min(width, ``CAPPED_SPREAD_MS``) wide. A wait the cap shortens means a retry that may be
    refused again; one the SDK ignores means several, sooner."""
    base, width = max(0.0, base_ms), max(0.0, width_ms)
    high = min(base + width, RETRY_AFTER_CAP_MS)
    return min(base, high - min(width, CAPPED_SPREAD_MS)), high


def jittered_ms(base_ms: float, width_ms: float, rng: random.Random) -> int:
    """Uniform over ``told_range`` (base + uniform[0, width] below the cap): no two clients
    are told the same instant, and none is told more than ``RETRY_AFTER_CAP_MS``."""
    low, high = told_range(base_ms, width_ms)
    return min(RETRY_AFTER_CAP_MS, max(1, math.ceil(low + rng.uniform(0.0, high - low))))


def quota_retry_after_ms(frees_in_ms: float, cfg: AdmissionConfig, rng: random.Random) -> int:
    """429: from when the limit frees, plus jitter proportional to the wait."""
    width = max(cfg.quota_jitter_min_ms, frees_in_ms * cfg.quota_jitter_fraction)
    return jittered_ms(frees_in_ms, width, rng)


def _long_context_window(frees_in_ms: float) -> tuple[float, float]:
    """A long-context 503's retry-after range: from when the budget frees (at least 1 s),
    plus up to half of that (at least 1 s) of jitter."""
    return max(frees_in_ms, 1000), max(1000.0, math.ceil(frees_in_ms / 2))


def long_context_retry_after_ms(frees_in_ms: float, rng: random.Random) -> int:
    """503 ``long_context_capacity``: jittered over ``_long_context_window``."""
    return jittered_ms(*_long_context_window(frees_in_ms), rng)


def long_context_retry_latest_ms(frees_in_ms: int) -> int:
    """The latest ``long_context_retry_after_ms`` can ask for, capped as it is (the admit
    script in gateway/admission/quota.py keeps a waiting tenant until then,
    ``lc_told_latest``)."""
    return int(told_range(*_long_context_window(frees_in_ms))[1])


def long_context_retry_earliest_ms(frees_in_ms: int) -> int:
    """The earliest ``long_context_retry_after_ms`` can ask for, capped as it is: when the
    refused client is due back at the earliest (the admit script records it for the
    backfill, ``lc_told``)."""
    return math.ceil(told_range(*_long_context_window(frees_in_ms))[0])


def capacity_retry_after_ms(cfg: AdmissionConfig, rng: random.Random) -> int:
    """503 (fleet full): docs/design.md R6's base 5 s + uniform[0, 5 s] by default."""
    return jittered_ms(cfg.capacity_retry_base_ms, cfg.capacity_jitter_ms, rng)


def storm_retry_after_ms(cfg: AdmissionConfig, rng: random.Random) -> int:
    """503 for a shed retry during a retry storm: uniform in [30 s, 60 s] by default."""
    lo, hi = cfg.storm_retry_after_s
    return jittered_ms(lo * 1000, (hi - lo) * 1000, rng)


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    """``retry-after`` (whole seconds, rounded up) and OpenAI's ``retry-after-ms``, capped at
    ``RETRY_AFTER_CAP_MS`` (gateway/errors.py's ``retry_after_headers``)."""
    return retry_after_headers(retry_after_ms)


def in_retry_storm(admitted: int, retries: int, cfg: AdmissionConfig) -> bool:
    """docs/design.md R6: retries above 20 % of admitted traffic over the last minute.

    A minimum volume keeps one retry on a quiet fleet from reading as a 100 % storm.
    (The Redis admit script implements the same rule; tests check them against each other.)
    """
    return admitted >= cfg.retry_budget_min_admitted and retries > cfg.retry_budget_ratio * admitted


def sheds_retry(is_retry: bool, tenant_class: AdmissionClass, storm: bool) -> bool:
    """A first attempt is a user waiting, a retry is a client library; reserved is exempt."""
    return storm and is_retry and tenant_class != "reserved"


def retry_shed(
    tenant: tuple[int, int], fleet: tuple[int, int], cfg: AdmissionConfig
) -> Literal["tenant", "fleet"] | None:
    """Which retry budget sheds a (non-reserved) retry, given (admitted, retries) over the
    window for its tenant-model and for the fleet's model version; None: admit it.

    The tenant's own budget comes first: its retries past the ratio of its own admissions
    are shed whatever the fleet does, so a tenant whose requests keep failing (or that
    marks every request a retry) spends only its own budget. The fleet's budget is the
    second line, for many small tenants each under the minimum volume: in a storm it sheds
    a retry that would take its own tenant past the ratio, never one of a tenant within it.
    (The admit script in gateway/admission/quota.py implements the same rule.)
    """
    t_adm, t_ret = tenant
    if in_retry_storm(t_adm, t_ret, cfg):
        return "tenant"
    if in_retry_storm(*fleet, cfg) and t_ret + 1 > cfg.retry_budget_ratio * (t_adm + 1):
        return "fleet"
    return None


class WindowCounts:
    """(all, flagged) counts over a sliding window of ``slots`` buckets (in-process).

    The retry budget's window when Redis is unreachable (flagged = retries), and the
    best-effort floor's window (flagged = admitted above the best-effort ceiling).
    """

    def __init__(self, window_s: float = 60.0, slots: int = 6) -> None:
        self._width = window_s / slots
        self._slots = slots
        self._buckets: deque[tuple[int, int, int]] = deque()  # (index, all, flagged)

    def _trim(self, now_s: float) -> int:
        idx = int(now_s // self._width)
        while self._buckets and self._buckets[0][0] <= idx - self._slots:
            self._buckets.popleft()
        return idx

    def counts(self, now_s: float) -> tuple[int, int]:
        self._trim(now_s)
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def record(self, now_s: float, *, flagged: bool) -> None:
        idx = self._trim(now_s)
        if self._buckets and self._buckets[-1][0] == idx:
            _, a, r = self._buckets.pop()
        else:
            a, r = 0, 0
        self._buckets.append((idx, a + 1, r + int(flagged)))
