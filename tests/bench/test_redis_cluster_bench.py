"""A tiny run of the Redis Cluster admission bench: it measures every arm and writes the
report that docs/operations.md quotes."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from bench.redis_cluster import ARMS, main


def test_redis_cluster_bench_writes_every_arm_of_every_run(tmp_path: Path) -> None:
    args = argparse.Namespace(calls=128, concurrency=16, runs=2, out=tmp_path)
    asyncio.run(main(args))
    text = (tmp_path / "redis_cluster.md").read_text()
    assert "--calls 128 --concurrency 16 --runs 2" in text
    for label, _ in ARMS:
        assert f"| {label} | 1 |" in text and f"| {label} | 2 |" in text
