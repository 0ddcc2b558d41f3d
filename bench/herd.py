"""Routing herd (docs/design.md C5, R5): "pick the emptiest" on stale occupancy vs power of
two choices with optimistic in-flight KV, vs round robin.

Replicas are the emulator's own ``emulator.engine.Engine`` (70B TP4 profile: paged KV, chunked
prefill, preemption) stepped in virtual time; the router is the gateway's own
``gateway.admission.router.Router`` over ``gateway.admission`` policy modules (imported, not
copied), fed the way the gateway's scraper feeds it: every 250 ms each replica's
``kv_cache_usage_perc``, and nothing in between. Every arm replays the same seeded arrivals
(Poisson, the prompt shape of docs/design.md §2, the engine's seeded output lengths), all requests
standard class (ceiling 0.85).

The deployed configuration (``HerdConfig.deployed``; ``--replica-cap``, ``--drain``,
``--classes``, ``--reserved-pool``, ``--heavy-tenants``) replays the same arrivals on replicas
with the platform's ``--long-prefill-token-threshold``, in plan classes (each with its ceiling
and vLLM priority, a reserved pool if asked), with standard tenants flooding 128k prompts on
top, and lets the run go on after its end so that the measured requests finish. The new
policy's arm adds the long-context budget (``bench.sim.LongContextLedger``, the fleet
simulation's) to the placement rules.

``python -m bench.herd`` writes bench/results/herd.md and herd.png (well under 2 minutes).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.sim import (  # noqa: E402
    HEAVY_PROMPT,
    LongContextLedger,
    SimRegistry,
    VirtualFleet,
    feed,
    heavy_arrivals,
    replica_records,
    sim_engine,
    sim_version,
)
from bench.stats import percentile as pct  # noqa: E402
from bench.workload import (
    DESIGN_PROMPT,  # noqa: E402
    poisson_arrivals,  # noqa: E402
)
from emulator.engine import Request, StepResult  # noqa: E402
from emulator.profiles import get_profile, threshold_prefill_rate  # noqa: E402
from gateway.admission.config import LAYERS, VLLM_PRIORITY, AdmissionConfig, Strategy  # noqa: E402
from gateway.admission.estimates import long_context_threshold
from gateway.admission.prefix import query_from_tokens  # noqa: E402
from gateway.admission.replicas import ReplicaState  # noqa: E402
from gateway.admission.router import Router  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VERSION = "llama-70b-sim"


@dataclass(frozen=True, slots=True)
class HerdConfig:
    replicas: int = 8
    rate_rps: float = 60.0
    duration_s: float = 150.0
    warmup_s: float = 60.0  # statistics skip the fill-up of an empty fleet
    scrape_s: float = 0.25
    max_tokens: int = 4096
    seed: int = 7
    profile: str = "llama-70b-tp4-h100"
    # Another realisation of the routing's own randomness on the same arrivals: the router's
    # rng seed and the tenants' cache salts (hence the placement keys) differ with it.
    draw: int = 0
    # The deployed configuration (all off: the herd as before). The replicas'
    # --long-prefill-token-threshold (0 = no cap; the platform's replica command: 5,242).
    long_prefill_tokens: int = 0
    # Model seconds the run goes on after duration_s, arrivals and all (drawn from a
    # generator of their own), so that requests which arrived by duration_s can finish.
    drain_s: float = 0.0
    # Plan classes (reserved, standard, free shares; the fleet simulation's mix), drawn per
    # request from a generator of their own; () = every request standard.
    class_mix: tuple[float, ...] = ()
    reserved_replicas: int = 0  # the first replicas form the reserved pool (R2)
    # Standard tenants flooding 128k prompts on top of the shape, at these rates (cycled).
    heavy_tenants: int = 0
    heavy_rates: tuple[float, ...] = (0.4,)
    tenants: int = 100  # the shape's tenants (the long-context budget's fairness is per tenant)

    @property
    def deployed(self) -> bool:
        return bool(
            self.long_prefill_tokens
            or self.drain_s
            or self.class_mix
            or self.reserved_replicas
            or self.heavy_tenants
        )


@dataclass(frozen=True, slots=True)
class Work:
    """One request of a run: arrival, prompt length, first token id (its prompt's ids are
    consecutive from it), class, tenant, and for a flooding tenant's request its output
    length (enforced as a replica does with ``ignore_eos``; 0: the engine's own, up to
    ``HerdConfig.max_tokens``)."""

    t: float
    prompt: int
    first: int
    cls: str = "standard"
    tenant: str = ""
    output: int = 0

    @property
    def heavy(self) -> bool:
        return self.output > 0


@dataclass(frozen=True, slots=True)
class Arm:
    label: str
    strategy: Strategy
    optimistic: bool
    # gateway/admission/placement.py's long-context rules: a request's own prompt KV against the
    # ceiling, long contexts packed onto the designated replicas, short ones off them.
    # The other arms route as before those rules (the comparison in the same run).
    isolation: bool = False
    # cache-aware only: a prompt nobody holds goes by its placement key's rendezvous pair
    # (the gateway's default without KV events) or by P2C's own draw (with KV events)
    rendezvous: bool = True
    # cache-aware only: each prompt is one user message, keyed by it as the gateway keys a
    # chat request (``prefix.conversation_block``); else the key at ``PLACEMENT_BLOCK``
    conversation_key: bool = False
    # ``AdmissionConfig.affinity_conversation_shared``: a conversation's replica on the scrape
    # alone (the gateway's default), else (before) within the bound on this process's loads
    conversation_shared: bool = True
    # With ``isolation``: the long-context budget too (gateway/admission/long_context.py over
    # one fleet ledger, ``bench.sim.LongContextLedger``), i.e. the deployed new policy; the
    # other arms run without it, as the herd did before.
    budget: bool = False

    def admission(self) -> AdmissionConfig:
        layers = LAYERS if self.budget else tuple(x for x in LAYERS if x != "long_context")
        return AdmissionConfig(
            strategy=self.strategy,
            optimistic_inflight=self.optimistic,
            count_request_kv=self.isolation,
            context_placement=self.isolation,
            affinity_rendezvous=self.rendezvous,
            affinity_conversation_shared=self.conversation_shared,
            layers=frozenset(layers),
        )


ARMS = (
    Arm("round robin", "round_robin", False),
    Arm("pick emptiest (stale 250 ms)", "emptiest", False),
    Arm("P2C (stale, no in-flight)", "p2c", False),
    Arm("P2C + optimistic in-flight", "p2c", True),
    Arm("P2C + in-flight + long-context placement", "p2c", True, isolation=True),
    # the deployed new policy: the placement rules and the long-context budget
    Arm(
        "P2C + in-flight + long-context placement + budget",
        "p2c",
        True,
        isolation=True,
        budget=True,
    ),
    # every prompt unique: no prefix to follow, so this is the no-match placement under herd
    # conditions: the less loaded of the placement key's two rendezvous choices (gateway
    # processes blind to each other: the gateway's default without KV events) ...
    Arm("cache-aware + optimistic in-flight", "cache_aware", True),
    # ... keyed by the conversation, as the gateway keys a chat request's one user message
    Arm(
        "cache-aware (conversation key) + optimistic in-flight",
        "cache_aware",
        True,
        conversation_key=True,
    ),
    # ... as before ``affinity_conversation_shared``: within the bound on this process's loads
    Arm(
        "cache-aware (conversation key) + own-load bound + optimistic in-flight",
        "cache_aware",
        True,
        conversation_key=True,
        conversation_shared=False,
    ),
    # ... or, with KV events feeding the index, exactly P2C's draw
    Arm("cache-aware (KV events) + optimistic in-flight", "cache_aware", True, rendezvous=False),
    # the gateway's defaults (the long-context rules on) under cache-aware routing
    Arm("cache-aware + in-flight + long-context placement", "cache_aware", True, isolation=True),
    Arm(
        "cache-aware (KV events) + in-flight + long-context placement",
        "cache_aware",
        True,
        isolation=True,
        rendezvous=False,
    ),
)


@dataclass(slots=True)
class ArmResult:
    arm: Arm
    times: list[float] = field(default_factory=list)
    max_occ: list[float] = field(default_factory=list)
    mean_occ: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    preemptions: int = 0
    rejected: int = 0
    admitted: int = 0
    wall_s: float = 0.0
    # deployed configuration: 503s from the long-context budget (within ``rejected``);
    # measured requests without a first token / unfinished at the end of the run; the
    # flooding tenants' measured requests admitted and completed; TTFT per class
    long_refused: int = 0
    no_first_token: int = 0
    unfinished: int = 0
    heavy_admitted: int = 0
    heavy_done: int = 0
    ttft_by_class: dict[str, list[float]] = field(default_factory=dict)


def arrivals(cfg: HerdConfig) -> list[tuple[float, int, int]]:
    """The seed's requests: (arrival time, prompt length, first token id). A prompt's token
    ids are consecutive from its first, drawn from the seed like the rest (after the times
    and lengths, which stay what they were): under cache-aware routing the ids decide the
    chain hashes, hence the placement keys, so each seed is an independent draw of them too
    (they used to be the same for every seed). Every arm of a seed replays these."""
    return _draw(np.random.default_rng(cfg.seed), cfg.rate_rps, 0.0, cfg.duration_s)


def _draw(
    rng: np.random.Generator, rate: float, start: float, end: float
) -> list[tuple[float, int, int]]:
    times = poisson_arrivals(rng, rate, start, end)
    prompts = DESIGN_PROMPT.sample(rng, len(times))
    firsts = rng.integers(1 << 20, 1 << 52, size=len(times))
    return [(float(t), int(p), int(f)) for t, p, f in zip(times, prompts, firsts, strict=True)]


CLASSES = ("reserved", "standard", "best_effort")


def workload(cfg: HerdConfig) -> list[Work]:
    """Every request of a run in arrival order: ``arrivals`` (unchanged by the options below),
    then the drain's arrivals from a generator of their own; each request's class from a
    generator of its own per window (standard when ``class_mix`` is empty); the tenants round
    robin; the flooding tenants' 128k requests (``bench.sim.heavy_arrivals``, the fleet
    simulation's seeds) on top."""
    windows = [(0, arrivals(cfg))]
    if cfg.drain_s > 0:
        end = cfg.duration_s + cfg.drain_s
        drng = np.random.default_rng(cfg.seed + 1_000_003)
        windows.append((1_000_003, _draw(drng, cfg.rate_rps, cfg.duration_s, end)))
    out: list[Work] = []
    k = 0
    for salt, work in windows:
        if cfg.class_mix:
            crng = np.random.default_rng((cfg.seed, salt, 1))
            p = np.asarray(cfg.class_mix, dtype=float)
            classes = [CLASSES[int(c)] for c in crng.choice(3, size=len(work), p=p / p.sum())]
        else:
            classes = ["standard"] * len(work)
        for (t, prompt, first), cls in zip(work, classes, strict=True):
            out.append(Work(t, prompt, first, cls, f"t{k % cfg.tenants}"))
            k += 1
        start = cfg.duration_s if salt else 0.0
        end = cfg.duration_s + cfg.drain_s if salt else cfg.duration_s
        for h in range(cfg.heavy_tenants):
            rate = cfg.heavy_rates[h % len(cfg.heavy_rates)]
            for j, (t, output) in enumerate(
                heavy_arrivals(cfg.seed * 101 + h + salt, rate, start, end)
            ):
                first = (1 << 56) + ((h * 2 + bool(salt)) << 40) + j * HEAVY_PROMPT
                out.append(Work(t, HEAVY_PROMPT, first, "standard", f"heavy-{h + 1}", output))
    out.sort(key=lambda w: w.t)
    return out


def prompt_tokens(first: int, length: int) -> range:
    """A request's prompt token ids: unique to it (no shared prefix in the herd)."""
    return range(first, first + length)


def run_arm(cfg: HerdConfig, arm: Arm, work: list[Work]) -> ArmResult:
    started = time.perf_counter()
    profile = get_profile(cfg.profile)
    engines = [
        sim_engine(profile, cfg.seed + i, cfg.long_prefill_tokens) for i in range(cfg.replicas)
    ]
    records = replica_records(cfg.replicas, reserved=cfg.reserved_replicas)
    version = sim_version(
        VERSION,
        "llama-70b",
        profile,
        records,
        kv_capacity_tokens=engines[0].kv_capacity_tokens,
        prefill_tokens_per_s=threshold_prefill_rate(profile, 1.0),
    )
    threshold = long_context_threshold(version)
    states = [ReplicaState(record=r, version=VERSION) for r in records]
    adm = arm.admission()
    ledger = (
        # as before the fleet simulation's ledger told waits: the herd's refused requests
        # are dropped, not retried, so nothing here reads a retry-after or comes back
        LongContextLedger(version, cfg.replicas - cfg.reserved_replicas, adm, tells_waits=False)
        if arm.budget
        else None
    )
    out = ArmResult(arm)

    def scraped(t: float) -> None:
        if cfg.warmup_s <= t < cfg.duration_s:
            occ = [s.kv_usage for s in states]
            out.times.append(t)
            out.max_occ.append(max(occ))
            out.mean_occ.append(sum(occ) / len(occ))

    def stepped(i: int, res: StepResult) -> None:
        feed((router,), records[i], res)
        if ledger is not None:
            for req in res.emitted:
                if req.num_output == 1:
                    ledger.prefilled(req.request_id, res.end)
            for req in res.finished:
                ledger.release(req.request_id)

    fleet = VirtualFleet(engines, states, cfg.scrape_s, stepped, scraped)
    router = Router(
        SimRegistry(VERSION, states),
        random.Random(cfg.seed + 7919 * cfg.draw),
        config=adm,
        clock=fleet.clock,
    )
    live: list[tuple[Request, Work]] = []
    ids = 0
    for w in work:
        t = w.t
        fleet.run_to(t)
        measured = cfg.warmup_s <= t < cfg.duration_s
        kv_bytes = w.prompt * profile.kv_bytes_per_token
        long_context = arm.isolation and w.prompt >= threshold
        tokens = prompt_tokens(w.first, w.prompt)
        max_tokens = w.output or cfg.max_tokens
        rid = f"q{ids + 1}"  # the lease's name too
        query = None
        if arm.strategy == "cache_aware":
            salt = f"{ids % 16:064x}" if cfg.draw == 0 else f"{cfg.draw}:{ids % 16}"
            # the prompt as one user message (no template: its end one token early, where a
            # templated message's end-of-turn token would be)
            first = (0, len(tokens) - 1) if arm.conversation_key else None
            query = query_from_tokens(f"t{ids % 16}", tokens, salt, 16, first_user=first)
        if ledger is not None and long_context:
            # as the gateway's admit script: a reserved request is not held to the budget
            need = (w.prompt + max_tokens) * profile.kv_bytes_per_token
            if w.cls != "reserved" and not ledger.admit(w.tenant, rid, need, w.prompt, t):
                if measured:
                    out.rejected += 1
                    out.long_refused += 1
                continue
            router.note_fleet_long(VERSION, ledger.fleet_bytes(but=rid))
        # as the gateway: a long context's expected output KV is reserved on its replica
        growth = max_tokens * profile.kv_bytes_per_token if long_context else 0
        replica = router.choose(
            version,
            w.cls,
            kv_bytes,
            long_context=long_context,
            prefix=query,
            growth_bytes=growth,
        )
        if replica is None:
            if ledger is not None:
                ledger.release(rid)
            if measured:
                out.rejected += 1
            continue
        idx = int(replica.replica_id[1:])
        ids += 1
        req = engines[idx].add_request(
            rid,
            tokens,
            max_tokens,
            priority=VLLM_PRIORITY[w.cls],
            arrival_time=t,
            ignore_eos=w.heavy,
        )
        router.on_dispatch(
            replica, rid, kv_bytes, long_context=long_context, prefix=query, growth_bytes=growth
        )
        if measured:
            out.admitted += 1
            live.append((req, w))
    end = cfg.duration_s + cfg.drain_s
    if cfg.drain_s > 0:
        fleet.run_to(end)  # scraped as before: the routers still route the drain's arrivals
    else:
        fleet.finish(end)
    for req, w in live:
        if w.heavy:
            out.heavy_admitted += 1
            out.heavy_done += req.finished
            continue
        # a request still waiting for its first token at the end counts with what it
        # has waited so far (a lower bound), so the worst cases are not dropped
        ttft = req.ttft if req.ttft is not None else end - w.t
        out.ttft.append(ttft)
        out.ttft_by_class.setdefault(w.cls, []).append(ttft)
        out.no_first_token += req.ttft is None
        out.unfinished += not req.finished
        if req.tpot is not None:
            out.tpot.append(req.tpot)
    out.preemptions = sum(e.stats.num_preemptions for e in engines)
    out.wall_s = time.perf_counter() - started
    return out


def report(runs: list[tuple[HerdConfig, list[ArmResult]]], command: str, name: str = "herd") -> str:
    cfg = runs[0][0]
    seeds = sorted({c.seed for c, _ in runs})
    draws = len({c.draw for c, _ in runs})
    lines = [
        "# Routing herd: stale occupancy, pick-emptiest vs P2C + optimistic in-flight",
        "",
        f"Command: `{command}`",
        "",
        f"{cfg.replicas} replicas of `{cfg.profile}` (the emulator's `Engine`, stepped in "
        f"virtual time), Poisson arrivals, prompts p50 800 / p95 6,000, the engine's output "
        f"p50 300 / p95 1,200 (max_tokens {cfg.max_tokens}), "
        + ("in plan classes (below). " if cfg.class_mix else "all standard class (ceiling 0.85). ")
        + "Occupancy reaches the router only through a scrape every "
        f"{cfg.scrape_s * 1000:.0f} ms. {cfg.duration_s:g} s simulated per arm, the first "
        f"{cfg.warmup_s:g} s (fill-up) excluded. Seed {', '.join(map(str, seeds))}; every arm "
        "of a load and seed replays "
        "the same arrivals. Router: `gateway.admission.router.Router` over "
        "the `gateway.admission` policy modules, as in the gateway.",
        "",
    ]
    deployed = cfg.deployed
    if deployed:
        lines += [*deployed_setup(cfg), ""]
    extra = (
        " TTFT p99 reserved / standard / free | long-context 503 | flooders' 128k: admitted / "
        "completed | no first token / unfinished at the end |"
        if deployed
        else ""
    )
    lines += [
        "| load | routing | mean occupancy | mean of max replica | p99 of max replica | "
        "max/mean | TTFT p50 | TTFT p99 | TPOT p99 | preemptions | 503 (no eligible replica) |"
        + extra,
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 4 if deployed else ""),
    ]
    for run_cfg, results in runs:
        load = (
            f"{run_cfg.rate_rps:g} req/s ({run_cfg.rate_rps * run_cfg.scrape_s:.0f} "
            "decisions per scrape)"
        )
        if len({c.seed for c, _ in runs}) > 1:
            load = f"{run_cfg.rate_rps:g} req/s, seed {run_cfg.seed}"
        if any(c.draw for c, _ in runs):
            load += f", draw {run_cfg.draw}"
        for r in results:
            mean = float(np.mean(r.mean_occ))
            mx = float(np.mean(r.max_occ))
            lines.append(
                f"| {load} | {r.arm.label} | {mean:.3f} | {mx:.3f} | {pct(r.max_occ, 99):.3f} "
                f"| {mx / mean:.2f} | {pct(r.ttft, 50) * 1000:.0f} ms | "
                f"{pct(r.ttft, 99) * 1000:.0f} ms | {pct(r.tpot, 99) * 1000:.1f} ms | "
                f"{r.preemptions} | {r.rejected} / {r.rejected + r.admitted} |"
                + (deployed_cells(r) if deployed else "")
            )
    lines.append("")
    for run_cfg, results in runs:
        best = old_policy(results)
        if best is None:
            continue
        base = next((r for r in results if r.arm.strategy == "emptiest"), None)
        if base is not None:
            lines.append(
                f"- {run_cfg.rate_rps:g} req/s: TTFT p99 pick-emptiest / P2C + optimistic "
                f"in-flight = {pct(base.ttft, 99) / pct(best.ttft, 99):.1f}x; fullest replica "
                f"on average {np.mean(base.max_occ):.3f} vs {np.mean(best.max_occ):.3f}."
            )
        iso = next((r for r in results if r.arm.isolation), None)
        new = next((r for r in results if r.arm.budget and r.arm.strategy == "p2c"), None)
        if new is not None:
            lines.append(
                f"- {run_cfg.rate_rps:g} req/s, seed {run_cfg.seed}: new policy (placement + "
                f"budget) against old (P2C + in-flight): TTFT p99 {pct(new.ttft, 99) * 1000:.0f}"
                f" vs {pct(best.ttft, 99) * 1000:.0f} ms, TPOT p99 {pct(new.tpot, 99) * 1000:.1f}"
                f" vs {pct(best.tpot, 99) * 1000:.1f} ms, fullest replica on average "
                f"{np.mean(new.max_occ):.3f} vs {np.mean(best.max_occ):.3f} (p99 "
                f"{pct(new.max_occ, 99):.3f} vs {pct(best.max_occ, 99):.3f}), 503 "
                f"{new.rejected} vs {best.rejected} ({new.long_refused} by the budget)."
            )
        elif iso is not None:
            lines.append(
                f"- {run_cfg.rate_rps:g} req/s: with the long-context placement rules, TTFT p99 "
                f"{pct(iso.ttft, 99) * 1000:.0f} ms vs {pct(best.ttft, 99) * 1000:.0f} ms, "
                f"fullest replica on average {np.mean(iso.max_occ):.3f} vs "
                f"{np.mean(best.max_occ):.3f} (p99 {pct(iso.max_occ, 99):.3f} vs "
                f"{pct(best.max_occ, 99):.3f}), 503 {iso.rejected} vs {best.rejected}."
            )
    if len(seeds) > 1:
        lines += [
            "",
            f"Over seeds {', '.join(map(str, seeds))} ({draws} run(s) per seed, the same "
            "arrivals for every arm and draw of a seed):",
            "",
            "| load | routing | 503 mean | TPOT p99 median | TPOT p99 max | TTFT p99 median | "
            "TTFT p99 range | mean of max replica, range | p99 of max replica, range |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        by_arm: dict[tuple[float, str], list[ArmResult]] = {}
        for run_cfg, results in runs:
            for r in results:
                by_arm.setdefault((run_cfg.rate_rps, r.arm.label), []).append(r)
        for (rate, label), rs in by_arm.items():
            tpots = [pct(r.tpot, 99) * 1000 for r in rs]
            ttfts = [pct(r.ttft, 99) * 1000 for r in rs]
            mxs = [float(np.mean(r.max_occ)) for r in rs]
            p99s = [pct(r.max_occ, 99) for r in rs]
            lines.append(
                f"| {rate:g} req/s | {label} | {np.mean([r.rejected for r in rs]):.0f} | "
                f"{np.median(tpots):.1f} ms | {max(tpots):.1f} ms | {np.median(ttfts):.0f} ms | "
                f"{min(ttfts):.0f}–{max(ttfts):.0f} ms | {min(mxs):.3f}–{max(mxs):.3f} | "
                f"{min(p99s):.3f}–{max(p99s):.3f} |"
            )
        lines += ["", *_wins(runs)]
    lines += [
        "",
        "Occupancy is each replica's true `kv_cache_usage_perc` sampled at every scrape; "
        '"max/mean" is the mean occupancy of the fullest replica over the fleet mean. A '
        "request's TTFT counts from its arrival at the router; a request still without a first "
        "token at the end counts with its wait so far. Ratios compare arms of one run.",
        "",
        f"![herd]({name}.png)",
        "",
    ]
    return "\n".join(lines)


def deployed_setup(cfg: HerdConfig) -> list[str]:
    """The deployed configuration's paragraph of the report."""
    parts = []
    if cfg.long_prefill_tokens:
        parts.append(
            f"every replica with `--long-prefill-token-threshold {cfg.long_prefill_tokens:,}`"
        )
    if cfg.class_mix:
        d = AdmissionConfig()
        names = (
            f"reserved (ceiling {d.reserved_max_occupancy:g})",
            f"standard ({d.standard_max_occupancy:g})",
            f"free (best effort, {d.best_effort_max_occupancy:g})",
        )
        mix = " / ".join(
            f"{share * 100:g} % {c}" for share, c in zip(cfg.class_mix, names, strict=False)
        )
        parts.append(f"plan classes {mix}, each under its own ceiling and vLLM priority")
    if cfg.reserved_replicas:
        parts.append(f"the first {cfg.reserved_replicas} replicas a reserved pool")
    if cfg.heavy_tenants:
        rates = ", ".join(f"{x:g}" for x in cfg.heavy_rates)
        parts.append(
            f"{cfg.heavy_tenants} standard tenants flooding {HEAVY_PROMPT:,}-token prompts at "
            f"{rates} req/s (cycled) on top (`bench.sim.heavy_arrivals`); TTFT and TPOT "
            "columns are everyone else's"
        )
    if cfg.drain_s:
        parts.append(
            f"the run goes on {cfg.drain_s:g} s after its end, arrivals and all, so that the "
            f"requests that arrived in [{cfg.warmup_s:g}, {cfg.duration_s:g}) s finish "
            "(occupancy is sampled in that window only)"
        )
    return [
        "**Deployed configuration:** " + "; ".join(parts) + ". The arm "
        '"+ budget" is the new policy (the placement rules and the long-context budget over '
        "one fleet ledger, `bench.sim.LongContextLedger`, the fleet simulation's); \"P2C + "
        'optimistic in-flight" is the old one. A 503 is final (no client retry in the herd).'
    ]


def deployed_cells(r: ArmResult) -> str:
    by = [
        f"{pct(r.ttft_by_class[c], 99) * 1000:.0f}" if r.ttft_by_class.get(c) else "—"
        for c in CLASSES
    ]
    return (
        f" {' / '.join(by)} ms | {r.long_refused} | {r.heavy_admitted} / {r.heavy_done} | "
        f"{r.no_first_token} / {r.unfinished} |"
    )


def old_policy(results: list[ArmResult]) -> ArmResult | None:
    """The old policy's arm of a run (P2C + optimistic in-flight, no long-context rules)."""
    return next(
        (
            r
            for r in results
            if r.arm.strategy == "p2c" and r.arm.optimistic and not r.arm.isolation
        ),
        None,
    )


def _wins(runs: list[tuple[HerdConfig, list[ArmResult]]]) -> list[str]:
    """In how many runs each policy arm's TTFT p99 and fullest replica (mean) beat the old
    policy's (P2C + optimistic in-flight) of the same run."""
    out = []
    counts: dict[tuple[float, str], list[int]] = {}
    for run_cfg, results in runs:
        old = old_policy(results)
        if old is None:
            continue
        for r in results:
            if not r.arm.isolation or r.arm.strategy != "p2c":
                continue
            c = counts.setdefault((run_cfg.rate_rps, r.arm.label), [0, 0, 0])
            c[0] += pct(r.ttft, 99) < pct(old.ttft, 99)
            c[1] += float(np.mean(r.max_occ)) < float(np.mean(old.max_occ))
            c[2] += 1
    for (rate, label), (ttft, fullest, n) in counts.items():
        out.append(
            f"- {rate:g} req/s, {label} against P2C + optimistic in-flight: lower TTFT p99 in "
            f"{ttft} of {n} runs, lower mean of the fullest replica in {fullest} of {n}."
        )
    return out


def smooth(values: list[float], window: int = 8) -> np.ndarray:
    """Rolling mean over ``window`` scrapes (2 s), for the plot only."""
    arr = np.asarray(values, dtype=float)
    if len(arr) < window:
        return arr
    kernel = np.ones(window) / window
    head = np.cumsum(arr[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(arr, kernel, mode="valid")])


def plot(cfg: HerdConfig, results: list[ArmResult], path: Path, command: str) -> None:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7.5))
    fig.suptitle(
        f"{cfg.replicas} replicas, {cfg.rate_rps:g} req/s, scrape every "
        f"{cfg.scrape_s * 1000:.0f} ms",
        fontsize=10,
    )
    colours = ["tab:gray", "tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple"]
    colours += ["tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black"]  # every arm drawn
    if all(r.arm.strategy == "p2c" and r.arm.optimistic for r in results):
        colours = ["tab:green", "tab:blue", "tab:purple"]  # --isolation-only
    for r, c in zip(results, colours, strict=False):
        ax1.plot(
            r.times, smooth(r.max_occ), color=c, lw=1.0, label=f"{r.arm.label}: fullest replica"
        )
        ax1.plot(r.times, smooth(r.mean_occ), color=c, lw=0.9, ls="--", alpha=0.6)
    ax1.axhline(0.85, color="black", lw=0.6, ls=":", label="standard ceiling 0.85")
    ax1.set_ylabel("KV occupancy, 2 s rolling mean\n(solid: fullest replica, dashed: fleet)")
    ax1.set_xlabel("simulated seconds")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title("Fullest replica vs fleet mean, scraped every 250 ms")
    for r, c in zip(results, colours, strict=False):
        xs = np.sort(np.array(r.ttft))
        if len(xs):
            ax2.plot(xs, np.linspace(0, 1, len(xs)), color=c, label=r.arm.label)
    ax2.set_xscale("log")
    ax2.set_xlabel("TTFT (s, log)")
    ax2.set_ylabel("CDF")
    ax2.axhline(0.99, color="black", lw=0.5, ls=":")
    ax2.legend(fontsize=7, loc="lower right")
    fig.text(0.01, 0.005, command, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Inline:
    """``ProcessPoolExecutor``'s ``submit`` run in this process (one worker)."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, fn: Callable[..., ArmResult], *args: object) -> Future[ArmResult]:
        fut: Future[ArmResult] = Future()
        fut.set_result(fn(*args))
        return fut


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.herd", description=__doc__.split("\n")[0])
    d = HerdConfig()
    ap.add_argument("--replicas", type=int, default=d.replicas)
    ap.add_argument(
        "--rates",
        default="60,65",
        help="comma-separated request rates (req/s); the plot shows the first",
    )
    ap.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds")
    ap.add_argument("--warmup", type=float, default=d.warmup_s)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--seeds",
        default="",
        help="comma-separated seeds: one run per rate and seed, one row each "
        "(writes herd_seeds.md; the p99s of one seed are noisy)",
    )
    ap.add_argument(
        "--arms",
        default="",
        help="comma-separated arm labels to run (default: all)",
    )
    ap.add_argument(
        "--draws",
        type=int,
        default=1,
        help="runs per seed with other router rng seeds and tenant salts (the routing's own "
        "randomness; the summary is over every seed and draw)",
    )
    ap.add_argument(
        "--first-draw",
        type=int,
        default=0,
        help="number the draws from here (draw 0 is the plain run of a seed)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--isolation-only",
        action="store_true",
        help="only P2C + in-flight with and without the long-context placement rules "
        "(and with the budget too) (writes herd_isolation.md)",
    )
    ap.add_argument(
        "--replica-cap",
        type=int,
        default=0,
        help="every replica with this --long-prefill-token-threshold (the platform's: 5242)",
    )
    ap.add_argument(
        "--drain",
        type=float,
        default=0.0,
        help="simulated seconds each run goes on after --duration, arrivals and all, so that "
        "the measured requests finish",
    )
    ap.add_argument(
        "--classes",
        action="store_true",
        help="plan classes 10 %% reserved / 80 %% standard / 10 %% free (the fleet "
        "simulation's mix), each under its own ceiling and vLLM priority",
    )
    ap.add_argument(
        "--reserved-pool", type=int, default=0, help="the first K replicas a reserved pool"
    )
    ap.add_argument(
        "--heavy-tenants",
        type=int,
        default=0,
        help="standard tenants flooding 128k-token prompts on top of the shape",
    )
    ap.add_argument(
        "--heavy-rps", default="0.4", help="comma-separated req/s per flooding tenant, cycled"
    )
    ap.add_argument(
        "--skip-arm",
        action="append",
        default=[],
        metavar="TEXT",
        help="leave out the arms whose label contains TEXT (repeatable)",
    )
    ap.add_argument("--workers", type=int, default=1, help="arms run in this many processes")
    ap.add_argument(
        "--report",
        default="",
        help="the report's name under --out, without .md (default by the options: herd, "
        "herd_isolation, herd_seeds, herd_draws; herd_policy with the deployed configuration)",
    )
    args = ap.parse_args(argv)
    arms = (
        [a for a in ARMS if a.strategy == "p2c" and a.optimistic] if args.isolation_only else ARMS
    )
    if args.arms:
        wanted = {x.strip() for x in args.arms.split(",") if x.strip()}
        unknown = wanted - {a.label for a in ARMS}
        if unknown:
            ap.error(f"unknown arms {sorted(unknown)}; known: {[a.label for a in ARMS]}")
        arms = [a for a in ARMS if a.label in wanted]
    arms = [a for a in arms if not any(t in a.label for t in args.skip_arm)]
    if not arms:
        ap.error("no arm left to run")
    try:
        heavy_rates = tuple(float(x) for x in args.heavy_rps.split(",") if x.strip())
    except ValueError:
        ap.error("--heavy-rps takes numbers, e.g. 0.25,0.5")
    if not heavy_rates or min(heavy_rates) <= 0:
        ap.error("--heavy-rps needs positive rates")
    if not 0 <= args.reserved_pool < args.replicas or args.drain < 0 or args.replica_cap < 0:
        ap.error("need 0 <= --reserved-pool < --replicas, --drain >= 0, --replica-cap >= 0")
    if args.reserved_pool and not args.classes:
        ap.error("--reserved-pool needs --classes (only reserved traffic enters the pool)")
    if not 1 <= args.workers <= 4:
        ap.error("--workers takes 1 to 4")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [args.seed]
    except ValueError:
        ap.error("--seeds takes integers, e.g. 7,8,9")
    name = "herd_isolation" if args.isolation_only else "herd"
    if len(seeds) > 1:
        name = "herd_seeds" if args.draws == 1 and not args.first_draw else "herd_draws"
    deployed = (args.replica_cap, args.drain, args.classes, args.reserved_pool, args.heavy_tenants)
    if any(deployed):
        name = "herd_policy"
    name = args.report or name
    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        ap.error("--rates takes numbers, e.g. 60,65")
    if not rates or min(rates) <= 0 or args.replicas < 2:
        ap.error("need positive rates and at least 2 replicas")
    if not 0 <= args.warmup < args.duration:
        ap.error("need 0 <= warmup < duration")
    command = (
        "python -m bench.herd " + " ".join(argv if argv is not None else sys.argv[1:])
    ).strip()
    configs: list[HerdConfig] = []
    if args.draws < 1 or args.first_draw < 0:
        ap.error("--draws must be at least 1 and --first-draw at least 0")
    draws = range(args.first_draw, args.first_draw + args.draws)
    for rate, seed, draw in ((r, s, d) for r in rates for s in seeds for d in draws):
        cfg = HerdConfig(
            replicas=args.replicas,
            rate_rps=rate,
            duration_s=args.duration,
            warmup_s=args.warmup,
            seed=seed,
            draw=draw,
            long_prefill_tokens=args.replica_cap,
            drain_s=args.drain,
            class_mix=(0.10, 0.80, 0.10) if args.classes else (),
            reserved_replicas=args.reserved_pool,
            heavy_tenants=args.heavy_tenants,
            heavy_rates=heavy_rates,
        )
        configs.append(cfg)
    runs: list[tuple[HerdConfig, list[ArmResult]]] = [(cfg, []) for cfg in configs]
    pool = ProcessPoolExecutor(max_workers=args.workers) if args.workers > 1 else _Inline()
    with pool as ex:
        futures = []
        for k, cfg in enumerate(configs):
            work = workload(cfg)
            futures += [(ex.submit(run_arm, cfg, arm, work), k) for arm in arms]
        for fut, k in futures:  # in submission order: each run's arms in order
            r = fut.result()
            if not runs[k][1]:
                print(f"herd: {configs[k]}", flush=True)
            print(
                f"  {r.arm.label:32s} max occ {np.mean(r.max_occ):.3f} mean "
                f"{np.mean(r.mean_occ):.3f} TTFT p99 {pct(r.ttft, 99) * 1000:.0f} ms "
                f"({r.wall_s:.1f} s)",
                flush=True,
            )
            runs[k][1].append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(report(runs, command, name))
    plot(runs[0][0], runs[0][1], args.out / f"{name}.png", command)
    print(f"wrote {args.out / (name + '.md')} and {args.out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
