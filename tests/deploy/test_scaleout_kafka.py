"""Kafka partitions and a consumer group, against the embedded Kafka-protocol broker (Tansu)
and two real usage-consumer workers (`celery worker --usage-consumer`, as deployed).

Two consumers in one group split usage.v1's four partitions; one dies at the worst moment
(its batch committed to PostgreSQL, its offsets not: fault injection), the group rebalances
and the survivor takes its partitions over, re-reads the uncommitted batch, and the totals
are exact: nothing lost, nothing counted twice.

What the embedded broker does not give this test (see docs/operations.md): one broker, no
replication (no ISR, no leader failover, acks=all means this broker), in-memory storage (a
broker restart loses the topic), and its DescribeGroups answer carries an
authorized-operations value kafka-python cannot parse, so the assignment is read from the
consumers' own logs instead of from the broker.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.prom_parse import metric_sum
from metering.models import DeadLetter
from tests.metering.conftest import (  # noqa: F401 - fixtures
    Producer,
    Worker,
    create_topic,
    event,
    ingest_kafka,
    make_world,
    producer,
    request_log_count,
    start_worker,
    usage_totals,
    wait_for_requests,
)
from tests.support import free_port, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PARTITIONS = 4
TENANTS = 16
PER_TENANT = 150
BATCH = 100


def assignment(worker: Worker) -> set[int] | None:
    """The partitions of the worker's last assignment (kafka-python logs each one)."""
    lines = [ln for ln in worker.log().splitlines() if "Setting newly assigned partitions" in ln]
    if not lines:
        return None
    return {int(p) for p in re.findall(r"partition=(\d+)", lines[-1])}


def metric(port: int, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return metric_sum(text, name, **labels) or 0.0


def test_two_consumers_split_the_partitions_and_a_rebalance_loses_and_doubles_nothing(
    transactional_db: None,
    ingest_kafka: str,  # noqa: F811
    producer: Producer,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
) -> None:
    world = make_world(TENANTS)
    topic = f"usage-scale-{uuid.uuid4().hex[:8]}"
    create_topic(ingest_kafka, topic, partitions=PARTITIONS)
    group = f"billing-{uuid.uuid4().hex[:6]}"
    ports = [free_port(), free_port()]

    def worker(port: int, **env: str) -> Worker:
        return start_worker(
            tmp_path,
            bootstrap=ingest_kafka,
            topic=topic,
            group=group,
            redis_url=redis_url,
            env={
                "FAIRWAY_INGEST_BATCH_MAX": str(BATCH),
                "FAIRWAY_INGEST_METRICS_PORT": str(port),
                **env,
            },
        )

    # The first dies right after its second batch's transaction commits, before its offsets.
    doomed = worker(ports[0], FAIRWAY_INGEST_FAULT_KILL_AFTER="2")
    survivor = worker(ports[1])
    try:

        def split() -> bool:
            for w in (doomed, survivor):
                assert w.process.poll() is None, w.log()
            a, b = assignment(doomed), assignment(survivor)
            return bool(a and b and len(a) == len(b) == 2 and a | b == set(range(PARTITIONS)))

        wait_until(split, 60, interval=0.2, what="the group to split the partitions 2 + 2")
        events: list[dict[str, Any] | bytes] = [
            event(world, tenant_id=str(t), prompt_tokens=i % 40 + 10, completion_tokens=i % 9)
            for t in world.tenants
            for i in range(PER_TENANT)
        ]
        total = len(events)
        producer.send(topic, events)

        assert doomed.process.wait(90) == -9, doomed.log()
        assert "fault injection: SIGKILL after batch 2" in doomed.log()
        # The dead member's partitions move to the survivor (after the session timeout).
        wait_until(
            lambda: assignment(survivor) == set(range(PARTITIONS)),
            60,
            interval=0.2,
            what="the survivor to take over every partition",
        )
        wait_for_requests(world.tenants, total, timeout=120)
        assert request_log_count(world.tenants) == total
        assert not DeadLetter.objects.filter(topic=topic).exists()
        for t in world.tenants:
            assert usage_totals(tenant_id=t) == {
                "requests": PER_TENANT,
                "prompt_tokens": sum(i % 40 + 10 for i in range(PER_TENANT)),
                "cached_tokens": 10 * PER_TENANT,
                "completion_tokens": sum(i % 9 for i in range(PER_TENANT)),
                "cancelled_requests": 0,
                "errored_requests": 0,
            }
        # The batch the dead consumer stored but never acknowledged was read again by the
        # survivor, and recognised: duplicates, not double counts.
        assert metric(ports[1], "fairway_ingest_events_total", outcome="duplicate") >= 1
    finally:
        doomed.kill()
        assert survivor.terminate() == 0, survivor.log()
