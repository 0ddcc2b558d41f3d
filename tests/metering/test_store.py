"""The batch write and the partitions, straight against PostgreSQL (no Kafka)."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta

import orjson
import pytest
from django.db import IntegrityError, connection, transaction

from metering.events import Checks, Row, validate
from metering.store import (
    Letter,
    Partitions,
    existing_partitions,
    partition_name,
    partitions_maintain,
    write_batch,
)
from tests.metering.conftest import World, event, make_world, usage_totals

pytestmark = pytest.mark.django_db


@pytest.fixture
def w() -> World:
    return make_world()


def rows(world: World, *events: dict[str, object]) -> list[Row]:
    checks = Checks(
        now=datetime(2040, 1, 1, tzinfo=UTC),
        oldest_day=date(2000, 1, 1),
        max_future=timedelta(0),
        tenants={str(t) for t in world.tenants},
        versions={world.version.name: world.version.id},
    )
    out = []
    for e in events:
        row = validate(orjson.dumps(e), checks)
        assert isinstance(row, Row), row
        out.append(row)
    Partitions().ensure({r.started_at.date() for r in out})
    return out


def test_a_duplicate_within_a_batch_and_across_batches_counts_once(w: World) -> None:
    one = event(w, started_at="2026-05-01T10:00:00+00:00")
    two = event(w, started_at="2026-05-01T10:30:00+00:00", finish_reason="cancelled")
    first = write_batch(rows(w, one, one, two), [], now=datetime.now(UTC))
    assert (first.inserted, first.duplicates) == (2, 1)
    again = write_batch(rows(w, two, one), [], now=datetime.now(UTC))
    assert (again.inserted, again.duplicates) == (0, 2)
    totals = usage_totals(tenant_id=w.tenants[0])
    assert totals == {
        "requests": 2,
        "prompt_tokens": 200,
        "cached_tokens": 20,
        "completion_tokens": 40,
        "cancelled_requests": 1,
        "errored_requests": 0,
    }


def test_hour_day_and_month_boundaries_are_utc_hours_of_started_at(w: World) -> None:
    times = [
        "2026-01-31T23:59:59.999+00:00",  # last ms of a month (and day, hour)
        "2026-02-01T00:00:00+00:00",  # first instant of the next
        "2026-02-01T01:59:59.999+02:00",  # = 23:59:59.999 UTC on Jan 31, written in +02:00
        "2026-02-01T00:59:59.999999+00:00",
        "2026-02-01T01:00:00+00:00",
    ]
    write_batch(rows(w, *(event(w, started_at=t) for t in times)), [], now=datetime.now(UTC))
    from metering.models import Usage

    by_hour = {
        u.hour: u.requests for u in Usage.objects.filter(tenant_id=w.tenants[0]).order_by("hour")
    }
    assert by_hour == {
        datetime(2026, 1, 31, 23, tzinfo=UTC): 2,
        datetime(2026, 2, 1, 0, tzinfo=UTC): 2,
        datetime(2026, 2, 1, 1, tzinfo=UTC): 1,
    }
    with connection.cursor() as cur:
        cur.execute(
            "SELECT tableoid::regclass::text, count(*) FROM request_log "
            "WHERE tenant_id = %s GROUP BY 1 ORDER BY 1",
            [w.tenants[0]],
        )
        assert cur.fetchall() == [("request_log_20260131", 2), ("request_log_20260201", 3)]


def test_the_batch_is_one_transaction_nothing_is_written_if_any_part_fails(w: World) -> None:
    good = rows(w, event(w, started_at="2026-05-02T10:00:00+00:00"))
    # A row for a day with no partition fails the request_log insert...
    orphan = rows(w, event(w, started_at="2026-05-02T11:00:00+00:00"))[0]
    bad = orphan._replace(started_at=datetime(1999, 1, 1, tzinfo=UTC))
    letter = Letter("usage.v1", 0, 12345678, None, b"junk", "not_json", "")
    with pytest.raises(Exception, match="partition"):
        write_batch([*good, bad], [letter], now=datetime.now(UTC))
    # ...and takes the dead letter and the good row with it.
    assert usage_totals(tenant_id=w.tenants[0])["requests"] == 0
    from metering.models import DeadLetter

    assert not DeadLetter.objects.filter(offset=12345678).exists()
    write_batch(good, [letter, letter], now=datetime.now(UTC))
    assert usage_totals(tenant_id=w.tenants[0])["requests"] == 1
    assert DeadLetter.objects.filter(offset=12345678).count() == 1


def test_maintenance_creates_today_and_tomorrow_and_drops_past_retention(w: World) -> None:
    now = datetime(2031, 7, 15, 23, 30, tzinfo=UTC)
    Partitions().ensure([date(2031, 6, 14), date(2031, 6, 15), date(2031, 6, 16)])
    write_batch(
        rows(w, event(w, started_at="2031-06-14T12:00:00+00:00")), [], now=datetime.now(UTC)
    )
    done = partitions_maintain(now=now, days=30)
    assert done.created == [date(2031, 7, 15), date(2031, 7, 16)]
    assert date(2031, 6, 14) in done.dropped and date(2031, 6, 15) not in done.dropped
    assert all(d < date(2031, 6, 15) for d in done.dropped)
    kept = existing_partitions()
    assert date(2031, 6, 14) not in kept
    assert {date(2031, 6, 15), date(2031, 6, 16), date(2031, 7, 15), date(2031, 7, 16)} <= set(kept)
    assert kept[date(2031, 7, 16)] == partition_name(date(2031, 7, 16))
    # Usage is kept forever: the dropped day's request is still counted.
    assert usage_totals(tenant_id=w.tenants[0])["requests"] == 1
    again = partitions_maintain(now=now, days=30)
    assert again.created == [] and again.dropped == []


@pytest.mark.django_db(transaction=True)
def test_concurrent_creators_of_the_same_partitions_all_succeed() -> None:
    import threading

    base = date(2033, 1, 1) + timedelta(days=uuid.uuid4().int % 300)
    days = [base + timedelta(days=i) for i in range(4)]
    start = threading.Barrier(6)
    errors: list[BaseException] = []

    def create() -> None:
        try:
            start.wait(10)
            Partitions().ensure(days)  # each a process with an empty cache
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert set(days) <= set(existing_partitions())
    with connection.cursor() as cur:
        for day in days:
            cur.execute(f"DROP TABLE {partition_name(day)}")


def test_the_beat_task_keeps_today_and_tomorrow(w: World) -> None:
    from django.conf import settings as conf

    from metering.tasks import request_log_partitions_maintain

    entry = conf.CELERY_BEAT_SCHEDULE["request-log-partitions"]
    assert entry["task"] == request_log_partitions_maintain.name
    today = datetime.now(UTC).date()
    with connection.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {partition_name(today + timedelta(days=1))}")
    done = request_log_partitions_maintain.delay().get()
    assert (today + timedelta(days=1)).isoformat() in done["created"]
    assert {today, today + timedelta(days=1)} <= set(existing_partitions())


HOUR = datetime(2026, 5, 3, 10, tzinfo=UTC)


@pytest.mark.parametrize(
    ("counts", "constraint"),
    [
        ({"requests": -1}, "usage_counts_non_negative"),
        # (cached within prompt holds in these two, so only one constraint is broken)
        ({"prompt_tokens": -1, "cached_tokens": -1}, "usage_counts_non_negative"),
        ({"cached_tokens": -1}, "usage_counts_non_negative"),
        ({"completion_tokens": -1}, "usage_counts_non_negative"),
        ({"cancelled_requests": -1}, "usage_counts_non_negative"),
        ({"errored_requests": -1}, "usage_counts_non_negative"),
        ({"prompt_tokens": 5, "cached_tokens": 6}, "usage_cached_within_prompt"),
        ({"requests": 1, "cancelled_requests": 2}, "usage_outcomes_within_requests"),
        ({"requests": 1, "errored_requests": 2}, "usage_outcomes_within_requests"),
    ],
)
def test_the_database_refuses_impossible_usage_counts(
    w: World, counts: dict[str, int], constraint: str
) -> None:
    from metering.models import Usage

    key = {"tenant_id": w.tenants[0], "api_key_id": w.key, "model_version": w.version}
    with pytest.raises(IntegrityError, match=constraint), transaction.atomic():
        Usage.objects.create(**key, hour=HOUR, **counts)
    # ...and an update that would make a good row impossible, as raw SQL would.
    row = Usage.objects.create(**key, hour=HOUR, requests=3, prompt_tokens=9, cached_tokens=4)
    with pytest.raises(IntegrityError, match=constraint), transaction.atomic():
        Usage.objects.filter(pk=row.pk).update(**counts)


def test_the_database_keeps_one_usage_row_per_tenant_key_version_and_hour(w: World) -> None:
    from metering.models import Usage

    key = {"tenant_id": w.tenants[0], "api_key_id": w.key, "model_version": w.version}
    Usage.objects.create(**key, hour=HOUR, requests=1)
    with pytest.raises(IntegrityError, match="usage_key"), transaction.atomic():
        Usage.objects.create(**key, hour=HOUR, requests=1)
    # Any other hour, key, tenant or version is a row of its own.
    Usage.objects.create(**key, hour=HOUR + timedelta(hours=1), requests=1)
    Usage.objects.create(**{**key, "api_key_id": uuid.uuid4()}, hour=HOUR, requests=1)
    Usage.objects.create(**{**key, "tenant_id": w.tenants[1]}, hour=HOUR, requests=1)
    assert Usage.objects.filter(tenant_id__in=w.tenants).count() == 4


@pytest.mark.parametrize(
    ("tokens", "constraint"),
    [
        ((-1, -1, 0), "request_log_counts_non_negative"),
        ((0, 0, -1), "request_log_counts_non_negative"),
        ((5, 6, 0), "request_log_cached_within_prompt"),
    ],
)
def test_the_database_refuses_impossible_request_log_rows(
    w: World, tokens: tuple[int, int, int], constraint: str
) -> None:
    Partitions().ensure([HOUR.date()])
    insert = (
        "INSERT INTO request_log (request_id, started_at, tenant_id, api_key_id, model, "
        "model_version_id, replica_id, prompt_tokens, cached_tokens, completion_tokens, "
        "finish_reason, status, is_retry) "
        "VALUES (%s, %s, %s, %s, 'llama-8b', %s, 'r1', %s, %s, %s, 'stop', 200, false)"
    )
    args = [w.tenants[0], w.key, w.version.id]
    with pytest.raises(IntegrityError, match=constraint), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(insert, [uuid.uuid4().hex, HOUR, *args, *tokens])
    # The same request twice in one day's partition is refused by the key itself.
    with connection.cursor() as cur:
        cur.execute(insert, ["twice", HOUR, *args, 1, 0, 1])
    with pytest.raises(IntegrityError, match="request_log"), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(insert, ["twice", HOUR, *args, 1, 0, 1])
