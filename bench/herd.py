"""Routing herd (docs/design.md C5, R5): "pick the emptiest" on stale occupancy vs power of
two choices with optimistic in-flight KV, vs round robin.

Replicas are the emulator's own ``emulator.engine.Engine`` (70B TP4 profile: paged KV, chunked
prefill, preemption) stepped in virtual time; the router is the gateway's own
``gateway.admission.router.Router`` over ``gateway.admission`` policy modules (imported, not
copied), fed the way the gateway's scraper feeds it: every 250 ms each replica's
``kv_cache_usage_perc``, and nothing in between. Every arm replays the same seeded arrivals
(Poisson, the prompt shape of docs/design.md §2, the engine's seeded output lengths), all requests
standard class (ceiling 0.85).

``python -m bench.herd`` writes bench/results/herd.md and herd.png (well under 2 minutes).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.noisy_neighbour import threshold_prefill_rate  # noqa: E402
from bench.sim import SimRegistry, VirtualFleet, feed, replica_records, sim_version  # noqa: E402
from bench.stats import percentile as pct  # noqa: E402
from bench.workload import (
    DESIGN_PROMPT,  # noqa: E402
    poisson_arrivals,  # noqa: E402
)
from emulator.engine import Engine, Request  # noqa: E402
from emulator.profiles import get_profile  # noqa: E402
from emulator.replica_flags import platform_engine_config  # noqa: E402
from gateway.admission.config import AdmissionConfig, Strategy  # noqa: E402
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

    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(
            strategy=self.strategy,
            optimistic_inflight=self.optimistic,
            count_request_kv=self.isolation,
            context_placement=self.isolation,
            affinity_rendezvous=self.rendezvous,
            affinity_conversation_shared=self.conversation_shared,
        )


ARMS = (
    Arm("round robin", "round_robin", False),
    Arm("pick emptiest (stale 250 ms)", "emptiest", False),
    Arm("P2C (stale, no in-flight)", "p2c", False),
    Arm("P2C + optimistic in-flight", "p2c", True),
    Arm("P2C + in-flight + long-context placement", "p2c", True, isolation=True),
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


def arrivals(cfg: HerdConfig) -> list[tuple[float, int, int]]:
    """The seed's requests: (arrival time, prompt length, first token id). A prompt's token
    ids are consecutive from its first, drawn from the seed like the rest (after the times
    and lengths, which stay what they were): under cache-aware routing the ids decide the
    chain hashes, hence the placement keys, so each seed is an independent draw of them too
    (they used to be the same for every seed). Every arm of a seed replays these."""
    rng = np.random.default_rng(cfg.seed)
    times = poisson_arrivals(rng, cfg.rate_rps, 0.0, cfg.duration_s)
    prompts = DESIGN_PROMPT.sample(rng, len(times))
    firsts = rng.integers(1 << 20, 1 << 52, size=len(times))
    return [(float(t), int(p), int(f)) for t, p, f in zip(times, prompts, firsts, strict=True)]


def prompt_tokens(first: int, length: int) -> range:
    """A request's prompt token ids: unique to it (no shared prefix in the herd)."""
    return range(first, first + length)


def run_arm(cfg: HerdConfig, arm: Arm, work: list[tuple[float, int, int]]) -> ArmResult:
    started = time.perf_counter()
    profile = get_profile(cfg.profile)
    engines = [
        Engine(profile, platform_engine_config(enable_prefix_caching=False), seed=cfg.seed + i)
        for i in range(cfg.replicas)
    ]
    records = replica_records(cfg.replicas)
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
    out = ArmResult(arm)

    def scraped(t: float) -> None:
        if t >= cfg.warmup_s:
            occ = [s.kv_usage for s in states]
            out.times.append(t)
            out.max_occ.append(max(occ))
            out.mean_occ.append(sum(occ) / len(occ))

    fleet = VirtualFleet(
        engines, states, cfg.scrape_s, lambda i, res: feed((router,), records[i], res), scraped
    )
    router = Router(
        SimRegistry(VERSION, states),
        random.Random(cfg.seed + 7919 * cfg.draw),
        config=arm.admission(),
        clock=fleet.clock,
    )
    live: list[tuple[Request, float]] = []
    ids = 0
    for t, prompt_len, first_token in work:
        fleet.run_to(t)
        kv_bytes = prompt_len * profile.kv_bytes_per_token
        long_context = arm.isolation and prompt_len >= threshold
        tokens = prompt_tokens(first_token, prompt_len)
        query = None
        if arm.strategy == "cache_aware":
            salt = f"{ids % 16:064x}" if cfg.draw == 0 else f"{cfg.draw}:{ids % 16}"
            # the prompt as one user message (no template: its end one token early, where a
            # templated message's end-of-turn token would be)
            first = (0, len(tokens) - 1) if arm.conversation_key else None
            query = query_from_tokens(f"t{ids % 16}", tokens, salt, 16, first_user=first)
        # as the gateway: a long context's expected output KV is reserved on its replica
        growth = cfg.max_tokens * profile.kv_bytes_per_token if long_context else 0
        replica = router.choose(
            version,
            "standard",
            kv_bytes,
            long_context=long_context,
            prefix=query,
            growth_bytes=growth,
        )
        if replica is None:
            if t >= cfg.warmup_s:
                out.rejected += 1
            continue
        idx = int(replica.replica_id[1:])
        ids += 1
        rid = f"q{ids}"
        req = engines[idx].add_request(rid, tokens, cfg.max_tokens, priority=1, arrival_time=t)
        router.on_dispatch(
            replica, rid, kv_bytes, long_context=long_context, prefix=query, growth_bytes=growth
        )
        if t >= cfg.warmup_s:
            out.admitted += 1
            live.append((req, t))
    fleet.finish(cfg.duration_s)
    end = cfg.duration_s
    for req, arrived in live:
        # a request still waiting for its first token at the end counts with what it
        # has waited so far (a lower bound), so the worst cases are not dropped
        out.ttft.append(req.ttft if req.ttft is not None else end - arrived)
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
        f"p50 300 / p95 1,200 (max_tokens {cfg.max_tokens}), all standard class (ceiling "
        f"0.85). Occupancy reaches the router only through a scrape every "
        f"{cfg.scrape_s * 1000:.0f} ms. {cfg.duration_s:g} s simulated per arm, the first "
        f"{cfg.warmup_s:g} s (fill-up) excluded. Seed {', '.join(map(str, seeds))}; every arm "
        "of a load and seed replays "
        "the same arrivals. Router: `gateway.admission.router.Router` over "
        "the `gateway.admission` policy modules, as in the gateway.",
        "",
        "| load | routing | mean occupancy | mean of max replica | p99 of max replica | "
        "max/mean | TTFT p50 | TTFT p99 | TPOT p99 | preemptions | 503 (no eligible replica) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
            )
    lines.append("")
    for run_cfg, results in runs:
        best = next(
            (
                r
                for r in results
                if r.arm.strategy == "p2c" and r.arm.optimistic and not r.arm.isolation
            ),
            None,
        )
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
        if iso is not None:
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
            "| load | routing | 503 mean | TPOT p99 median | TPOT p99 max | TTFT p99 median |",
            "|---|---|---|---|---|---|",
        ]
        by_arm: dict[tuple[float, str], list[ArmResult]] = {}
        for run_cfg, results in runs:
            for r in results:
                by_arm.setdefault((run_cfg.rate_rps, r.arm.label), []).append(r)
        for (rate, label), rs in by_arm.items():
            tpots = [pct(r.tpot, 99) * 1000 for r in rs]
            ttfts = [pct(r.ttft, 99) * 1000 for r in rs]
            lines.append(
                f"| {rate:g} req/s | {label} | {np.mean([r.rejected for r in rs]):.0f} | "
                f"{np.median(tpots):.1f} ms | {max(tpots):.1f} ms | {np.median(ttfts):.0f} ms |"
            )
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
    colours = ["tab:gray", "tab:red", "tab:orange", "tab:green", "tab:blue"]
    if len(results) == 2:
        colours = ["tab:green", "tab:blue"]
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
        "(writes herd_isolation.md)",
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
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [args.seed]
    except ValueError:
        ap.error("--seeds takes integers, e.g. 7,8,9")
    name = "herd_isolation" if args.isolation_only else "herd"
    if len(seeds) > 1:
        name = "herd_seeds" if args.draws == 1 and not args.first_draw else "herd_draws"
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
    runs = []
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
        )
        print(f"herd: {cfg}", flush=True)
        work = arrivals(cfg)
        results = []
        for arm in arms:
            r = run_arm(cfg, arm, work)
            print(
                f"  {arm.label:32s} max occ {np.mean(r.max_occ):.3f} mean "
                f"{np.mean(r.mean_occ):.3f} TTFT p99 {pct(r.ttft, 99) * 1000:.0f} ms "
                f"({r.wall_s:.1f} s)",
                flush=True,
            )
            results.append(r)
        runs.append((cfg, results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(report(runs, command, name))
    plot(runs[0][0], runs[0][1], args.out / f"{name}.png", command)
    print(f"wrote {args.out / (name + '.md')} and {args.out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
