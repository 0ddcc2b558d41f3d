"""Admission round trips on a loopback 3-master Redis Cluster through the gateway's
slot-routed script channel, and on a single node through its channel for reference. (The
channel is admission's only path; redis-py's ``RedisCluster`` script calls, once an arm
here, are no longer in the limiter; docs/operations.md keeps that arm's last figures.)

    python -m bench.redis_cluster [--calls 20000] [--concurrency 64] [--runs 2]

Prints and writes to bench/results/redis_cluster.md (``--out``) admissions per second and
mean CPU microseconds per admission of this process (the gateway's share; Redis runs in
other processes), for each run. docs/operations.md quotes these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from dataclasses import replace
from pathlib import Path

import redis.asyncio as aioredis

from fairway.embedded import EmbeddedServices
from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter, QuotaRequest
from gateway.redis_client import connect

BASE = QuotaRequest(
    "r",
    "t",
    "fam",
    "fam-v1",
    rpm=0,
    tpm=0,
    est_tokens=10,
    est_kv_milli=1,
    kv_cap_milli=0,
    expected_ms=1000,
    is_retry=False,
    retry_exempt=False,
)


RESULTS = Path(__file__).parent / "results"
ARMS = (
    ("single Redis, script channel", "single"),
    ("cluster, slot-routed channel", "cluster"),
)


async def _run(client: aioredis.Redis, calls: int, concurrency: int) -> tuple[float, float]:
    """(admit+settle pairs per second, this process's CPU µs per pair)."""
    lim = Limiter(client, AdmissionConfig())
    ids = itertools.count()

    async def worker(n: int) -> None:
        for _ in range(n):
            i = next(ids)
            d = await lim.admit(replace(BASE, request_id=f"r{i}", tenant_id=f"t{i % 500}"))
            assert d.admitted and not d.degraded and d.grant is not None
            await lim.settle(d.grant, actual_tokens=5, refund_request=False)

    await worker(200)  # warm: scripts loaded, slot map taken, connections open
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = calls // concurrency * concurrency
    await lim.aclose()
    return done / wall, cpu / done * 1e6


def report(
    runs: list[dict[str, tuple[float, float]]], args: argparse.Namespace, load: tuple[float, float]
) -> str:
    lines = [
        "# Admission on a Redis Cluster\n",
        f"Command: `python -m bench.redis_cluster --calls {args.calls} --concurrency "
        f"{args.concurrency} --runs {args.runs}`. Machine: {os.cpu_count()} cores, shared with "
        f"other work: load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the "
        "end.\n",
        "One process (the gateway's share) runs `Limiter.admit` + `settle` for 500 tenants, "
        f"{args.concurrency} at a time, against a single embedded Redis and a loopback "
        "3-master cluster (`fairway.embedded`, no replicas). CPU is this process's "
        "user+system time per admit+settle pair; Redis runs in other processes. On a busy "
        "2-core machine the client's CPU, not Redis, is the limit.\n",
        "| arm | run | admit+settle pairs/s | client CPU µs per pair |",
        "|---|---:|---:|---:|",
    ]
    for i, run in enumerate(runs, 1):
        for label, (rate, us) in run.items():
            lines.append(f"| {label} | {i} | {rate:,.0f} | {us:,.0f} |")
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> None:
    load_start = os.getloadavg()[0]
    svc = EmbeddedServices()
    runs: list[dict[str, tuple[float, float]]] = []
    try:
        urls = {"cluster": svc.start_redis_cluster(3)[0], "single": svc.start_redis()}
        for _ in range(args.runs):
            run: dict[str, tuple[float, float]] = {}
            for label, where in ARMS:
                client = connect(urls[where], timeout_s=5, cluster=where == "cluster")
                run[label] = await _run(client, args.calls, args.concurrency)
                await client.aclose()
                rate, us = run[label]
                print(f"{label:34} {rate:8.0f} admit+settle/s  {us:6.0f} µs CPU each")
            runs.append(run)
    finally:
        svc.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "redis_cluster.md").write_text(report(runs, args, (load_start, os.getloadavg()[0])))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    asyncio.run(main(parser.parse_args()))
