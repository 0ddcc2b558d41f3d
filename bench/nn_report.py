"""Markdown tables, target checks and the plot of the noisy-neighbour scenario."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.noisy_neighbour import ARM_TITLES, ArmResult, NNConfig, hold_note, summarise
from bench.plots import arms_timeseries
from bench.stats import (
    RETRY_HEADER,
    TPOT_SLO_S,
    TTFT_SLO_S,
    GroupStats,
    RetryCounts,
    fmt_ms,
    fmt_pct,
    group_by,
    within,
)
from bench.workload import NOISY_PROMPT_TOKENS, TenantSpec
from emulator.profiles import Profile

TOLERANCE = 0.10  # "within 10 % of its quiet-baseline p95"
ARM_SHORT = {
    "quiet": "quiet",
    "a": "(a) unprotected",
    "b": "(b) rpm only",
    "c": "(c) Fairway",
    "fcfs": "(c) fcfs replicas",
    "cache": "(c) cache-aware",
}


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


STATS_HEADER = [
    "group", "sent", "TTFT p50/p95/p99 ms", "TPOT p50/p95/p99 ms", "SLO attainment",
    "goodput req/s", "goodput out tok/s", "429", "503", "failed",
]  # fmt: skip


def _stats_row(g: GroupStats) -> list[object]:
    t, p = g.ttft, g.tpot
    return [
        g.name,
        g.sent,
        f"{fmt_ms(t.p50)} / {fmt_ms(t.p95)} / {fmt_ms(t.p99)}",
        f"{fmt_ms(p.p50)} / {fmt_ms(p.p95)} / {fmt_ms(p.p99)}",
        fmt_pct(g.attainment),
        f"{g.goodput_rps:.2f}",
        f"{g.goodput_tps:,.0f}",
        g.refused_429,
        g.refused_503,
        g.failed,
    ]


def _peak_occupancy(res: ArmResult) -> float:
    peaks = [max(tr.occupancy) for tr in res.traces.values() if tr.occupancy]
    return max(peaks) if peaks else math.nan


def _mean_occupancy(res: ArmResult, pool_ids: Sequence[str]) -> float:
    vals = [np.mean(res.traces[r].occupancy) for r in pool_ids if res.traces[r].occupancy]
    return float(np.mean(vals)) if vals else math.nan


def _mark(ok: bool) -> str:
    return "✅" if ok else "❌"


def _ratio(value: float, ref: float) -> str:
    if math.isnan(value) or math.isnan(ref) or ref == 0:
        return "—"
    return f"{value / ref:.2f}×"


def targets(
    results: dict[str, ArmResult], specs: Sequence[TenantSpec]
) -> tuple[list[str], dict[str, bool]]:
    """The targets for arm (c) (bench/README.md), each checked and stated with its numbers."""
    lines: list[str] = []
    verdicts: dict[str, bool] = {}
    if "c" not in results or "quiet" not in results:
        return ["(targets need the quiet and c arms)"], verdicts
    tc, _ = summarise(results["c"], specs)
    tq, _ = summarise(results["quiet"], specs)
    non_noisy = [t for t in specs if not t.noisy]
    all_ok = True
    for t in non_noisy:
        c, q = tc.get(t.tenant_id), tq.get(t.tenant_id)
        if c is None or q is None:
            continue
        slo = c.ttft.p95 < TTFT_SLO_S and c.tpot.p95 < TPOT_SLO_S
        ttft_ok = within(c.ttft.p95, q.ttft.p95, TOLERANCE)
        tpot_ok = within(c.tpot.p95, q.tpot.p95, TOLERANCE)
        ok = slo and ttft_ok and tpot_ok
        all_ok &= ok
        lines.append(
            f"- {_mark(ok)} `{t.tenant_id}` ({t.plan}): TTFT p95 {fmt_ms(c.ttft.p95)} ms "
            f"(quiet {fmt_ms(q.ttft.p95)}, {_ratio(c.ttft.p95, q.ttft.p95)}), TPOT p95 "
            f"{fmt_ms(c.tpot.p95)} ms (quiet {fmt_ms(q.tpot.p95)}, "
            f"{_ratio(c.tpot.p95, q.tpot.p95)}); both SLOs {'held' if slo else 'NOT held'}"
        )
    verdicts["every non-noisy tenant holds both SLOs within 10 % of quiet p95"] = all_ok
    ent = tc.get("ent")
    if ent is not None:
        ok = ent.attainment >= 0.999
        verdicts["enterprise attainment >= 99.9 %"] = ok
        misses = [o for o in results["c"].outcomes if o.tenant_id == "ent" and not o.met_slo()]
        detail = "; ".join(
            f"prompt {o.prompt_tokens:,} tokens, TTFT {fmt_ms(o.ttft_s or math.nan)} ms, "
            f"TPOT {fmt_ms(o.tpot_s or math.nan)} ms, status {o.status}"
            for o in misses[:5]
        )
        lines.append(f"- {_mark(ok)} enterprise attainment {fmt_pct(ent.attainment, 2)} "
                     f"({ent.sent} requests) — target ≥ 99.9 %"
                     + (f". Misses: {detail}" if misses else ""))  # fmt: skip
    free = tc.get("free")
    if free is not None:
        ok = free.goodput_rps > 0
        verdicts["free goodput > 0"] = ok
        lines.append(f"- {_mark(ok)} free-tier goodput {free.goodput_rps:.2f} req/s "
                     f"({free.goodput_tps:,.0f} out tok/s)")  # fmt: skip
    # The forgotten flag: the same gateway on fcfs replicas, class by class against (c).
    if "fcfs" in results:
        _, by_c = summarise(results["c"], specs)
        _, by_f = summarise(results["fcfs"], specs)
        parts = []
        for cls in ("reserved", "standard", "best_effort"):
            c, f = by_c.get(cls), by_f.get(cls)
            if c is None or f is None:
                continue
            parts.append(
                f"{cls} TTFT p95 {fmt_ms(f.ttft.p95)} ms (priority {fmt_ms(c.ttft.p95)}), "
                f"attainment {fmt_pct(f.attainment, 2)} (priority {fmt_pct(c.attainment, 2)})"
            )
        lines.append("- arm (c) on fcfs replicas: " + "; ".join(parts))
    # (a) and (b) should show the degradation the design predicts.
    for arm in ("a", "b"):
        if arm not in results:
            continue
        ta, _ = summarise(results[arm], specs)
        worse = []
        for t in non_noisy:
            x, q = ta.get(t.tenant_id), tq.get(t.tenant_id)
            if x is None or q is None:
                continue
            worse.append(not within(x.tpot.p95, q.tpot.p95, TOLERANCE) or
                         not within(x.ttft.p95, q.ttft.p95, TOLERANCE) or
                         x.attainment < q.attainment - 0.05)  # fmt: skip
        ok = bool(worse) and all(worse)
        verdicts[f"arm ({arm}) degrades every non-noisy tenant"] = ok
        lines.append(
            f"- {_mark(ok)} arm ({arm}): {sum(worse)}/{len(worse)} non-noisy tenants degraded "
            "beyond 10 % of quiet p95 (or lost > 5 points of attainment)"
        )
    return lines, verdicts


def prefill_shadow(res: ArmResult, specs: Sequence[TenantSpec], window_s: float) -> str:
    """How much of the non-noisy TTFT tail falls in the shadow of an admitted 128k prefill.

    A 128k-token prefill takes many model seconds of a replica's chunked-prefill budget
    (``window_s``: the profile's own prefill time of such a prompt); a request that lands on
    that replica meanwhile waits for it. Compare the share of slow first tokens among
    requests sent within ``window_s`` after an admitted noisy request with the share among
    all the others.
    """
    noisy = {t.tenant_id for t in specs if t.noisy}
    admitted = sorted(o.sent_s for o in res.outcomes if o.tenant_id in noisy and o.status == 200)
    if not admitted:
        return ""
    starts = np.asarray(admitted)
    inside: list[bool] = []
    outside: list[bool] = []
    for o in res.outcomes:
        if o.tenant_id in noisy or o.ttft_s is None:
            continue
        i = np.searchsorted(starts, o.sent_s, side="right") - 1
        shadow = i >= 0 and o.sent_s - starts[i] <= window_s
        (inside if shadow else outside).append(o.ttft_s >= TTFT_SLO_S)
    if not inside or not outside:
        return ""
    share_in, share_out = fmt_pct(float(np.mean(inside))), fmt_pct(float(np.mean(outside)))
    return (
        f"Prefill shadow: {len(admitted)} noisy 128k requests were admitted; of the other "
        f"tenants' requests sent within {window_s:g} s after one, {share_in} had TTFT ≥ 1 s "
        f"({len(inside)} requests), against {share_out} of the rest ({len(outside)})."
    )


def headline(results: dict[str, ArmResult], specs: Sequence[TenantSpec]) -> list[str]:
    header = [
        "arm", "standard TTFT p95 ms", "standard TPOT p95 ms", "standard attainment",
        "enterprise attainment", "free goodput req/s", "noisy 429 / 503", "preemptions",
        "peak KV occupancy",
    ]  # fmt: skip
    rows = []
    for arm, res in results.items():
        _, by_class = summarise(res, specs)
        std, ent, free, noisy = (
            by_class.get(n) for n in ("standard", "reserved", "best_effort", "noisy")
        )
        rows.append([
            ARM_TITLES[arm],
            fmt_ms(std.ttft.p95) if std else "—",
            fmt_ms(std.tpot.p95) if std else "—",
            fmt_pct(std.attainment) if std else "—",
            fmt_pct(ent.attainment, 2) if ent else "—",
            f"{free.goodput_rps:.2f}" if free else "—",
            f"{noisy.refused_429} / {noisy.refused_503}" if noisy else "—",
            f"{res.preemptions:.0f}",
            fmt_pct(_peak_occupancy(res)),
        ])  # fmt: skip
    return _table(header, rows)


def write_report(
    results: dict[str, ArmResult], cfg: NNConfig, specs: Sequence[TenantSpec], profile: Profile,
    out: Path, command: str,
) -> Path:  # fmt: skip
    """noisy_neighbour.md (one function per section), its plot and the headline lines."""
    out.mkdir(parents=True, exist_ok=True)
    # A lone 128k prefill on this (coarse) profile, in model seconds: the shadow window.
    window_s = math.ceil(profile.prefill_seconds(math.ceil(NOISY_PROMPT_TOKENS / cfg.k)))
    target_lines, _ = targets(results, specs)
    shared_ids = [f"r{i}" for i in range(cfg.shared_replicas)]
    md = [
        *_intro(cfg, specs, profile, command),
        "## Headline\n",
        *headline(results, specs),
        "\n## Targets (arm c against the quiet baseline)\n",
        *target_lines,
    ]
    for arm, res in results.items():
        md += _arm_section(arm, res, specs, shared_ids, window_s)
    _plot(results, specs, out, command)
    md.append("\n![TTFT and KV occupancy over time per arm](noisy_neighbour.png)\n")
    path = out / "noisy_neighbour.md"
    path.write_text("\n".join(md) + "\n")
    head = _headline_lines(results, cfg, specs, command, target_lines, window_s)
    (out / "noisy_neighbour_headline.md").write_text("\n".join(head) + "\n")
    return path


def _intro(cfg: NNConfig, specs: Sequence[TenantSpec], profile: Profile, command: str) -> list[str]:
    """The title, the command, the fleet and the tenants."""
    return [
        "# Scenario 1 — noisy neighbour\n",
        f"Command: `{command}`\n",
        f"{cfg.shared_replicas} shared + {cfg.reserved_replicas} reserved-pool emulated 70B "
        f"replicas (`{profile.name}`: the realistic 70B profile coarse-grained ×{cfg.k}, chunked "
        f"prefill {cfg.chunk_tokens} tokens/step), speed ×{cfg.speed:g}, "
        f"{cfg.gateway_workers} gateway worker(s), real Redis. {cfg.duration_s:g} model-s "
        f"of Poisson arrivals per arm (seed {cfg.seed}), first {cfg.warmup_s:g} s not counted, "
        f"{cfg.drain_s:g} s to drain. Latencies in model time per real token. Tenants: "
        + ", ".join(f"`{t.tenant_id}` {t.plan} {t.rate_rps:g} req/s" for t in specs)
        + ". The noisy tenant sends 128,000-token prompts. "
        + (
            f"Clients retry a 429/503 up to {cfg.client_retries} times as the openai Python "
            "SDK does (bench/loadgen.py); TTFT from the first attempt."
            if cfg.client_retries
            else "Clients send each request once (no retries)."
        )
        + hold_note(cfg)
        + "\n",
    ]


def _arm_section(
    arm: str, res: ArmResult, specs: Sequence[TenantSpec], shared_ids: list[str], window_s: float
) -> list[str]:
    """One arm: its fleet figures, the prefill shadow, per class and per tenant tables."""
    by_tenant, by_class = summarise(res, specs)
    md = [f"\n## {ARM_TITLES[arm]}\n"]
    md.append(
        f"Preemptions {res.preemptions:.0f} · peak KV occupancy {fmt_pct(_peak_occupancy(res))}"
        f" · mean shared-pool occupancy {fmt_pct(_mean_occupancy(res, shared_ids))}"
        f" · replica clocks skipped {sum(t.clock_lag_s for t in res.traces.values()):.1f}"
        " model-s behind the wall clock (CPU-bound)"
        f" · {res.wall_s:.0f} s wall · {res.chunks_per_s:,.0f} SSE chunks/s read by the"
        f" load generator · {res.cpu_cores:.2f} cores busy (replicas + gateway + load"
        " generator)\n"
    )
    shadow = prefill_shadow(res, specs, window_s)
    if shadow:
        md.append(shadow + "\n")
    md += _table(STATS_HEADER, [_stats_row(g) for g in by_class.values()])
    errors: dict[str, int] = {}
    for o in res.outcomes:
        if o.error:
            key = f"{o.status} {o.error[:90]}"
            errors[key] = errors.get(key, 0) + 1
    if errors:
        top = sorted(errors.items(), key=lambda kv: -kv[1])[:5]
        md.append("\nMost frequent failures: " + "; ".join(f"{n}× `{e}`" for e, n in top))
    md.append("")
    md += _table(STATS_HEADER, [_stats_row(g) for g in by_tenant.values()])
    retries = sorted(group_by(res.outcomes, lambda o: o.tenant_id).items())
    md.append("")
    md += _table(["tenant", RETRY_HEADER], [[t, RetryCounts.of(o).cell()] for t, o in retries])
    return md


def _plot(
    results: dict[str, ArmResult], specs: Sequence[TenantSpec], out: Path, command: str
) -> None:
    """noisy_neighbour.png: TTFT and KV occupancy over time, one panel per arm."""
    group_of = {t.tenant_id: ("noisy" if t.noisy else t.admission_class) for t in specs}
    arms_timeseries(
        {ARM_SHORT[a]: (r.outcomes, {
            rid: (np.asarray(tr.t), np.asarray(tr.occupancy)) for rid, tr in r.traces.items()
        }) for a, r in results.items()},
        group_of, out / "noisy_neighbour.png", f"{command} — model time",
    )  # fmt: skip


def _headline_lines(
    results: dict[str, ArmResult], cfg: NNConfig, specs: Sequence[TenantSpec], command: str,
    target_lines: list[str], window_s: float,
) -> list[str]:  # fmt: skip
    """A few measured sentences for the results index."""
    head = [
        f"Measured by `{command}` in one run ({cfg.shared_replicas} + {cfg.reserved_replicas} "
        f"emulated 70B replicas, same seeded requests in every arm; latencies in model time "
        f"per real token; SLO = TTFT < 1 s and mean TPOT < 50 ms per request).\n",
        *headline(results, specs),
        "\nTargets for arm (c), checked against the quiet baseline:\n",
        *target_lines,
    ]
    if "c" in results:
        shadow = prefill_shadow(results["c"], specs, window_s)
        if shadow:
            head += ["", f"Arm (c) — {shadow}"]
    return head
