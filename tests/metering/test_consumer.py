"""The consumer against a real broker and PostgreSQL: duplicates, order, dead letters, crashes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from django.db import connection

from metering.consumer import UsageConsumer
from metering.events import Reason
from metering.models import DeadLetter, Usage
from tests.metering.conftest import (
    Producer,
    World,
    event,
    request_log_count,
    start_worker,
    usage_totals,
    wait_for_requests,
)
from tests.support import free_port, wait_until

pytestmark = pytest.mark.kafka


def test_a_duplicated_event_counts_once(
    world: World, producer: Producer, topic: str, consumers: Callable[..., UsageConsumer]
) -> None:
    consumer = consumers()
    e = event(world, prompt_tokens=7, cached_tokens=0, completion_tokens=3)
    other = event(world, prompt_tokens=1, cached_tokens=0, completion_tokens=1)
    producer.send(topic, [e, e, other])
    wait_for_requests(world.tenants, 2)
    producer.send(topic, [e, other])  # redelivered later, in a later batch
    wait_until(lambda: consumer.totals["duplicate"] >= 3, 30, what="three duplicates seen")
    assert usage_totals(tenant_id__in=world.tenants) == {
        "requests": 2,
        "prompt_tokens": 8,
        "cached_tokens": 0,
        "completion_tokens": 4,
        "cancelled_requests": 0,
        "errored_requests": 0,
    }
    assert request_log_count(world.tenants) == 2


def test_out_of_order_and_late_events_land_in_their_own_hour(
    world: World, producer: Producer, topic: str, consumers: Callable[..., UsageConsumer]
) -> None:
    consumers()
    top = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    hours = [top - timedelta(hours=h) for h in (0, 5, 1, 26, 0, 5)]  # newest first, then older
    producer.send(topic, [event(world, started_at=h.isoformat()) for h in hours])
    wait_for_requests(world.tenants, len(hours))
    late = (
        top - timedelta(days=3, hours=2) + timedelta(minutes=59, seconds=59)
    )  # arrives after newer hours were written
    producer.send(topic, [event(world, started_at=late.isoformat(), finish_reason="timeout")])
    wait_for_requests(world.tenants, len(hours) + 1)
    rows = dict(Usage.objects.filter(tenant_id=world.tenants[0]).values_list("hour", "requests"))
    assert rows == {
        top: 2,
        top - timedelta(hours=1): 1,
        top - timedelta(hours=5): 2,
        top - timedelta(hours=26): 1,
        top - timedelta(days=3, hours=2): 1,
    }
    late_row = Usage.objects.get(tenant_id=world.tenants[0], hour=top - timedelta(days=3, hours=2))
    assert late_row.errored_requests == 1


def test_every_bad_kind_is_dead_lettered_and_the_consumer_keeps_going(
    world: World, producer: Producer, topic: str, consumers: Callable[..., UsageConsumer]
) -> None:
    consumer = consumers()
    now = datetime.now(UTC)
    good = event(world)
    bad: dict[str, bytes | dict[str, object]] = {
        Reason.NOT_JSON: b"\x00\xffnot json",
        Reason.MISSING_FIELD: {k: v for k, v in event(world).items() if k != "status"},
        Reason.BAD_TYPE: event(world, completion_tokens="12"),
        Reason.BAD_VALUE: event(world, finish_reason="exploded"),
        Reason.SCHEMA_VERSION: event(world, schema_version=9),
        Reason.NEGATIVE_TOKENS: event(world, completion_tokens=-1),
        Reason.CACHED_EXCEEDS_PROMPT: event(world, prompt_tokens=5, cached_tokens=6),
        Reason.UNKNOWN_TENANT: event(world, tenant_id=str(uuid.uuid4())),
        Reason.UNKNOWN_MODEL_VERSION: event(world, model_version="llama-8b-1999-01"),
        Reason.FUTURE_STARTED_AT: event(world, started_at=(now + timedelta(hours=1)).isoformat()),
        Reason.EXPIRED: event(world, started_at=(now - timedelta(days=45)).isoformat()),
    }
    producer.send(topic, [*bad.values(), good])
    wait_until(
        lambda: DeadLetter.objects.filter(topic=topic).count() == len(bad),
        30,
        interval=0.1,
        what="dead letters",
    )
    wait_for_requests(world.tenants, 1)
    filed = {d.reason: d for d in DeadLetter.objects.filter(topic=topic)}
    assert set(filed) == set(bad)
    assert bytes(filed[Reason.NOT_JSON].payload) == b"\x00\xffnot json"
    for letter in filed.values():
        assert letter.received_at is not None and letter.offset >= 0
    # ...and it keeps going: the next good event is counted.
    producer.send(topic, [event(world)])
    wait_for_requests(world.tenants, 2)
    assert consumer.totals["dead_letter"] == len(bad)
    assert consumer.last_error is None


def test_the_consumer_creates_a_missing_day_partition_on_demand(
    world: World, producer: Producer, topic: str, consumers: Callable[..., UsageConsumer]
) -> None:
    day = datetime.now(UTC) - timedelta(days=12)
    name = f"request_log_{day:%Y%m%d}"
    with connection.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {name}")
    consumers()
    producer.send(topic, [event(world, started_at=day.isoformat())])
    wait_for_requests(world.tenants, 1)
    with connection.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        assert cur.fetchone()[0]


def test_two_consumers_share_the_partitions_and_count_everything_once(
    world: World, producer: Producer, topic: str, consumers: Callable[..., UsageConsumer]
) -> None:
    first, second = consumers(), consumers()
    assert first.wait_assigned(30) and second.wait_assigned(30)
    events = [event(world, tenant_id=str(t)) for t in world.tenants for _ in range(40)]
    producer.send(topic, events + events[:20])
    wait_for_requests(world.tenants, len(events))
    for t in world.tenants:
        assert usage_totals(tenant_id=t)["requests"] == 40


def test_the_worker_serves_prometheus_metrics(
    world: World,
    producer: Producer,
    topic: str,
    ingest_kafka: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    port = free_port()
    worker = start_worker(
        tmp_path,
        bootstrap=ingest_kafka,
        topic=topic,
        group=f"billing-{uuid.uuid4().hex[:6]}",
        redis_url=redis_url,
        env={"FAIRWAY_INGEST_METRICS_PORT": str(port)},
    )
    try:
        e = event(world)
        producer.send(topic, [e, e, b"{}"])
        wait_for_requests(world.tenants, 1, timeout=60)

        def scraped() -> str | None:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                return None
            wanted = (
                'fairway_ingest_events_total{outcome="ingested"} 1.0',
                'fairway_ingest_events_total{outcome="duplicate"} 1.0',
                'fairway_ingest_dead_letters_total{reason="missing_field"} 1.0',
                "fairway_ingest_batch_seconds_count",
                f'fairway_ingest_consumer_lag{{partition="0",topic="{topic}"}}',
            )
            return text if all(w in text for w in wanted) else None

        wait_until(scraped, 30, interval=0.2, what="the worker's metrics")
    finally:
        assert worker.terminate() == 0, worker.log()
    assert "usage consumer stopping" in worker.log()


def test_a_database_failure_mid_batch_rolls_back_and_the_batch_is_read_again(
    world: World, producer: Producer, topic: str, consumers: Callable[..., UsageConsumer]
) -> None:
    import psycopg

    from metering import metrics
    from tests.metering.conftest import database_url

    consumer = consumers()
    producer.send(topic, [event(world)])
    wait_for_requests(world.tenants, 1)
    failures = metrics.BATCH_FAILURES._value.get()
    url = database_url().replace("postgres://", "postgresql://")
    with psycopg.connect(url) as blocker, psycopg.connect(url, autocommit=True) as admin:
        # Hold usage so that the next batch's transaction waits inside its write...
        blocker.execute("LOCK TABLE usage IN ACCESS EXCLUSIVE MODE")
        batch = [event(world, completion_tokens=i) for i in range(50)]
        producer.send(topic, batch)

        def waiting_writer() -> int | None:
            row = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE %s",
                ["%INSERT INTO request_log%"],
            ).fetchone()
            return row[0] if row else None

        pid = wait_until(waiting_writer, 30, interval=0.05, what="the batch waiting on usage")
        # ...then its connection dies mid-transaction (a database restart, a network cut).
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        blocker.rollback()
    wait_for_requests(world.tenants, 51)
    assert metrics.BATCH_FAILURES._value.get() == failures + 1
    assert usage_totals(tenant_id__in=world.tenants)["completion_tokens"] == 20 + sum(range(50))
    assert request_log_count(world.tenants) == 51
    assert consumer.running
