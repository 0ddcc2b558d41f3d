"""Synthetic workloads in model time: the platform's token shape and an open-loop runner.

For tests and benches that drive an ``Engine`` directly (no HTTP, no wall clock). The token shape
is docs/design.md §2: prompt p50 800 / p95 6,000 and output p50 300 / p95 1,200, both fitted as
lognormals (median m, sigma = ln(p95/m) / 1.645). Output lengths come from the engine's own
natural-end draw, so only prompts are sampled here.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from emulator.engine import Engine, Request, StepResult

Z95 = 1.6448536269514722


@dataclass(frozen=True, slots=True)
class Arrival:
    time: float  # model seconds
    prompt_len: int
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None
    ignore_eos: bool = False


def lognormal_sampler(
    median: float, p95: float, low: int = 1, high: int | None = None
) -> Callable[[random.Random], int]:
    sigma = math.log(p95 / median) / Z95
    mu = math.log(median)

    def sample(rng: random.Random) -> int:
        value = max(low, round(rng.lognormvariate(mu, sigma)))
        return min(value, high) if high is not None else value

    return sample


def poisson_arrivals(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    prompt_median: float = 800,
    prompt_p95: float = 6000,
    prompt_max: int = 32_000,
    max_tokens: int = 8192,
) -> list[Arrival]:
    """Open-loop Poisson arrivals at ``rate`` req/s for ``duration`` model seconds."""
    rng = random.Random(seed)
    prompt = lognormal_sampler(prompt_median, prompt_p95, low=1, high=prompt_max)
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < duration:
        out.append(Arrival(t, prompt(rng), max_tokens))
        t += rng.expovariate(rate)
    return out


def synthetic_prompt(index: int, length: int) -> range:
    """Distinct token ids per request (no accidental prefix sharing), cheap to build."""
    base = 4096 + (index * 7_919_011) % 100_000_000
    return range(base, base + length)


def run_arrivals(
    engine: Engine,
    arrivals: Iterable[Arrival],
    *,
    horizon: float | None = None,
    on_step: Callable[[Engine, StepResult], None] | None = None,
    id_prefix: str = "req",
) -> list[Request]:
    """Feed ``arrivals`` to ``engine`` at their model times and step it until idle (or past
    ``horizon``). Arrivals landing mid-step join at the step's end with their true arrival
    time, so TTFT includes the wait. Returns the requests in arrival order."""
    pending = deque(sorted(arrivals, key=lambda a: a.time))
    requests: list[Request] = []
    while pending or engine.has_work():
        while pending and pending[0].time <= engine.now:
            arrival = pending.popleft()
            requests.append(
                engine.add_request(
                    f"{id_prefix}{len(requests)}",
                    synthetic_prompt(len(requests), arrival.prompt_len),
                    arrival.max_tokens,
                    priority=arrival.priority,
                    arrival_time=arrival.time,
                    cache_salt=arrival.cache_salt,
                    ignore_eos=arrival.ignore_eos,
                )
            )
        if not engine.has_work():
            engine.advance_to(pending[0].time)
            continue
        result = engine.step()
        if on_step is not None:
            on_step(engine, result)
        if horizon is not None and engine.now >= horizon:
            break
    return requests
