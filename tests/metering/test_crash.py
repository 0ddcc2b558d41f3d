"""A real ``celery worker --usage-consumer`` SIGKILLed mid-stream, restarted: exact totals."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.metering.conftest import (
    Producer,
    Worker,
    World,
    event,
    request_log_count,
    start_worker,
    usage_totals,
    wait_for_requests,
)
from tests.support import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PER_TENANT = 1500


def test_a_worker_killed_mid_batch_then_restarted_ends_with_exact_totals(
    world: World,
    producer: Producer,
    topic: str,
    ingest_kafka: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    group = f"billing-{uuid.uuid4().hex[:6]}"

    def worker(**env: str) -> Worker:
        return start_worker(
            tmp_path,
            bootstrap=ingest_kafka,
            topic=topic,
            group=group,
            redis_url=redis_url,
            env={"FAIRWAY_INGEST_BATCH_MAX": "250", **env},
        )

    events = [
        event(
            world,
            tenant_id=str(t),
            prompt_tokens=i % 50 + 1,
            cached_tokens=0,
            completion_tokens=i % 7,
            finish_reason="cancelled" if i % 10 == 0 else "stop",
        )
        for t in world.tenants
        for i in range(PER_TENANT)
    ]
    total = len(events)
    producer.send(topic, events)

    # 1. Killed at the worst moment: batch 3's transaction committed, its offsets not.
    first = worker(FAIRWAY_INGEST_FAULT_KILL_AFTER="3")
    assert first.process.wait(90) == -9, first.log()
    counted = usage_totals(tenant_id__in=world.tenants)["requests"]
    assert 0 < counted < total

    # 2. Restarted; SIGKILLed from outside while it works through the rest.
    second = worker()
    try:
        wait_until(
            lambda: usage_totals(tenant_id__in=world.tenants)["requests"] > counted,
            60,
            interval=0.05,
            what="the second worker making progress",
        )
    finally:
        second.kill()

    # 3. Restarted again: everything exactly once.
    third = worker()
    try:
        wait_for_requests(world.tenants, total, timeout=120)
        assert request_log_count(world.tenants) == total
        assert usage_totals(tenant_id__in=world.tenants) == {
            "requests": total,
            "prompt_tokens": sum(e["prompt_tokens"] for e in events),
            "cached_tokens": 0,
            "completion_tokens": sum(e["completion_tokens"] for e in events),
            "cancelled_requests": sum(e["finish_reason"] == "cancelled" for e in events),
            "errored_requests": 0,
        }
    finally:
        assert third.terminate() == 0, third.log()
    assert "fault injection: SIGKILL after batch 3" in first.log()
