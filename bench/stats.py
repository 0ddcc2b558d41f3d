"""Latency statistics, SLO attainment and goodput, in model time.

The SLO (docs/design.md §1): TTFT p95 < 1 s and TPOT p95 < 50 ms. Per request we say it
met the SLO when it completed, its TTFT was under 1 s and its mean TPOT under 50 ms; a
refused (429/503) or failed request did not meet it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from emulator.profiles import LLAMA_70B_TP4_H100, Profile

TTFT_SLO_S = 1.0
TPOT_SLO_S = 0.050


def lone_prefill_feasible(
    prompt_tokens: int, profile: Profile = LLAMA_70B_TP4_H100, ttft_s: float = TTFT_SLO_S
) -> bool:
    """Could this prompt meet the TTFT SLO at all on this hardware model: its lone prefill
    (no queue, no batch alongside) on the (real, not coarse-grained) ``profile`` takes under
    ``ttft_s``. The reserved class's promise (docs/operations.md, "Capacity") is both SLOs on
    99.9 % of the requests for which this holds."""
    return profile.prefill_seconds(prompt_tokens) < ttft_s


@dataclass(slots=True)
class Outcome:
    """One request's result, all times in model seconds (wall × speed)."""

    request_id: str
    tenant_id: str
    admission_class: str
    status: int  # HTTP status; 0 = transport failure / not sent
    sent_s: float  # model seconds since the start of the arm
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean inter-token time of this request
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    retry_after_s: float | None = None
    attempts: int = 1  # HTTP attempts: 1 + the client's retries (bench/loadgen.py)
    retry_cut: bool = False  # cut off at the deadline while waiting to retry a refusal
    # Each refused attempt's (429/503) clause and wait told, in order: the gateway's
    # ``x-fairway-refusal-clause`` header (a long-context 503's budget clause; a response
    # without one: its error code, else its status) and its retry-after in model seconds
    # (None when it had none).
    refusals: list[tuple[str, float | None]] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None

    @property
    def refused(self) -> bool:
        """Finally refused (429/503): the client made its last attempt, or made no retries.
        One cut off while it waited to retry is not: it counts as cut off (failed)."""
        return self.status in (429, 503) and not self.retry_cut

    def met_slo(self, ttft_slo: float = TTFT_SLO_S, tpot_slo: float = TPOT_SLO_S) -> bool:
        if not self.completed or self.ttft_s is None:
            return False
        if self.ttft_s >= ttft_slo:
            return False
        # A one-token answer has no inter-token gap: only TTFT applies.
        return self.tpot_s is None or self.tpot_s < tpot_slo


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The benchmarks' one percentile convention: ``q`` in 0..100, interpolated linearly
    between the two closest ranks (numpy's default, the "type 7" estimator of R and of
    spreadsheets' PERCENTILE), so p50 of [1, 2, 3, 4] is 2.5; NaN for no data (rendered as
    '—'). Every report, table and check in bench/ goes through it."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q))


def ratio_interval(
    xs: Sequence[float] | np.ndarray,
    ys: Sequence[float] | np.ndarray,
    q: float = 95.0,
    *,
    level: float = 0.95,
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """A bootstrap interval for ``percentile(xs, q) / percentile(ys, q)``: each sample
    resampled with replacement ``draws`` times, independently, and the central ``level`` of
    the resampled ratios (the percentile method). It says how far a ratio of two p95s of a
    couple of hundred requests moves by sampling alone: a measured 1.15x whose interval is
    0.92-1.38 cannot tell a real 15 % from none. (NaN, NaN) when either sample is empty."""
    if len(xs) == 0 or len(ys) == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    px = np.percentile(x[rng.integers(0, len(x), size=(draws, len(x)))], q, axis=1)
    py = np.percentile(y[rng.integers(0, len(y), size=(draws, len(y)))], q, axis=1)
    ratios = px / py
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


def _binomial_upper_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space from k up."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    return sum(
        math.exp(base - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lp + (n - j) * lq)
        for j in range(k, n + 1)
    )


def clopper_pearson_lower(successes: int, n: int, level: float = 0.95) -> float:
    """The exact (Clopper-Pearson) one-sided lower confidence bound on a success rate after
    ``successes`` of ``n`` trials: the smallest p at which seeing at least ``successes``
    still has probability ``1 - level`` (0 when there is no success; ``(1 - level) ** (1/n)``
    when every trial succeeded). With ``level=0.95``, 1,279 of 1,280 gives 99.63 %: a
    measured 99.92 % that does not show 99.9 %; showing 99.9 % with no miss takes 2,995
    trials. NaN for no trials."""
    if n <= 0:
        return math.nan
    if not 0 <= successes <= n:
        raise ValueError(f"successes {successes} outside 0..{n}")
    alpha = 1.0 - level
    if successes == 0:
        return 0.0
    if successes == n:
        return float(alpha ** (1.0 / n))
    lo, hi = 0.0, 1.0  # the tail grows with p: bisect for tail(p) = alpha
    for _ in range(100):
        mid = (lo + hi) / 2
        if _binomial_upper_tail(successes, n, mid) < alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True, slots=True)
class Dist:
    n: int
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Dist:
        xs = [v for v in values if v is not None]
        return cls(len(xs), percentile(xs, 50), percentile(xs, 95), percentile(xs, 99))


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Everything the reports show for one group of requests (a tenant or a class)."""

    name: str
    sent: int
    completed: int
    refused_429: int
    refused_503: int
    failed: int  # other statuses, transport errors, in-stream errors, cut off at the deadline
    ttft: Dist
    tpot: Dist
    attainment: float  # share of sent requests that met the SLO
    goodput_rps: float  # SLO-meeting requests per model second
    goodput_tps: float  # output tokens of SLO-meeting requests per model second

    @classmethod
    def of(cls, name: str, outcomes: Sequence[Outcome], duration_s: float) -> GroupStats:
        done = [o for o in outcomes if o.completed]
        good = [o for o in outcomes if o.met_slo()]
        n429 = sum(1 for o in outcomes if o.refused and o.status == 429)
        n503 = sum(1 for o in outcomes if o.refused and o.status == 503)
        return cls(
            name=name,
            sent=len(outcomes),
            completed=len(done),
            refused_429=n429,
            refused_503=n503,
            failed=len(outcomes) - len(done) - n429 - n503,
            # Requests cut off before their first token count with their wait so far.
            ttft=Dist.of(o.ttft_s for o in outcomes if o.ttft_s is not None),
            tpot=Dist.of(o.tpot_s for o in done),
            attainment=(len(good) / len(outcomes)) if outcomes else math.nan,
            goodput_rps=len(good) / duration_s if duration_s > 0 else math.nan,
            goodput_tps=sum(o.completion_tokens for o in good) / duration_s
            if duration_s > 0
            else math.nan,
        )


@dataclass(frozen=True, slots=True)
class RetryCounts:
    """What the client's retries (bench/loadgen.py) did for a group of requests: served on
    the first attempt, served after one or more retries, finally refused (429/503), cut off
    at the deadline while waiting to retry, and the retries made in all."""

    first_try: int
    after_retries: int
    refused: int
    cut_waiting: int
    retries: int

    @classmethod
    def of(cls, outcomes: Iterable[Outcome]) -> RetryCounts:
        outs = list(outcomes)
        return cls(
            first_try=sum(o.completed and o.attempts <= 1 for o in outs),
            after_retries=sum(o.completed and o.attempts > 1 for o in outs),
            refused=sum(o.refused for o in outs),
            cut_waiting=sum(o.retry_cut for o in outs),
            retries=sum(max(0, o.attempts - 1) for o in outs),
        )

    def cell(self) -> str:
        cut = f", {self.cut_waiting} cut waiting" if self.cut_waiting else ""
        return (
            f"{self.first_try} / {self.after_retries} / {self.refused} "
            f"({self.retries} retries{cut})"
        )


RETRY_HEADER = "served 1st try / after retries / finally refused (retries made)"


def group_by(
    outcomes: Iterable[Outcome], key: Callable[[Outcome], str]
) -> dict[str, list[Outcome]]:
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(key(o), []).append(o)
    return groups


def within(value: float, reference: float, tolerance: float) -> bool:
    """``value`` is at most ``reference`` × (1 + tolerance); NaNs never pass."""
    if math.isnan(value) or math.isnan(reference):
        return False
    return value <= reference * (1.0 + tolerance)


def rolling_percentile(
    times: Sequence[float], values: Sequence[float], window_s: float, q: float, step_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile ``q`` of ``values`` over a sliding window of event ``times``, for plots."""
    if len(times) == 0:
        return np.empty(0), np.empty(0)
    t = np.asarray(times, dtype=float)
    v = np.asarray(values, dtype=float)
    order = np.argsort(t)
    t, v = t[order], v[order]
    grid = np.arange(t[0] + window_s, t[-1] + step_s, step_s)
    out = np.full(len(grid), np.nan)
    lo_idx = np.searchsorted(t, grid - window_s, side="left")
    hi_idx = np.searchsorted(t, grid, side="right")
    for i, (lo, hi) in enumerate(zip(lo_idx, hi_idx, strict=True)):
        if hi > lo:
            out[i] = np.percentile(v[lo:hi], q)
    return grid, out


def fmt_ms(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def fmt_pct(share: float, digits: int = 1) -> str:
    return "—" if math.isnan(share) else f"{share * 100:.{digits}f} %"


def max_min_shares(demand: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of ``capacity`` among ``demand`` (water-filling): a tenant that
    asks for less than an equal split of what is left gets what it asks for, the rest share
    the remainder equally; nobody gets more than it asks for."""
    out: dict[str, float] = {}
    left = float(capacity)
    order = sorted(demand, key=lambda k: demand[k])
    for i, who in enumerate(order):
        out[who] = min(float(demand[who]), max(left, 0.0) / (len(order) - i))
        left -= out[who]
    return out
