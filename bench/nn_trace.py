"""What a tenant's TTFT is made of in a noisy-neighbour arm, from the per-request records
``python -m bench.noisy_neighbour --trace-dir DIR`` keeps (``DIR/s<seed>-n<noisy>-<arm>/``):

- ``r<i>.jsonl``: each replica's finished requests (the emulator's ``--request-log``; model
  time): arrival, first scheduling, first token, priority, prompt length;
- ``spool/``: the gateway's usage events (one per admitted request: tenant, replica, TTFT as
  the gateway saw it, in wall milliseconds);
- ``outcomes.jsonl``: the load generator's outcomes (status, TTFT as the client saw it).

The gateway's request id joins the first two (the emulator's id is it plus ``-<attempt>``).
Per tenant: where its requests went (replica, and whether a long prompt was prefilling on
that replica while the request waited for its first token), and its TTFT split into the
gateway's part (its TTFT less the replica's) and the replica's queue and prefill.

``python -m bench.nn_trace DIR [--speed 1.5] [--tenant free]``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import percentile, ratio_interval

# A prompt whose prefill alone takes the TTFT target on the bench's profile: 12,552 real
# tokens (bench/results/isolation.md), 8 real tokens per emulated one.
LONG_PROMPT_TOKENS = 12_552
LONG_PROMPT_EMULATED = LONG_PROMPT_TOKENS // 8


@dataclass(slots=True)
class Traced:
    """One admitted request, joined across the gateway's and the replica's records."""

    tenant: str
    replica: str
    started: float  # wall seconds (the gateway's started_at)
    gateway_ttft_s: float | None  # model seconds
    prompt: int = 0  # emulated tokens
    arrival: float = math.nan  # replica model time
    scheduled: float = math.nan
    first_token: float = math.nan
    long_overlap: bool = False  # a long prompt prefilled on its replica while it waited

    @property
    def queue_s(self) -> float:
        return self.scheduled - self.arrival

    @property
    def prefill_s(self) -> float:
        return self.first_token - self.scheduled

    @property
    def replica_ttft_s(self) -> float:
        return self.first_token - self.arrival

    @property
    def gateway_part_s(self) -> float:
        if self.gateway_ttft_s is None:
            return math.nan
        return self.gateway_ttft_s - self.replica_ttft_s


def _lines(paths: Iterable[Path]) -> Iterable[dict[str, Any]]:
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def load_arm(arm_dir: Path, speed: float) -> tuple[list[Traced], list[dict[str, Any]]]:
    """The arm's admitted requests (joined) and the load generator's outcomes."""
    events: dict[str, dict[str, Any]] = {}
    for ev in _lines(sorted((arm_dir / "spool").glob("*.spool"))):
        if ev.get("inflight"):
            events.setdefault(str(ev["request_id"]), ev)  # superseded by the real event
        else:
            events[str(ev["request_id"])] = ev
    replica_logs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(arm_dir.glob("r*.jsonl")):
        replica_logs[path.stem] = list(_lines([path]))
    by_gateway_id: dict[str, tuple[str, dict[str, Any]]] = {}
    for rid, recs in replica_logs.items():
        for rec in recs:
            by_gateway_id[str(rec["request_id"]).rsplit("-", 1)[0]] = (rid, rec)
    # long prompts' prefill windows per replica: [first scheduled, first token]
    long_windows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for rid, recs in replica_logs.items():
        for rec in recs:
            if int(rec["prompt"]) >= LONG_PROMPT_EMULATED and float(rec["scheduled"]) >= 0:
                end = (
                    float(rec["first_token"])
                    if float(rec["first_token"]) >= 0
                    else float(rec["finish"])
                )
                long_windows[rid].append((float(rec["scheduled"]), end))
    out: list[Traced] = []
    for gid, ev in events.items():
        ttft_ms = ev.get("ttft_ms")
        t = Traced(
            tenant=str(ev["tenant_id"]),
            replica=str(ev["replica_id"]),
            started=datetime.fromisoformat(str(ev["started_at"])).timestamp(),
            gateway_ttft_s=float(ttft_ms) * speed / 1000 if ttft_ms is not None else None,
        )
        hit = by_gateway_id.get(gid)
        if hit is not None:
            rid, rec = hit
            t.replica = rid
            t.prompt = int(rec["prompt"])
            t.arrival = float(rec["arrival"])
            t.scheduled = float(rec["scheduled"]) if float(rec["scheduled"]) >= 0 else math.nan
            t.first_token = (
                float(rec["first_token"]) if float(rec["first_token"]) >= 0 else math.nan
            )
            if t.prompt < LONG_PROMPT_EMULATED and not math.isnan(t.first_token):
                t.long_overlap = any(
                    lo < t.first_token and hi > t.arrival for lo, hi in long_windows[rid]
                )
        out.append(t)
    outcomes = (
        list(_lines([arm_dir / "outcomes.jsonl"])) if (arm_dir / "outcomes.jsonl").exists() else []
    )
    return out, outcomes


def pct(xs: Sequence[float], q: float) -> float:
    """``bench.stats.percentile`` of the values that are numbers."""
    return percentile([x for x in xs if not math.isnan(x)], q)


def measured(reqs: Sequence[Traced], warmup_wall_s: float) -> list[Traced]:
    """The requests sent after the warm-up (wall seconds after the arm's first request)."""
    if not reqs:
        return []
    t0 = min(r.started for r in reqs)
    return [r for r in reqs if r.started - t0 >= warmup_wall_s]


def describe(reqs: Sequence[Traced], outcomes: Sequence[dict[str, Any]], tenant: str) -> list[str]:
    mine = [r for r in reqs if r.tenant == tenant and not math.isnan(r.first_token)]
    statuses = Counter(int(o["status"]) for o in outcomes if o["tenant_id"] == tenant)
    lines = [f"  {tenant}: {len(mine)} traced; client statuses {dict(sorted(statuses.items()))}"]
    if not mine:
        return lines

    def row(name: str, xs: Sequence[float]) -> str:
        q = [pct(xs, p) * 1000 for p in (50, 90, 95)]
        return (
            f"    {name:<15} p50 {q[0]:7.0f}  p90 {q[1]:7.0f}  p95 {q[2]:7.0f}  "
            f"max {max(xs) * 1000:7.0f} ms"
        )

    lines.append(row("gateway TTFT", [r.gateway_ttft_s or math.nan for r in mine]))
    lines.append(row("replica TTFT", [r.replica_ttft_s for r in mine]))
    lines.append(row("replica queue", [r.queue_s for r in mine]))
    lines.append(row("replica prefill", [r.prefill_s for r in mine]))
    lines.append(row("gateway part", [r.gateway_part_s for r in mine]))
    where = Counter(r.replica for r in mine)
    overlap = sum(r.long_overlap for r in mine)
    lines.append(
        "    replicas "
        + ", ".join(f"{k} {v}" for k, v in sorted(where.items()))
        + f"; waited beside a long prefill: {overlap} ({overlap / len(mine):.0%})"
    )
    for flag in (True, False):
        sub = [r.replica_ttft_s for r in mine if r.long_overlap == flag]
        if sub:
            lines.append(
                f"    {'beside long' if flag else 'no long':<12} n={len(sub):4d} replica TTFT "
                f"p50 {pct(sub, 50) * 1000:.0f} p95 {pct(sub, 95) * 1000:.0f} ms"
            )
    worst = sorted(mine, key=lambda r: -(r.gateway_ttft_s or 0))[: max(3, len(mine) // 20)]
    lines.append(
        "    slowest 5 % (gateway TTFT / queue / prefill ms, prompt, replica, beside long):"
    )
    lines += [
        f"      {(r.gateway_ttft_s or 0) * 1000:6.0f} / {r.queue_s * 1000:6.0f} / "
        f"{r.prefill_s * 1000:6.0f}  prompt {r.prompt * 8:6d}  {r.replica}  {r.long_overlap}"
        for r in worst
    ]
    return lines


LONG_PROMPT_REAL = LONG_PROMPT_EMULATED * 8


def _outcome_ttfts(
    outs: Sequence[dict[str, Any]], tenant: str, keep: Callable[[dict[str, Any]], bool]
) -> list[float]:
    return [
        float(o["ttft_s"])
        for o in outs
        if o["tenant_id"] == tenant and o["ttft_s"] is not None and keep(o)
    ]


def _cell(xs: Sequence[float], ys: Sequence[float]) -> str:
    if not xs or not ys:
        return "—"
    lo, hi = ratio_interval(xs, ys)
    return f"{percentile(xs, 95) / percentile(ys, 95):.2f}x ({lo:.2f}–{hi:.2f}), n={len(xs)}"


def compare(trace_dir: Path, speed: float, warmup_s: float, arm: str = "c") -> list[str]:
    """Markdown: each seed's ``arm`` against its quiet baseline, pooled over the seeds.

    - TTFT p95 ratios per non-noisy tenant three ways: every request with a TTFT (what the
      benchmark reports), prompts under the long-context threshold only, and the requests
      served in both arms (the same requests: the workload is seeded);
    - each tenant's long prompts (over the threshold) by status in each arm;
    - where the short requests of the non-noisy tenants went (per replica), and how long the
      designated replica spent prefilling and holding long prompts;
    - the free tier's TTFT split into the gateway's part, the replica's queue and prefill."""
    runs: list[tuple[str, Path, Path]] = []
    for d in sorted(p for p in trace_dir.iterdir() if p.is_dir() and p.name.endswith(f"-{arm}")):
        seed_n = d.name[: -len(arm) - 1]
        q = trace_dir / f"{seed_n.split('-')[0]}-{seed_n.split('-')[1]}-quiet"
        if not q.is_dir():
            q = next(iter(sorted(trace_dir.glob(f"{seed_n.split('-')[0]}-*-quiet"))), q)
        if q.is_dir():
            runs.append((seed_n, d, q))
    md: list[str] = []
    pooled: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    long_status: dict[tuple[str, str], Counter[int]] = defaultdict(Counter)
    spread: dict[str, Counter[str]] = defaultdict(Counter)
    free_parts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    hosting: list[str] = []
    tenants: set[str] = set()
    paired: dict[str, list[float]] = defaultdict(list)  # log(arm / quiet) per request
    for seed_n, arm_dir, quiet_dir in runs:
        outs = {"arm": load_arm(arm_dir, speed)[1], "quiet": load_arm(quiet_dir, speed)[1]}
        for which, d in (("arm", arm_dir), ("quiet", quiet_dir)):
            reqs = measured(load_arm(d, speed)[0], warmup_s / speed)
            for r in reqs:
                if r.tenant.startswith("noisy") or r.prompt >= LONG_PROMPT_EMULATED:
                    continue
                spread[which][r.replica] += 1
                if r.tenant == "free" and not math.isnan(r.first_token):
                    parts = free_parts[which]
                    parts["gateway TTFT"].append(r.gateway_ttft_s or math.nan)
                    parts["replica queue"].append(r.queue_s)
                    parts["replica prefill"].append(r.prefill_s)
                    parts["gateway part"].append(r.gateway_part_s)
            hosting.append(f"{seed_n} {'arm' if which == 'arm' else 'quiet'}: " + _hosting(d))
        served = {
            w: {str(o["request_id"]) for o in os_ if o["ttft_s"] is not None}
            for w, os_ in outs.items()
        }
        both = served["arm"] & served["quiet"]
        noisy = {
            str(o["tenant_id"]) for o in outs["arm"] if str(o["tenant_id"]).startswith("noisy")
        }
        for w, os_ in outs.items():
            for o in os_:
                tid = str(o["tenant_id"])
                if tid in noisy:
                    continue
                tenants.add(tid)
                if int(o["prompt_tokens"]) >= LONG_PROMPT_REAL:
                    long_status[(tid, w)][int(o["status"])] += 1
        ttft_of = {
            w: {str(o["request_id"]): float(o["ttft_s"]) for o in os_ if o["ttft_s"] is not None}
            for w, os_ in outs.items()
        }
        for rid in both:
            tid = next(str(o["tenant_id"]) for o in outs["arm"] if str(o["request_id"]) == rid)
            if ttft_of["quiet"][rid] > 0 and ttft_of["arm"][rid] > 0:
                paired[tid].append(math.log(ttft_of["arm"][rid] / ttft_of["quiet"][rid]))
        for tid in sorted(tenants):
            for view, keep in (
                ("all", lambda o: True),
                ("short", lambda o: int(o["prompt_tokens"]) < LONG_PROMPT_REAL),
                ("both", lambda o, both=both: str(o["request_id"]) in both),
            ):
                for w in ("arm", "quiet"):
                    pooled[(tid, view, w)] += _outcome_ttfts(outs[w], tid, keep)
    md += [
        f"TTFT p95 of arm `{arm}` against the quiet baseline, seeds pooled ({len(runs)} runs: "
        + ", ".join(s for s, _, _ in runs)
        + "), each ratio with its 95 % bootstrap interval and the arm's sample size:",
        "",
        "| tenant | every request with a TTFT (as reported) | prompts under the long-context "
        "threshold | requests served in both arms | the same request's TTFT, arm / quiet: "
        "geometric mean (95 % interval) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for tid in sorted(tenants):
        cells = [
            _cell(pooled[(tid, view, "arm")], pooled[(tid, view, "quiet")])
            for view in ("all", "short", "both")
        ]
        cells.append(_geomean_cell(paired[tid]))
        md.append(f"| {tid} | " + " | ".join(cells) + " |")
    md += ["", "Prompts over the long-context threshold, by status (arm / quiet):", ""]
    for tid in sorted(tenants):
        sa, sq = (
            long_status.get((tid, "arm"), Counter()),
            long_status.get((tid, "quiet"), Counter()),
        )
        if sa or sq:
            md.append(f"- {tid}: {dict(sorted(sa.items()))} / {dict(sorted(sq.items()))}")
    md += ["", "Short requests of the non-noisy tenants per shared replica (arm / quiet):", ""]
    for rid in sorted(set(spread["arm"]) | set(spread["quiet"])):
        na, nq = spread["arm"][rid], spread["quiet"][rid]
        ta, tq = sum(spread["arm"].values()), sum(spread["quiet"].values())
        md.append(f"- {rid}: {na} ({na / max(1, ta):.1%}) / {nq} ({nq / max(1, tq):.1%})")
    md += [
        "",
        "Per replica over the whole arm, warm-up and drain included (model seconds): requests "
        "in the system on average (arrival to finish), and the long prompts: how many, the "
        "time one was prefilling (first scheduling to first token) and resident (to finish):",
        "",
    ]
    md += [f"- {h}" for h in hosting]
    md += ["", "The free tier's TTFT, seeds pooled (ms; arm / quiet):", ""]
    for part in ("gateway TTFT", "replica queue", "replica prefill", "gateway part"):
        xa, xq = free_parts["arm"][part], free_parts["quiet"][part]
        md.append(
            f"- {part}: p50 {pct(xa, 50) * 1000:.0f} / {pct(xq, 50) * 1000:.0f}, "
            f"p95 {pct(xa, 95) * 1000:.0f} / {pct(xq, 95) * 1000:.0f}"
        )
    return md


def _geomean_cell(logs: Sequence[float]) -> str:
    """The geometric mean of per-request ratios (given as logs) with a bootstrap interval."""
    if not logs:
        return "—"
    x = np.asarray(logs)
    rng = np.random.default_rng(0)
    means = x[rng.integers(0, len(x), size=(2000, len(x)))].mean(axis=1)
    lo, hi = np.exp(np.percentile(means, [2.5, 97.5]))
    return f"{math.exp(x.mean()):.3f}x ({lo:.3f}–{hi:.3f}), n={len(x)}"


def _hosting(arm_dir: Path) -> str:
    """Per replica, the model seconds during which a long prompt was prefilling (first
    scheduling to first token) and resident (first scheduling to finish), unions of them."""
    parts = []
    for path in sorted(arm_dir.glob("r*.jsonl")):
        recs = list(_lines([path]))
        if not recs:
            continue
        start = min(float(r["arrival"]) for r in recs)
        end = max(float(r["finish"]) for r in recs)
        in_system = sum(float(r["finish"]) - float(r["arrival"]) for r in recs) / max(
            1e-9, end - start
        )
        spans = [
            (
                float(r["scheduled"]),
                float(r["first_token"]) if float(r["first_token"]) >= 0 else float(r["finish"]),
                float(r["finish"]),
            )
            for r in recs
            if int(r["prompt"]) >= LONG_PROMPT_EMULATED and float(r["scheduled"]) >= 0
        ]
        if not spans:
            parts.append(f"{path.stem} {in_system:.1f} in system")
            continue
        pre = _union([(a, b) for a, b, _ in spans])
        res = _union([(a, c) for a, _, c in spans])
        parts.append(
            f"{path.stem} {in_system:.1f} in system, {len(spans)} long prompts, prefilling "
            f"{pre:.0f} s, resident {res:.0f} s of {end - start:.0f} s"
        )
    return "; ".join(parts) or "none"


def _union(spans: Sequence[tuple[float, float]]) -> float:
    total, cur_lo, cur_hi = 0.0, -math.inf, -math.inf
    for lo, hi in sorted(spans):
        if lo > cur_hi:
            total += max(0.0, cur_hi - cur_lo) if cur_hi > -math.inf else 0.0
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi > -math.inf:
        total += cur_hi - cur_lo
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nn_trace", description=__doc__)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--speed", type=float, default=1.5)
    ap.add_argument("--warmup", type=float, default=40.0, help="model seconds not counted")
    ap.add_argument("--tenant", action="append", default=None)
    ap.add_argument(
        "--compare", metavar="ARM", help="markdown: ARM against quiet, seeds pooled (compare)"
    )
    args = ap.parse_args(argv)
    if args.compare:
        print("\n".join(compare(args.trace_dir, args.speed, args.warmup, args.compare)))
        return 0
    for arm_dir in sorted(p for p in args.trace_dir.iterdir() if p.is_dir()):
        reqs, outcomes = load_arm(arm_dir, args.speed)
        reqs = measured(reqs, args.warmup / args.speed)
        print(f"{arm_dir.name}: {len(reqs)} admitted requests after the warm-up")
        tenants = args.tenant or sorted({r.tenant for r in reqs})
        for tenant in tenants:
            print("\n".join(describe(reqs, outcomes, tenant)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
