"""The occupancy cliff (docs/design.md §7) on one 70B replica, measured on the emulator's
real ``Engine``.

Poisson arrivals with the token shape of docs/design.md §2 go straight into one replica (no
gateway: the cliff is the replica's own behaviour) at a sweep of rates. Each point reports the mean
KV occupancy, TPOT and TTFT percentiles and preemptions per minute, all in model time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.stats import percentile
from bench.workload import DESIGN_OUTPUT, DESIGN_PROMPT
from emulator.engine import Engine
from emulator.profiles import Profile
from emulator.replica_flags import platform_engine_config


@dataclass(frozen=True, slots=True)
class CliffPoint:
    rate_rps: float
    occupancy: float  # time-weighted mean over the measured window
    tpot_p50: float
    tpot_p95: float
    ttft_p95: float
    preemptions_per_min: float
    out_tokens_per_s: float
    completed: int
    wall_s: float


def _arrivals(rate: float, duration: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, int(rate * 1000)])
    n = int(rate * duration * 1.3) + 50
    t = np.cumsum(rng.exponential(1.0 / rate, size=n))
    t = t[t < duration]
    return t, DESIGN_PROMPT.sample(rng, len(t)), DESIGN_OUTPUT.sample(rng, len(t))


def run_engine(
    profile: Profile, rate: float, duration: float, warmup: float, seed: int = 1
) -> CliffPoint:
    started = time.perf_counter()
    eng = Engine(profile, platform_engine_config(enable_prefix_caching=False), seed=seed)
    times, prompts, outputs = _arrivals(rate, duration, seed)
    i, n = 0, len(times)
    occ_area = 0.0
    tpots: list[float] = []
    ttfts: list[float] = []
    pre0 = 0
    tok0 = 0
    while True:
        while i < n and times[i] <= eng.now:
            eng.add_request(
                f"r{i}",
                [4096 + i % 100_000] * int(prompts[i]),
                int(outputs[i]),
                priority=1,
                arrival_time=float(times[i]),
                ignore_eos=True,
            )
            i += 1
        if eng.now >= duration:
            break
        if not eng.has_work():
            if i >= n:
                break
            eng.advance_to(float(times[i]))
            continue
        before = eng.now
        occ = eng.kv_usage()
        res = eng.step()
        if before < warmup <= eng.now:
            pre0 = eng.stats.num_preemptions
            tok0 = eng.stats.generation_tokens
        if before >= warmup:
            occ_area += occ * res.duration
        for req in res.finished:
            if req.arrival_time >= warmup and req.first_token_time is not None:
                ttfts.append(req.first_token_time - req.arrival_time)
                if req.num_output > 1:
                    tpots.append((req.finish_time - req.first_token_time) / (req.num_output - 1))
    window = max(1e-9, eng.now - warmup)
    return CliffPoint(
        rate,
        occ_area / window,
        percentile(tpots, 50),
        percentile(tpots, 95),
        percentile(ttfts, 95),
        (eng.stats.num_preemptions - pre0) * 60 / window,
        (eng.stats.generation_tokens - tok0) / window,
        len(tpots),
        time.perf_counter() - started,
    )
