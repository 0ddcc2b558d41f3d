"""A worker process for the overshoot proof: many asyncio clients on one tenant.

Importable by ``multiprocessing`` (spawn), so it lives outside the test module.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter, QuotaRequest


@dataclass(frozen=True)
class Scenario:
    redis_url: str
    tenant: str
    rpm: int
    tpm: int
    kv_cap: int
    est_tokens: tuple[int, int]  # uniform range
    est_kv: tuple[int, int]
    hold_ms: tuple[int, int] | None  # None: never settle
    clients: int
    duration_s: float
    seed: int


# (admitted, store_ms, est_tokens, est_kv, inflight_before)
Record = tuple[bool, int, int, int, int]


async def _run(sc: Scenario) -> list[Record]:
    client = aioredis.Redis.from_url(sc.redis_url, socket_timeout=10, max_connections=sc.clients)
    limiter = Limiter(client, AdmissionConfig())
    rng = random.Random(sc.seed)
    records: list[Record] = []
    deadline = time.monotonic() + sc.duration_s

    async def one(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            est_t = rng.randint(*sc.est_tokens)
            est_kv = rng.randint(*sc.est_kv)
            q = QuotaRequest(
                f"p{sc.seed}-c{i}-{n}",
                sc.tenant,
                "fam",
                "fam-v1",
                sc.rpm,
                sc.tpm,
                est_t,
                est_kv,
                sc.kv_cap,
                1000,
                is_retry=False,
                retry_exempt=False,
            )
            n += 1
            d = await limiter.admit(q)
            assert not d.degraded, "the proof must run against Redis"
            records.append((d.admitted, d.store_ms, est_t, est_kv, d.inflight_kv_milli))
            if d.grant is not None and sc.hold_ms is not None:
                await asyncio.sleep(rng.randint(*sc.hold_ms) / 1000)
                await limiter.settle(d.grant, actual_tokens=est_t, refund_request=False)
            else:
                await asyncio.sleep(rng.uniform(0.002, 0.01))

    await asyncio.gather(*(one(i) for i in range(sc.clients)))
    await client.aclose()
    return records


def hammer(sc: Scenario) -> list[Record]:
    return asyncio.run(_run(sc))
