"""A 60 s broker outage between the gateway's producer, the broker and the consumer: nothing
is lost, nothing is counted twice, and the lag drains.

The embedded broker keeps its data in memory, so killing it would lose acknowledged events
(the broker's loss, not ours). It is therefore started advertising a loopback proxy's
address, and the outage is the proxy going down: every client loses the broker, the broker
keeps its data, and coming back is the proxy listening again on the same port.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gateway.metrics import GatewayMetrics
from gateway.usage.events import UsageEvent
from gateway.usage.producer import UsageProducer
from metering.consumer import ConsumerConfig, UsageConsumer
from tests.gateway.tcpproxy import TcpProxy
from tests.metering.conftest import World, create_topic, usage_totals, wait_for_requests
from tests.support import proxied_kafka, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

OUTAGE_S = 60.0


@pytest.fixture
def proxied_broker() -> Iterator[tuple[str, TcpProxy]]:
    with proxied_kafka() as broker:
        yield broker


def usage_event(world: World, i: int) -> UsageEvent:
    tenant = world.tenants[i % len(world.tenants)]
    return UsageEvent(
        request_id=f"outage-{uuid.uuid4().hex}",
        tenant_id=str(tenant),
        api_key_id=str(world.key),
        model="llama-8b",
        model_version=world.version.name,
        replica_id="r1",
        started_at=datetime.now(UTC).isoformat(),
        prompt_tokens=10 + i % 5,
        completion_tokens=i % 3,
        cached_tokens=0,
        ttft_ms=1.0,
        tpot_ms=None,
        finish_reason="stop",
        status=200,
        is_retry=False,
    )


def end_offsets(bootstrap: str, topic: str) -> dict[Any, int]:
    """Each partition's next offset, found by reading it to the end. (The embedded broker's
    ListOffsets answer is not usable: it reports 1 for a partition holding hundreds of
    records, so end_offsets() cannot be trusted here.)"""
    from kafka import KafkaConsumer, TopicPartition

    reader = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in reader.partitions_for_topic(topic) or ()]
        reader.assign(partitions)
        reader.seek_to_beginning()
        ends = dict.fromkeys(partitions, 0)
        idle_until = time.monotonic() + 3.0
        while time.monotonic() < idle_until:
            for tp, records in reader.poll(timeout_ms=200).items():
                ends[tp] = max(ends[tp], records[-1].offset + 1)
                idle_until = time.monotonic() + 3.0
        return ends
    finally:
        reader.close(autocommit=False)


def committed_offsets(bootstrap: str, group: str, partitions: list[Any]) -> dict[Any, int]:
    """The group's committed offsets, read without joining (and disturbing) the group."""
    from kafka import KafkaConsumer

    probe = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return {tp: probe.committed(tp) or 0 for tp in partitions}
    finally:
        probe.close(autocommit=False)


def test_a_60s_broker_outage_loses_nothing_and_the_lag_drains(
    world: World, proxied_broker: tuple[str, TcpProxy], tmp_path: Path
) -> None:
    bootstrap, proxy = proxied_broker
    topic = f"usage-outage-{uuid.uuid4().hex[:8]}"
    group = f"billing-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic)
    producer = UsageProducer(
        spool_dir=tmp_path / "spool",
        bootstrap=bootstrap,
        topic=topic,
        metrics=GatewayMetrics(),
        instance_id="outage",
    )
    producer.start()
    consumer = UsageConsumer(
        ConsumerConfig(bootstrap=bootstrap, topic=topic, group_id=group, batch_max=200)
    )
    consumer.start()
    emitted: list[UsageEvent] = []
    try:
        before = [usage_event(world, i) for i in range(3000)]
        for e in before:
            producer.emit(e)
        emitted += before
        wait_until(
            lambda: usage_totals(tenant_id__in=world.tenants)["requests"] > 0,
            60,
            interval=0.05,
            what="consumption under way",
        )
        proxy.down()
        cut_at = time.monotonic()
        # The gateway keeps serving during the outage: its events wait in its spool.
        during = [usage_event(world, i) for i in range(3000, 5000)]
        for i, e in enumerate(during):
            producer.emit(e)
            if i % 500 == 499:
                time.sleep(OUTAGE_S / 8)  # spread over the outage (the outage's duration)
        emitted += during
        remaining = OUTAGE_S - (time.monotonic() - cut_at)
        if remaining > 0:
            time.sleep(remaining)
        stalled = usage_totals(tenant_id__in=world.tenants)["requests"]
        assert stalled < len(emitted)
        assert consumer.running and producer.depth > 0
        proxy.up()

        wait_for_requests(world.tenants, len(emitted), timeout=120)
        wait_until(lambda: producer.depth == 0, 30, interval=0.2, what="spool drained")
        ends = end_offsets(bootstrap, topic)
        assert sum(ends.values()) >= len(emitted)
        wait_until(
            lambda: committed_offsets(bootstrap, group, list(ends)) == ends,
            60,
            interval=0.5,
            what="committed offsets at the end of every partition",
        )
        assert usage_totals(tenant_id__in=world.tenants) == {
            "requests": len(emitted),
            "prompt_tokens": sum(e.prompt_tokens for e in emitted),
            "cached_tokens": 0,
            "completion_tokens": sum(e.completion_tokens for e in emitted),
            "cancelled_requests": 0,
            "errored_requests": 0,
        }
    finally:
        consumer.stop()
        producer.stop(2.0)
        producer.close()
