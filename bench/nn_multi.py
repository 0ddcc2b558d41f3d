"""Noisy neighbour with several flooding tenants at once: Fairway with long-context isolation
(arm ``c``) against Fairway without it (``c0``), each against the quiet baseline of the same
seed, for each number of flooding tenants.

Run by ``python -m bench.noisy_neighbour --noisy-tenants 1,2,4 --seeds 7,8,9``; writes
bench/results/noisy_neighbour_multi.md. What is checked, per run (arm c):

- every non-noisy tenant's TTFT p95 <= 1.10x and TPOT p95 <= 1.05x its quiet p95;
- both SLOs held (TTFT p95 < 1 s, TPOT p95 < 50 ms) by every non-noisy tenant;
- the shared pool's KV occupancy never above the standard ceiling (0.85);
- the flooding tenants' served prompt tokens (their completed requests' prompts: a long
  context's cost is its prefill), largest <= 2x smallest;
- enterprise attainment over all its requests and over those whose prompt could meet the
  TTFT SLO on this hardware model (the prompt's lone prefill under 1 s), the second >= 99.9 %.

Each ratio comes with its 95 % bootstrap interval (``bench.stats.ratio_interval``): a p95
of a couple of hundred requests moves by sampling alone, and a 2-minute run cannot tell a
real 1.10x from noise when the interval spans both. Two more views separate the two: the
arm ``quiet2`` runs the quiet workload again and is compared with the first like any arm
(the run-to-run noise floor, wall clock included), and a pooled table puts each tenant's
requests of every seed together (three seeds: three times the requests per p95). With
``quiet2`` in the arms, it runs first in each run and every other arm of the run is compared
with both quiet runs pooled (``Baseline``: the same seeded workload twice, twice the samples
per baseline p95); the marks then use that pooled baseline, the ratio against the first quiet
run alone stays beside it, and quiet2 itself is compared with the first alone.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import cluster
from bench.nn_trace import LONG_PROMPT_TOKENS
from bench.noisy_neighbour import (
    ARM_TITLES,
    QUIET_ARMS,
    ArmResult,
    NNConfig,
    coarse_profile,
    hold_note,
    run_arm,
    summarise,
    tenants,
)
from bench.stats import (
    RETRY_HEADER,
    TPOT_SLO_S,
    TTFT_SLO_S,
    Outcome,
    RetryCounts,
    lone_prefill_feasible,
    percentile,
    ratio_interval,
)
from bench.workload import NOISY_PROMPT_TOKENS, build_workload
from emulator.profiles import LLAMA_70B_TP4_H100
from gateway.admission.long_context import LongContextClause

STANDARD_CEILING = 0.85


def _shared_peak(res: ArmResult, shared: int) -> float:
    peaks = [
        max(res.traces[f"r{i}"].occupancy)
        for i in range(shared)
        if f"r{i}" in res.traces and res.traces[f"r{i}"].occupancy
    ]
    return max(peaks) if peaks else math.nan


def _ratio(x: float, quiet: float) -> float:
    return x / quiet if quiet and math.isfinite(quiet) and math.isfinite(x) else math.nan


def _lone_128k_s() -> float:
    return LLAMA_70B_TP4_H100.prefill_seconds(NOISY_PROMPT_TOKENS)


def long_prompts_servable(cfg: NNConfig, window_s: float) -> float:
    """How many flooding prompts the fleet can prefill in ``window_s`` model seconds at
    most: one at a time on each replica designated for long contexts (the gateway's
    default share of the shared replicas), each taking its lone prefill time on the real
    profile."""
    from gateway.admission.config import AdmissionConfig
    from gateway.admission.placement import long_context_replicas

    designated = long_context_replicas(cfg.shared_replicas, AdmissionConfig())
    return designated * window_s / _lone_128k_s()


def ttft_samples(outs: Sequence[Outcome], tenant_id: str) -> list[float]:
    """The TTFTs ``GroupStats`` takes its p95 of (cut-off requests with their wait so far)."""
    return [o.ttft_s for o in outs if o.tenant_id == tenant_id and o.ttft_s is not None]


def tpot_samples(outs: Sequence[Outcome], tenant_id: str) -> list[float]:
    return [
        o.tpot_s for o in outs if o.tenant_id == tenant_id and o.completed and o.tpot_s is not None
    ]


@dataclass(frozen=True, slots=True)
class Refused:
    """A tenant's refused requests (they have no TTFT or TPOT, so its percentiles leave
    them out): 429s, 503s, and the long prompts (>= ``LONG_PROMPT_TOKENS``) it sent with
    how many of them the long-context budget refused (503 ``long_context_capacity``)."""

    r429: int
    r503: int
    long_refused: int
    long_sent: int

    def cell(self) -> str:
        return f"{self.r429} / {self.r503} ({self.long_refused} of {self.long_sent} long)"


def _long_context_refusal(error: str | None) -> bool:
    """The gateway's 503 ``long_context_capacity`` (gateway/admission/controller.py). The
    load generator keeps a body's first 300 characters, which its long message fills before
    the code, so its opening words count too."""
    return error is not None and (
        "long_context_capacity" in error or "long-context capacity" in error
    )


def refused_counts(outs: Sequence[Outcome], tenant_id: str) -> Refused:
    mine = [o for o in outs if o.tenant_id == tenant_id]
    long = [o for o in mine if o.prompt_tokens >= LONG_PROMPT_TOKENS]
    return Refused(
        r429=sum(o.refused and o.status == 429 for o in mine),
        r503=sum(o.refused and o.status == 503 for o in mine),
        long_refused=sum(
            o.refused and o.status == 503 and _long_context_refusal(o.error) for o in long
        ),
        long_sent=len(long),
    )


def _budget_long(o: Outcome, noisy_ids: set[str]) -> bool:
    """A long prompt of a tenant that does not flood and draws on the long-context budget
    (reserved tenants do not: bench/results/nn_lane/README.md counts the standard tenants')."""
    return (
        o.tenant_id not in noisy_ids
        and o.admission_class != "reserved"
        and o.prompt_tokens >= LONG_PROMPT_TOKENS
    )


def _final_long_refusals(outs: Sequence[Outcome], noisy_ids: set[str]) -> list[Outcome]:
    """Those long prompts finally refused by the long-context budget (the "(n of m long)"
    count of ``refused_counts``)."""
    return [
        o
        for o in outs
        if _budget_long(o, noisy_ids)
        and o.refused
        and o.status == 503
        and _long_context_refusal(o.error)
    ]


CLAUSE_LABELS = frozenset(c.label for c in LongContextClause)


def _counted(counts: Counter[str]) -> str:
    return ", ".join(f"{c} {n}" for c, n in counts.most_common()) or "—"


def clause_row(label: str, per_seed: Sequence[Sequence[Outcome]], noisy_ids: set[str]) -> str:
    """One row of the refusals-by-clause table: the long prompts of the tenants that do not
    flood and draw on the budget (``_budget_long``) finally refused per seed and pooled,
    the clause of their last refusal (the gateway's ``x-fairway-refusal-clause``,
    ``gateway.admission.long_context.LongContextClause``), the wait that refusal told, and
    every long-context refusal of those tenants' long prompts (served in the end or not)
    by clause."""
    finals = [_final_long_refusals(outs, noisy_ids) for outs in per_seed]
    long_sent = sum(_budget_long(o, noisy_ids) for outs in per_seed for o in outs)
    last = Counter(o.refusals[-1][0] if o.refusals else "unrecorded" for f in finals for o in f)
    told = [o.refusals[-1][1] for f in finals for o in f if o.refusals and o.refusals[-1][1]]
    every: Counter[str] = Counter(
        clause
        for outs in per_seed
        for o in outs
        if _budget_long(o, noisy_ids)
        for clause, _ in o.refusals
        if clause in CLAUSE_LABELS
    )
    told_cell = f"{min(told):.1f}–{max(told):.1f}" if told else "—"
    return (
        f"| {label} | {' / '.join(str(len(f)) for f in finals)} | "
        f"{sum(len(f) for f in finals)} of {long_sent} | {_counted(last)} | {told_cell} | "
        f"{_counted(every)} |"
    )


CLAUSE_HEADERS = (
    "| arm | finally refused, per seed | pooled | clause of the last refusal | "
    "last wait told (s) | every long-context refusal of these prompts, by clause |",
    "| --- | --- | --- | --- | --- | --- |",
)


REFUSED_HEADERS = (
    f"refused 429 / 503 (long-context 503s of prompts ≥ {LONG_PROMPT_TOKENS:,} tokens)",
    "refused (quiet)",
    RETRY_HEADER,
    "(quiet)",
)
REFUSED_NOTE = (
    "Refused requests (429, 503: refused on the client's last attempt) have no TTFT or TPOT: "
    "they are not in the p95s and ratios above. A request served after retries has its TTFT "
    "from its first attempt; one cut off at the deadline while waiting to retry counts its "
    "wait as a TTFT lower bound, not as refused."
)


def _retry_cell(outs: Sequence[Outcome], tenant_id: str) -> str:
    return RetryCounts.of(o for o in outs if o.tenant_id == tenant_id).cell()


def _interval(xs: Sequence[float], ys: Sequence[float]) -> str:
    lo, hi = ratio_interval(xs, ys)
    return "—" if math.isnan(lo) else f"{lo:.2f}–{hi:.2f}"


@dataclass(frozen=True, slots=True)
class Baseline:
    """What an arm of one run (a seed, a number of flooders) is compared with: the run's
    first quiet arm and, when the run has them, its further quiet arms (``quiet2``). Those
    replay the same seeded quiet workload, so their requests are draws from the same
    distribution: pooled, a tenant's p95 rests on k times the samples (the free tenant's
    ~55 per run make its p95 about the third largest value, and one quiet run's p95 moves
    by 1.3-1.5x between identical runs: bench/results/nn_noise_floor/,
    bench/results/nn_multi_lane/README.md "Why the free tenant")."""

    first: ArmResult
    more: tuple[ArmResult, ...] = ()

    @property
    def runs(self) -> tuple[ArmResult, ...]:
        return (self.first, *self.more)

    @property
    def pooled(self) -> bool:
        return bool(self.more)

    @property
    def outcomes(self) -> list[Outcome]:
        return [o for r in self.runs for o in r.outcomes]

    def label(self) -> str:
        """``quiet`` alone, or ``quiet + quiet2 pooled``."""
        return " + ".join(r.arm for r in self.runs) + (" pooled" if self.pooled else "")

    def result(self) -> ArmResult:
        """The pooled runs as one arm (the first itself when there is no other)."""
        if not self.pooled:
            return self.first
        return dataclasses.replace(self.first, arm=self.label(), outcomes=self.outcomes)

    def sample_counts(self, tenant_ids: Sequence[str]) -> str:
        """Per tenant, its TTFT and TPOT samples in each quiet run: ``free 55+54 / 55+54``."""
        return ", ".join(
            f"{tid} "
            + " / ".join(
                "+".join(str(len(samples(r.outcomes, tid))) for r in self.runs)
                for samples in (ttft_samples, tpot_samples)
            )
            for tid in tenant_ids
        )


def as_baseline(quiet: ArmResult | Baseline) -> Baseline:
    return quiet if isinstance(quiet, Baseline) else Baseline(quiet)


def baseline_note(base: Baseline, tenant_ids: Sequence[str]) -> str:
    """The sentence under a per-run table that compares with a pooled baseline."""
    return (
        f"Baseline of the ratios and of the marks: {base.label()} — the {len(base.runs)} quiet "
        "runs of this seed and flooder count replay the same seeded workload, so their "
        "requests are pooled into one sample per tenant (TTFT / TPOT samples per quiet run: "
        f"{base.sample_counts(tenant_ids)}). Beside it, the ratio against the first quiet "
        f"run ({base.first.arm}) alone; the 95 % bootstrap interval after each ratio. The "
        f"quiet refusal and retry counts are {base.first.arm}'s."
    )


def _worse(worst: float, ratio: float) -> float:
    # a ratio that cannot be formed (no quiet baseline, nothing served) fails the check
    return max(worst, ratio if math.isfinite(ratio) else math.inf)


def _p95_ratio(xs: Sequence[float], ys: Sequence[float]) -> float:
    return _ratio(percentile(xs, 95), percentile(ys, 95))


@dataclass(frozen=True, slots=True)
class Worst:
    """The worst pooled TTFT and TPOT ratios over the tenants, against the baseline (the
    pooled quiet runs when there are several) and against the first quiet runs alone."""

    ttft: float
    tpot: float
    ttft_first: float
    tpot_first: float


def pooled_worst(
    runs: Sequence[tuple[ArmResult, ArmResult | Baseline]], noisy_ids: set[str]
) -> Worst:
    arm_outs = [o for res, _ in runs for o in res.outcomes]
    bases = [as_baseline(q) for _, q in runs]
    base_outs = [o for b in bases for o in b.outcomes]
    first_outs = [o for b in bases for o in b.first.outcomes]
    worst = [0.0, 0.0, 0.0, 0.0]
    for tid in sorted({o.tenant_id for o in arm_outs} - noisy_ids):
        for i, samples in enumerate((ttft_samples, tpot_samples)):
            xs = samples(arm_outs, tid)
            worst[i] = _worse(worst[i], _p95_ratio(xs, samples(base_outs, tid)))
            worst[2 + i] = _worse(worst[2 + i], _p95_ratio(xs, samples(first_outs, tid)))
    return Worst(*worst)


def pooled_lines(
    runs: Sequence[tuple[ArmResult, ArmResult | Baseline]], noisy_ids: set[str]
) -> tuple[list[str], float, float]:
    """Per non-noisy tenant, the p95 ratios over the requests of every run pooled (each
    run's arm against its own baseline), with bootstrap intervals; and the worst pooled
    TTFT and TPOT ratios. A run's baseline is its quiet arm, or a ``Baseline`` pooling its
    quiet arms: then each ratio is against every seed's quiet runs together, with the
    baseline's sample size and the ratio against the first quiet runs alone beside it. The
    refusal and retry counts of the quiet side are the first quiet runs' either way."""
    arm_outs = [o for res, _ in runs for o in res.outcomes]
    bases = [as_baseline(q) for _, q in runs]
    pooled = any(b.pooled for b in bases)
    base_outs = [o for b in bases for o in b.outcomes]
    quiet_outs = [o for b in bases for o in b.first.outcomes]
    tenant_ids = sorted({o.tenant_id for o in arm_outs} - noisy_ids)
    lines: list[str] = []
    for tid in tenant_ids:
        cells = []
        for samples in (ttft_samples, tpot_samples):
            xs, ys = samples(arm_outs, tid), samples(base_outs, tid)
            ratio = _p95_ratio(xs, ys)
            if not pooled:
                cells.append(f"{_fmt(ratio)}x ({_interval(xs, ys)}), n={len(xs)}")
                continue
            firsts = samples(quiet_outs, tid)
            cells += [
                f"{_fmt(ratio)}x ({_interval(xs, ys)}), n={len(xs)} vs {len(ys)}",
                f"{_fmt(_p95_ratio(xs, firsts))}x ({_interval(xs, firsts)}), "
                f"n={len(xs)} vs {len(firsts)}",
            ]
        cells += [refused_counts(outs, tid).cell() for outs in (arm_outs, quiet_outs)]
        cells += [_retry_cell(outs, tid) for outs in (arm_outs, quiet_outs)]
        lines.append(f"| {tid} | " + " | ".join(cells) + " |")
    worst = pooled_worst(runs, noisy_ids)
    return lines, worst.ttft, worst.tpot


def _attainment(outs: Sequence[Outcome]) -> float:
    return sum(o.met_slo() for o in outs) / len(outs) if outs else math.nan


def _fmt(x: float, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def evaluate(
    res: ArmResult,
    quiet: ArmResult | Baseline,
    cfg: NNConfig,
    specs: Sequence[object],
) -> tuple[list[str], dict[str, bool | None]]:
    """Table lines and the target verdicts of one arm against its baseline: the run's quiet
    arm, or a ``Baseline`` pooling its quiet arms. With a pooled baseline the ratios and the
    marks are against it, each tenant's row adds its ratios against the first quiet arm
    alone, a sentence names the baseline and its sample sizes, and two more verdicts (for
    information) say whether the ratio checks hold against the first quiet arm alone."""
    base = as_baseline(quiet)
    pooled = base.pooled
    first = base.first
    by_tenant, _ = summarise(res, specs)  # type: ignore[arg-type]
    base_by_tenant, _ = summarise(base.result(), specs)  # type: ignore[arg-type]
    first_by_tenant, _ = summarise(first, specs)  # type: ignore[arg-type]
    base_outs = base.outcomes
    noisy_ids = [t.tenant_id for t in specs if t.noisy]  # type: ignore[attr-defined]
    lines: list[str] = []
    worst_ttft = worst_tpot = worst_ttft_first = worst_tpot_first = 0.0
    # the tenant and interval of each worst ratio (a miss whose interval holds the bound is
    # inside the noise)
    worst_at: dict[str, tuple[float, str, str]] = {}
    slo_ok = True
    for tid, g in by_tenant.items():
        if tid in noisy_ids:
            continue
        q = base_by_tenant.get(tid)
        r_ttft = _ratio(g.ttft.p95, q.ttft.p95 if q else math.nan)
        r_tpot = _ratio(g.tpot.p95, q.tpot.p95 if q else math.nan)
        worst_ttft = _worse(worst_ttft, r_ttft)
        worst_tpot = _worse(worst_tpot, r_tpot)
        held = g.ttft.p95 < TTFT_SLO_S and g.tpot.p95 < TPOT_SLO_S
        slo_ok = slo_ok and held
        i_ttft = _interval(ttft_samples(res.outcomes, tid), ttft_samples(base_outs, tid))
        i_tpot = _interval(tpot_samples(res.outcomes, tid), tpot_samples(base_outs, tid))
        ttft_cell = f"{g.ttft.p95 * 1000:.0f} ({r_ttft:.2f}x; {i_ttft})"
        tpot_cell = f"{g.tpot.p95 * 1000:.1f} ({r_tpot:.2f}x; {i_tpot})"
        if pooled:
            f = first_by_tenant.get(tid)
            f_ttft = _ratio(g.ttft.p95, f.ttft.p95 if f else math.nan)
            f_tpot = _ratio(g.tpot.p95, f.tpot.p95 if f else math.nan)
            worst_ttft_first = _worse(worst_ttft_first, f_ttft)
            worst_tpot_first = _worse(worst_tpot_first, f_tpot)
            for name, r, i in (("TTFT", r_ttft, i_ttft), ("TPOT", r_tpot, i_tpot)):
                v = r if math.isfinite(r) else math.inf
                if name not in worst_at or v > worst_at[name][0]:
                    worst_at[name] = (v, tid, i)
            fi_ttft = _interval(ttft_samples(res.outcomes, tid), ttft_samples(first.outcomes, tid))
            fi_tpot = _interval(tpot_samples(res.outcomes, tid), tpot_samples(first.outcomes, tid))
            ttft_cell += f" | {f_ttft:.2f}x; {fi_ttft}"
            tpot_cell += f" | {f_tpot:.2f}x; {fi_tpot}"
        lines.append(
            f"| {tid} | {ttft_cell} | {tpot_cell} | {g.attainment:.1%} | "
            f"{'yes' if held else 'no'} | {refused_counts(res.outcomes, tid).cell()} | "
            f"{refused_counts(first.outcomes, tid).cell()} | "
            f"{_retry_cell(res.outcomes, tid)} | {_retry_cell(first.outcomes, tid)} |"
        )
    if pooled:
        lines += ["", baseline_note(base, [t for t in by_tenant if t not in noisy_ids])]
    # Goodput of a flooding tenant: the prompt tokens of its completed requests (a long
    # context's cost is its prefill), with the completed requests and output tokens beside.
    done = {
        tid: [o for o in res.outcomes if o.tenant_id == tid and o.completed] for tid in noisy_ids
    }
    served = {tid: sum(o.prompt_tokens for o in outs) for tid, outs in done.items()}
    out_tokens = {tid: sum(o.completion_tokens for o in outs) for tid, outs in done.items()}
    refused = {tid: sum(o.refused for o in res.outcomes if o.tenant_id == tid) for tid in noisy_ids}
    flood_retries = {
        tid: RetryCounts.of(o for o in res.outcomes if o.tenant_id == tid) for tid in noisy_ids
    }
    done_any = any(o.tenant_id in noisy_ids for o in res.outcomes)  # the arm sent floods
    fair = min(served.values(), default=0) > 0 and max(served.values()) <= 2 * min(served.values())
    slots = long_prompts_servable(cfg, res.measured_s)
    ent = [o for o in res.outcomes if o.admission_class == "reserved"]
    ent_feasible = [o for o in ent if lone_prefill_feasible(o.prompt_tokens)]
    peak = _shared_peak(res, cfg.shared_replicas)
    lag = sum(t.clock_lag_s for t in res.traces.values())
    lines += ["", REFUSED_NOTE]
    lines.append(
        "Flooding tenants (served = completed requests / their prompt tokens / output tokens; "
        "refused = 429 + 503): "
        + ", ".join(
            f"`{tid}` {len(done[tid])} / {served[tid]:,} / {out_tokens[tid]:,} tok, "
            f"{refused[tid]} refused (client retries: {flood_retries[tid].cell()})"
            for tid in noisy_ids
        )
        + f". The long-context replicas can prefill at most ~{slots:.1f} such prompts in the "
        f"measured window (one at a time per designated replica, {_lone_128k_s():.1f} s "
        "each on the profile), so the fairness check compares counts of about "
        f"{slots / max(1, len(noisy_ids)):.1f} per flooder."
    )
    lines.append(
        f"Enterprise attainment {_attainment(ent):.2%} over {len(ent)} requests, "
        f"{_attainment(ent_feasible):.2%} over the {len(ent_feasible)} whose prompt's lone "
        f"prefill is under 1 s. Shared-pool peak KV occupancy {peak:.1%}. Replica clocks "
        f"skipped {lag:.1f} model-s behind the wall clock; {res.wall_s:.0f} s wall, "
        f"{res.cpu_cores:.2f} cores busy."
    )
    lines.append(_replica_spread(res, cfg.shared_replicas))
    verdicts: dict[str, bool | None] = {
        TTFT_CHECK: worst_ttft <= 1.10,
        TPOT_CHECK: worst_tpot <= 1.05,
        "both SLOs held": slo_ok,
        "shared occupancy <= 0.85": not (peak > STANDARD_CEILING),
        # None: not applicable (an arm without flooding tenants, quiet2)
        "flooders' served prompt tokens within 2x": fair if noisy_ids and done_any else None,
        "enterprise (feasible) >= 99.9 %": _attainment(ent_feasible) >= 0.999,
    }
    if pooled:
        verdicts |= {
            FIRST_ALONE_TTFT: worst_ttft_first <= 1.10,
            FIRST_ALONE_TPOT: worst_tpot_first <= 1.05,
        }
        at = {k: f" ({tid}, {i})" for k, (_, tid, i) in worst_at.items()}
        worst = (
            f"Worst ratio against {base.label()}: TTFT {worst_ttft:.2f}x{at.get('TTFT', '')}, "
            f"TPOT {worst_tpot:.2f}x{at.get('TPOT', '')}; against {first.arm} alone: TTFT "
            f"{worst_ttft_first:.2f}x, TPOT {worst_tpot_first:.2f}x. "
        )
    else:
        worst = f"Worst ratio: TTFT {worst_ttft:.2f}x, TPOT {worst_tpot:.2f}x. "
    lines.append(
        worst + " · ".join(f"{_mark(ok)} {_shown(name, pooled)}" for name, ok in verdicts.items())
    )
    return lines, verdicts


TTFT_CHECK = "TTFT p95 <= 1.10x quiet"
TPOT_CHECK = "TPOT p95 <= 1.05x quiet"
# How the two ratio checks read where the baseline is pooled quiet runs.
POOLED_CHECK_NAMES = {
    TTFT_CHECK: "TTFT p95 <= 1.10x baseline",
    TPOT_CHECK: "TPOT p95 <= 1.05x baseline",
}


def _shown(name: str, pooled: bool) -> str:
    return POOLED_CHECK_NAMES.get(name, name) if pooled else name


# The ratio checks against the first quiet arm alone, reported beside those against the
# pooled quiet arms (information: the marks that count are the pooled ones).
FIRST_ALONE_TTFT = "(first quiet alone: TTFT p95 <= 1.10x)"
FIRST_ALONE_TPOT = "(first quiet alone: TPOT p95 <= 1.05x)"


def _replica_spread(res: ArmResult, shared: int) -> str:
    """Where the routing put the work: per shared replica, the requests it finished and its
    running + waiting requests (the decode batch TPOT grows with), mean and p95 over the
    arm's samples; and the largest of them at each sample (the scraper polls every replica
    once per round), median and p95: a herd shows there and not in the means, as it moves
    from replica to replica scrape after scrape."""
    named = [(i, tr) for i in range(shared) if (tr := res.traces.get(f"r{i}")) and tr.batch]
    traces = [tr for _, tr in named]
    if not traces:
        return "Shared replicas: running + waiting not sampled."

    def p95(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(0.95 * len(xs)))]

    parts = [
        f"r{i} {tr.finished:.0f} req, batch {sum(tr.batch) / len(tr.batch):.1f} / "
        f"{p95(tr.batch):.0f}"
        for i, tr in named
    ]
    rounds = min(len(tr.batch) for tr in traces)
    largest = sorted(max(tr.batch[k] for tr in traces) for k in range(rounds))
    return (
        "Shared replicas (requests finished, running + waiting mean / p95): "
        + "; ".join(parts)
        + f". Largest running + waiting of them per sample: median {largest[rounds // 2]:.0f}, "
        f"p95 {p95(largest):.0f}."
    )


def _mark(ok: bool | None) -> str:
    return "—" if ok is None else "✅" if ok else "❌"


def run_multi(
    base: NNConfig,
    counts: Sequence[int],
    seeds: Sequence[int],
    out: Path,
    command: str,
    *,
    arms: Sequence[str] | None = None,
    load_note: str = "",
) -> Path:
    arms = list(arms or ("c", "c0"))
    arms = [a for a in arms if a != "quiet"]
    # A further quiet arm (quiet2) runs before the others of its run, which are compared
    # with every quiet arm of the run pooled (``Baseline``); it itself with the first alone.
    arms.sort(key=lambda a: a not in QUIET_ARMS)
    pooled_run = any(a in QUIET_ARMS for a in arms)
    # one file per set of arms, so a comparison run does not overwrite the main one
    name = (
        "noisy_neighbour_multi.md" if "c" in arms else f"noisy_neighbour_multi_{'_'.join(arms)}.md"
    )
    profile = coarse_profile(LLAMA_70B_TP4_H100, base.k, base.chunk_tokens)
    workdir = cluster.workdir()
    profile_file = cluster.write_profile_file([profile], workdir)
    sections: list[str] = []
    # each run's summary row: its first cells and its verdicts
    summary: list[tuple[str, dict[str, bool | None]]] = []
    # (flooders, arm) -> every seed's (arm result, its baseline), for the pooled table
    pooled: dict[tuple[int, str], list[tuple[ArmResult, Baseline]]] = {}
    noisy_ids: set[str] = set()
    started = time.time()
    try:
        with cluster.bench_redis() as redis_url:
            quiet_cache: dict[tuple[int, tuple[str, ...]], ArmResult] = {}
            for seed in seeds:
                for n in counts:
                    cfg = dataclasses.replace(base, seed=seed, noisy_tenants=n)
                    specs = tenants(cfg)
                    wl = build_workload(specs, cfg.duration_s, cfg.seed)
                    quiet_wl = wl.without_noisy()
                    key = (seed, tuple(r.request_id for r in quiet_wl.requests))
                    quiet = quiet_cache.get(key)
                    if quiet is None:
                        quiet = run_arm(
                            "quiet", cfg, quiet_wl, profile, profile_file, redis_url, workdir
                        )
                        quiet_cache[key] = quiet
                        print(f"[nn_multi] seed {seed} quiet: {quiet.wall_s:.0f} s", flush=True)
                    noisy_ids |= {t.tenant_id for t in specs if t.noisy}
                    more_quiet: list[ArmResult] = []  # this run's further quiet arms
                    for arm in arms:
                        arm_wl = quiet_wl if arm in QUIET_ARMS else wl
                        res = run_arm(arm, cfg, arm_wl, profile, profile_file, redis_url, workdir)
                        baseline = Baseline(quiet, () if arm in QUIET_ARMS else tuple(more_quiet))
                        if arm in QUIET_ARMS:
                            more_quiet.append(res)
                        pooled.setdefault((n, arm), []).append((res, baseline))
                        print(
                            f"[nn_multi] seed {seed} noisy {n} arm {arm}: {res.wall_s:.0f} s",
                            flush=True,
                        )
                        lines, verdicts = evaluate(res, baseline, cfg, specs)
                        sections += [
                            f"### {n} flooding tenant(s), seed {seed}: {ARM_TITLES[arm]}",
                            "",
                            *run_table_head(baseline),
                            *lines,
                            "",
                        ]
                        row = f"| {n} | {seed} | {arm} |"
                        if pooled_run:
                            row += f" {baseline.label()} |"
                        summary.append((row, verdicts))
                        pooled_md = _pooled_section(pooled, noisy_ids)
                        _write(out / name, command, base, counts, seeds, summary,
                               pooled_md + sections, started, load_note,
                               pooled_run=pooled_run)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out / name


def run_table_head(baseline: Baseline) -> list[str]:
    """The header of a run's per-tenant table: with a pooled baseline, a column of the ratio
    against the first quiet arm alone after each ratio."""
    if not baseline.pooled:
        return [
            "| tenant | TTFT p95 ms (× quiet) | TPOT p95 ms (× quiet) | "
            f"attainment | SLOs held | {' | '.join(REFUSED_HEADERS)} |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    label, first = baseline.label(), baseline.first.arm
    return [
        f"| tenant | TTFT p95 ms (× {label}) | TTFT × {first} alone | "
        f"TPOT p95 ms (× {label}) | TPOT × {first} alone | attainment | SLOs held | "
        f"{' | '.join(REFUSED_HEADERS)} |",
        "| --- " * 11 + "|",
    ]


def _pooled_section(
    pooled: dict[tuple[int, str], list[tuple[ArmResult, Baseline]]], noisy_ids: set[str]
) -> list[str]:
    any_pooled = any(b.pooled for runs in pooled.values() for _, b in runs)
    md = [
        "## Seeds pooled",
        "",
        "Each tenant's requests of every seed so far put together, the arm's against the quiet "
        "baselines' (p95 ratio, its 95 % bootstrap interval, and the arm's sample size).",
        "",
        "| flooders | arm | seeds | worst TTFT ratio | worst TPOT ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    if any_pooled:
        md[2] = (
            "Each tenant's requests of every seed so far put together, the arm's against the "
            "baselines' (p95 ratio, its 95 % bootstrap interval, the arm's and the baseline's "
            "sample sizes). An arm's baseline is every quiet run of its seeds pooled (quiet "
            "and quiet2 replay the same seeded workload), with the ratio against the first "
            "quiet runs alone beside it; quiet2's own is the first quiet runs (the noise "
            "floor)."
        )
        md[4:6] = [
            "| flooders | arm | seeds | baseline | worst TTFT ratio | worst TPOT ratio | "
            "worst TTFT × first quiet alone | worst TPOT × first quiet alone |",
            "| --- " * 8 + "|",
        ]
    detail: list[str] = []
    clauses = [
        "",
        f"Long prompts (≥ {LONG_PROMPT_TOKENS:,} tokens) of the tenants that do not flood "
        "(reserved ones aside: they do not draw on the budget), finally refused by the "
        "long-context budget, by the clause that refused them (the 503's "
        "`x-fairway-refusal-clause`; the wait told in model seconds):",
        "",
        *CLAUSE_HEADERS,
    ]
    quiet_rows: dict[int, str] = {}
    for (n, arm), runs in sorted(pooled.items()):
        lines, worst_ttft, worst_tpot = pooled_lines(runs, noisy_ids)
        group_pooled = any(b.pooled for _, b in runs)
        if any_pooled:
            w = pooled_worst(runs, noisy_ids)
            md.append(
                f"| {n} | {arm} | {len(runs)} | {runs[0][1].label()} | {w.ttft:.2f}x | "
                f"{w.tpot:.2f}x | {w.ttft_first:.2f}x | {w.tpot_first:.2f}x |"
            )
        else:
            md.append(f"| {n} | {arm} | {len(runs)} | {worst_ttft:.2f}x | {worst_tpot:.2f}x |")
        clauses.append(clause_row(f"{n} × {arm}", [r.outcomes for r, _ in runs], noisy_ids))
        quiet_rows.setdefault(
            n, clause_row("quiet", [b.first.outcomes for _, b in runs], noisy_ids)
        )
        if group_pooled:
            label = runs[0][1].label()
            head = [
                f"| tenant | TTFT p95 ratio × {label} (interval), n arm vs baseline | "
                "TTFT × first quiet alone | "
                f"TPOT p95 ratio × {label} (interval), n arm vs baseline | "
                f"TPOT × first quiet alone | {' | '.join(REFUSED_HEADERS)} |",
                "| --- " * 9 + "|",
            ]
        else:
            head = [
                "| tenant | TTFT p95 ratio (interval), n | TPOT p95 ratio (interval), n | "
                f"{' | '.join(REFUSED_HEADERS)} |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
        detail += [
            f"### Pooled: {n} flooding tenant(s), {ARM_TITLES[arm]}",
            "",
            *head,
            *lines,
            "",
            REFUSED_NOTE,
            "",
        ]
    # one row per distinct quiet baseline: every flooder count of a seed shares its first
    # quiet run, so the rows repeat
    clauses += list(dict.fromkeys(quiet_rows.values()))
    return [*md, *clauses, "", *detail]


def _write(
    path: Path,
    command: str,
    cfg: NNConfig,
    counts: Sequence[int],
    seeds: Sequence[int],
    summary: Sequence[tuple[str, dict[str, bool | None]]],
    sections: list[str],
    started: float,
    load_note: str = "",
    *,
    pooled_run: bool = False,
) -> None:
    """Rewritten after every arm, so a run cut short still leaves what it measured.
    ``summary``: per run, its row's first cells and its verdicts (a verdict a row does not
    have, as quiet2's against the first quiet alone, is shown as not applicable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(name for _, verdicts in summary for name in verdicts))
    rows = [
        first + " " + " | ".join(_mark(verdicts.get(name)) for name in names) + " |"
        for first, verdicts in summary
    ]
    lead = "| flooders | seed | arm | " + ("baseline | " if pooled_run else "")
    text = [
        "# Noisy neighbour — several flooding tenants at once",
        "",
        f"Command: `{command}`",
        "",
        f"{cfg.shared_replicas} shared + {cfg.reserved_replicas} reserved-pool emulated 70B "
        f"replicas (realistic profile coarse-grained ×{cfg.k}), speed ×{cfg.speed:g}, "
        f"{cfg.gateway_workers} gateway workers; each flooding tenant is a standard tenant "
        f"sending 128k-token prompts at {cfg.noisy_rps} req/s inside its own plan limits. "
        f"Counts {', '.join(map(str, counts))}; seeds {', '.join(map(str, seeds))}. "
        f"Each run's arms against the quiet baseline (no flooding tenant) of the same seed. "
        + (POOLED_NOTE + " " if pooled_run else "")
        + _client_note(cfg)
        + " "
        f"Started {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}.",
        "",
        *([load_note, ""] if load_note else []),
        lead + " | ".join(_shown(name, pooled_run) for name in names) + " |",
        "| --- " * (lead.count("|") - 1) + "| " + " | ".join("---" for _ in names) + " |",
        *rows,
        "",
        *sections,
    ]
    path.write_text("\n".join(text) + "\n")


POOLED_NOTE = (
    "The runs have a second quiet arm (quiet2: the same seeded quiet workload run again). "
    "Every other arm's baseline is both quiet runs of its seed and flooder count pooled "
    "(the same distribution, twice the samples per p95): its ratios and its two ratio "
    'checks ("<= 1.10x baseline", "<= 1.05x baseline") are against that pooled '
    "sample, named in the baseline column; its ratios against the first quiet run alone "
    "stand beside them in each run's table, and those checks, for information, in the two "
    "last columns. quiet2's baseline is the first quiet run alone: the run-to-run noise "
    "floor."
)


def _client_note(cfg: NNConfig) -> str:
    if cfg.client_retries == 0:
        return "Clients send each request once (no retries)." + hold_note(cfg)
    return (
        f"Clients retry a 429/503 up to {cfg.client_retries} times as the openai Python SDK "
        "does (bench/loadgen.py): the response's retry-after when within the SDK's 120 s, "
        "else 0.5 s, 1 s, … backoff less up to 25 % jitter; TTFT from the first attempt."
        + hold_note(cfg)
    )
