"""Routing herd (C5 / R5): "pick the emptiest" on stale occupancy vs power of two choices
with optimistic in-flight KV, vs round robin.

Replicas are the emulator's own ``emulator.engine.Engine`` (70B TP4 profile: paged KV,
chunked prefill, preemption) stepped in virtual time; the router is the gateway's own
``gateway.router.Router`` over ``gateway.policy`` (imported, not copied), fed the way the
gateway's scraper feeds it: every 250 ms each replica's ``kv_cache_usage_perc``, and
nothing in between. Every arm replays the same seeded arrivals (Poisson, §2 prompt
shape, the engine's seeded output lengths), all requests standard class (ceiling 0.85).

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

from bench.workload import DESIGN_PROMPT  # noqa: E402
from emulator.engine import Engine, EngineConfig, Request  # noqa: E402
from emulator.profiles import get_profile  # noqa: E402
from gateway import schema  # noqa: E402
from gateway.policy import AdmissionConfig, Strategy  # noqa: E402
from gateway.replicas import ReplicaState  # noqa: E402
from gateway.router import Router  # noqa: E402

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


@dataclass(frozen=True, slots=True)
class Arm:
    label: str
    strategy: Strategy
    optimistic: bool


ARMS = (
    Arm("round robin", "round_robin", False),
    Arm("pick emptiest (stale 250 ms)", "emptiest", False),
    Arm("P2C (stale, no in-flight)", "p2c", False),
    Arm("P2C + optimistic in-flight", "p2c", True),
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


class SimRegistry:
    """The two queries ``Router`` makes of ``gateway.replicas.ReplicaRegistry``, over
    ``ReplicaState`` objects that the simulated scrape fills like the real scraper does."""

    def __init__(self, states: list[ReplicaState]) -> None:
        self._states = {s.replica_id: s for s in states}
        self._list = states

    def states(self, version: str) -> list[ReplicaState]:
        return self._list if version == VERSION else []

    def state(self, replica_id: str) -> ReplicaState | None:
        return self._states.get(replica_id)


def arrivals(cfg: HerdConfig) -> list[tuple[float, int]]:
    rng = np.random.default_rng(cfg.seed)
    n = int(cfg.rate_rps * cfg.duration_s * 1.2) + 10
    times = np.cumsum(rng.exponential(1.0 / cfg.rate_rps, size=n))
    prompts = DESIGN_PROMPT.sample(rng, n)
    return [(float(t), int(p)) for t, p in zip(times, prompts, strict=True) if t < cfg.duration_s]


def run_arm(cfg: HerdConfig, arm: Arm, work: list[tuple[float, int]]) -> ArmResult:
    started = time.perf_counter()
    profile = get_profile(cfg.profile)
    engines = [
        Engine(profile, EngineConfig(enable_prefix_caching=False), seed=cfg.seed + i)
        for i in range(cfg.replicas)
    ]
    records = [schema.ReplicaRecord(f"r{i}", f"sim://r{i}", "shared") for i in range(cfg.replicas)]
    version = schema.ModelVersionRecord(
        version=VERSION,
        family="llama-70b",
        context_length=profile.max_model_len,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        tpot_target_ms=profile.tpot_target_ms,
        kv_capacity_tokens=engines[0].kv_capacity_tokens,
        replicas=tuple(records),
    )
    states = [ReplicaState(record=r, version=VERSION) for r in records]
    now = [0.0]
    router = Router(
        SimRegistry(states),
        random.Random(cfg.seed),
        config=AdmissionConfig(strategy=arm.strategy, optimistic_inflight=arm.optimistic),
        clock=lambda: now[0],
    )
    out = ArmResult(arm)
    live: list[tuple[Request, float]] = []

    def advance(t: float) -> None:
        for i, e in enumerate(engines):
            while e.has_work() and e.now < t:
                res = e.step()
                for req in res.emitted:
                    if req.num_output == 1:  # as the gateway's relay reports first tokens
                        router.on_first_token(records[i], req.request_id)
                for req in res.finished:
                    router.on_finish(records[i], req.request_id)
            if not e.has_work():
                e.advance_to(t)

    def scrape(t: float) -> None:
        occ = []
        for e, s in zip(engines, states, strict=True):
            s.kv_usage, s.running, s.waiting = e.kv_usage(), e.num_running, e.num_waiting
            s.scraped_at, s.healthy = t, True
            occ.append(s.kv_usage)
        if t >= cfg.warmup_s:
            out.times.append(t)
            out.max_occ.append(max(occ))
            out.mean_occ.append(sum(occ) / len(occ))

    next_scrape = 0.0
    ids = 0
    for t, prompt_len in work:
        while next_scrape <= t:
            advance(next_scrape)
            now[0] = next_scrape
            scrape(next_scrape)
            next_scrape += cfg.scrape_s
        advance(t)
        now[0] = t
        kv_bytes = prompt_len * profile.kv_bytes_per_token
        replica = router.choose(version, "standard", kv_bytes)
        if replica is None:
            if t >= cfg.warmup_s:
                out.rejected += 1
            continue
        idx = int(replica.replica_id[1:])
        ids += 1
        rid = f"q{ids}"
        req = engines[idx].add_request(
            rid,
            range(ids << 20, (ids << 20) + prompt_len),
            cfg.max_tokens,
            priority=1,
            arrival_time=t,
        )
        router.on_dispatch(replica, rid, kv_bytes)
        if t >= cfg.warmup_s:
            out.admitted += 1
            live.append((req, t))
    advance(cfg.duration_s)
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


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(runs: list[tuple[HerdConfig, list[ArmResult]]], command: str) -> str:
    cfg = runs[0][0]
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
        f"{cfg.warmup_s:g} s (fill-up) excluded. Seed {cfg.seed}; every arm of a load replays "
        "the same arrivals. Router: `gateway.router.Router` over `gateway.policy`, as in the "
        "gateway.",
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
        base = next(r for r in results if r.arm.strategy == "emptiest")
        best = next(r for r in results if r.arm.strategy == "p2c" and r.arm.optimistic)
        lines.append(
            f"- {run_cfg.rate_rps:g} req/s: TTFT p99 pick-emptiest / P2C + optimistic in-flight "
            f"= {pct(base.ttft, 99) / pct(best.ttft, 99):.1f}x; fullest replica on average "
            f"{np.mean(base.max_occ):.3f} vs {np.mean(best.max_occ):.3f}."
        )
    lines += [
        "",
        "Occupancy is each replica's true `kv_cache_usage_perc` sampled at every scrape; "
        '"max/mean" is the mean occupancy of the fullest replica over the fleet mean. A '
        "request's TTFT counts from its arrival at the router; a request still without a first "
        "token at the end counts with its wait so far. Ratios compare arms of one run.",
        "",
        "![herd](herd.png)",
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
    colours = ["tab:gray", "tab:red", "tab:orange", "tab:green"]
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
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
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
    for rate in rates:
        cfg = HerdConfig(
            replicas=args.replicas,
            rate_rps=rate,
            duration_s=args.duration,
            warmup_s=args.warmup,
            seed=args.seed,
        )
        print(f"herd: {cfg}", flush=True)
        work = arrivals(cfg)
        results = []
        for arm in ARMS:
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
    (args.out / "herd.md").write_text(report(runs, command))
    plot(runs[0][0], runs[0][1], args.out / "herd.png", command)
    print(f"wrote {args.out / 'herd.md'} and {args.out / 'herd.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
