"""The database side of ingestion: day partitions of ``request_log``, and one batch's write.

A batch is written in ONE transaction: its dead letters, its ``request_log`` rows (``ON
CONFLICT (request_id, started_at) DO NOTHING``) and, from exactly the rows that statement
inserted (its ``RETURNING``), the increments of the hourly ``usage`` rows. A redelivered
event conflicts in ``request_log``, is not returned, and so adds nothing to ``usage``. The
whole batch goes to PostgreSQL by one binary COPY into a temporary table and one statement
reading it, so a batch costs three round trips however many events it holds.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from django.conf import settings
from django.db import connection, transaction

from metering.events import Row
from metering.rules import CANCELLED_REASONS, ERRORED_REASONS

log = logging.getLogger("metering.store")

PARENT = "request_log"
_PARTITION_RE = re.compile(r"^request_log_(\d{8})$")


# -- partitions -------------------------------------------------------------------------
def retention_days() -> int:
    return int(getattr(settings, "FAIRWAY_REQUEST_LOG_RETENTION_DAYS", 30))


def oldest_kept_day(now: datetime, days: int | None = None) -> date:
    """The first UTC day whose partition is kept; older days are dropped (and refused)."""
    return now.astimezone(UTC).date() - timedelta(days=retention_days() if days is None else days)


def partition_name(day: date) -> str:
    return f"{PARENT}_{day:%Y%m%d}"


def _create_partition(day: date) -> None:
    start = datetime.combine(day, time(), tzinfo=UTC)
    end = start + timedelta(days=1)
    with connection.cursor() as cur:
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {partition_name(day)} PARTITION OF {PARENT} "  # noqa: S608 - a date, formatted
            f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
        )


def _partition_exists(day: date) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", [partition_name(day)])
        return bool(cur.fetchone()[0])


class Partitions:
    """Creates day partitions on demand, remembering which exist (per process)."""

    def __init__(self) -> None:
        self._known: set[date] = set()
        self._lock = threading.Lock()

    def ensure(self, days: Iterable[date]) -> None:
        missing = sorted(set(days) - self._known)
        for day in missing:
            # Its own short transaction (autocommit), not the batch's: creating a partition
            # locks the parent, which must not be held for a whole batch.
            try:
                _create_partition(day)
            except Exception:
                # Two consumers creating the same day at once: IF NOT EXISTS is not atomic
                # against a concurrent CREATE, and the loser gets a duplicate-key error.
                # Whatever the error, it is harmless if the partition exists now.
                if not _partition_exists(day):
                    raise
            with self._lock:
                self._known.add(day)

    def forget(self) -> None:
        with self._lock:
            self._known.clear()


def existing_partitions() -> dict[date, str]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE p.relname = %s",
            [PARENT],
        )
        names = [row[0] for row in cur.fetchall()]
    found: dict[date, str] = {}
    for name in names:
        match = _PARTITION_RE.match(name)
        if match:
            found[datetime.strptime(match.group(1), "%Y%m%d").replace(tzinfo=UTC).date()] = name
    return found


@dataclass(frozen=True)
class Maintenance:
    created: list[date]
    dropped: list[date]


def partitions_maintain(*, now: datetime, days: int | None = None) -> Maintenance:
    """Create today's and tomorrow's partitions; drop every one older than the retention."""
    today = now.astimezone(UTC).date()
    before = existing_partitions()
    created = [d for d in (today, today + timedelta(days=1)) if d not in before]
    for day in created:
        _create_partition(day)
    oldest = oldest_kept_day(now, days)
    dropped = sorted(d for d in before if d < oldest)
    for day in dropped:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS {partition_name(day)}")
    return Maintenance(created=created, dropped=dropped)


# -- one batch --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Letter:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    payload: bytes
    reason: str
    detail: str


@dataclass(frozen=True)
class Written:
    inserted: int  # new request_log rows (and what went into usage)
    duplicates: int  # rows already there: redelivered events, counted before
    dead_letters: int  # newly filed (a redelivered batch files none again)


# The batch arrives by binary COPY into a per-connection temporary table (emptied at each
# commit): COPY costs ~3 µs a row in the client, where parameter arrays cost ~20 (psycopg
# formats array elements in Python). Ids travel as text and are cast once, server-side.
_STAGE_TABLE = "ingest_batch"
_STAGE_COLUMNS = (
    ("request_id", "text"),
    ("started_at", "timestamptz"),
    ("tenant_id", "text"),
    ("api_key_id", "text"),
    ("model", "text"),
    ("model_version_id", "int8"),
    ("replica_id", "text"),
    ("prompt_tokens", "int8"),
    ("cached_tokens", "int8"),
    ("completion_tokens", "int8"),
    ("ttft_ms", "float8"),
    ("tpot_ms", "float8"),
    ("finish_reason", "text"),
    ("status", "int2"),
    ("is_retry", "bool"),
)
assert tuple(c for c, _ in _STAGE_COLUMNS) == Row._fields
_STAGE_SQL = (
    f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE_TABLE} ("
    + ", ".join(f"{c} {t}" for c, t in _STAGE_COLUMNS)
    + ") ON COMMIT DELETE ROWS"
)
_COPY_SQL = f"COPY {_STAGE_TABLE} FROM STDIN (FORMAT BINARY)"

_BATCH_SQL = """
WITH inserted AS (
    INSERT INTO request_log (request_id, started_at, tenant_id, api_key_id, model,
        model_version_id, replica_id, prompt_tokens, cached_tokens, completion_tokens,
        ttft_ms, tpot_ms, finish_reason, status, is_retry, ingested_at)
    SELECT request_id, started_at, tenant_id::uuid, api_key_id::uuid, model, model_version_id,
        replica_id, prompt_tokens, cached_tokens, completion_tokens, ttft_ms, tpot_ms,
        finish_reason, status, is_retry, %(now)s
    FROM ingest_batch
    ON CONFLICT (request_id, started_at) DO NOTHING
    RETURNING tenant_id, api_key_id, model_version_id, started_at, prompt_tokens,
        cached_tokens, completion_tokens, finish_reason
),
rolled AS (
    INSERT INTO usage AS u (tenant_id, api_key_id, model_version_id, hour, requests,
        prompt_tokens, cached_tokens, completion_tokens, cancelled_requests,
        errored_requests, updated_at)
    SELECT tenant_id, api_key_id, model_version_id, date_trunc('hour', started_at, 'UTC'),
        count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),
        count(*) FILTER (WHERE finish_reason = ANY(%(cancelled)s::text[])),
        count(*) FILTER (WHERE finish_reason = ANY(%(errored)s::text[])),
        %(now)s
    FROM inserted
    GROUP BY 1, 2, 3, 4
    -- One lock order for every writer: concurrent batches touching the same usage rows
    -- (only during a rebalance) wait for each other instead of deadlocking.
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (tenant_id, api_key_id, model_version_id, hour) DO UPDATE SET
        requests = u.requests + excluded.requests,
        prompt_tokens = u.prompt_tokens + excluded.prompt_tokens,
        cached_tokens = u.cached_tokens + excluded.cached_tokens,
        completion_tokens = u.completion_tokens + excluded.completion_tokens,
        cancelled_requests = u.cancelled_requests + excluded.cancelled_requests,
        errored_requests = u.errored_requests + excluded.errored_requests,
        updated_at = excluded.updated_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM inserted), (SELECT count(*) FROM rolled)
"""

_DEAD_SQL = """
WITH filed AS (
    INSERT INTO usage_dead_letter (topic, partition, "offset", key, payload, reason, detail,
        received_at)
    SELECT *, %(now)s FROM unnest(
        %(topic)s::text[], %(partition)s::int[], %(offset)s::bigint[], %(key)s::bytea[],
        %(payload)s::bytea[], %(reason)s::text[], %(detail)s::text[])
    ON CONFLICT (topic, partition, "offset") DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM filed
"""


def write_batch(rows: Sequence[Row], letters: Sequence[Letter], *, now: datetime) -> Written:
    """Dead letters, request_log rows and usage increments of one batch, in one
    transaction. Raises (and writes nothing) if any part fails."""
    inserted = dead = 0
    connection.ensure_connection()
    with transaction.atomic():
        raw = connection.connection  # the psycopg connection: no debug SQL formatting
        with raw.cursor() as cur:
            if letters:
                cur.execute(
                    _DEAD_SQL,
                    {
                        "now": now,
                        "topic": [x.topic for x in letters],
                        "partition": [x.partition for x in letters],
                        "offset": [x.offset for x in letters],
                        "key": [x.key for x in letters],
                        "payload": [x.payload for x in letters],
                        "reason": [str(x.reason) for x in letters],
                        "detail": [x.detail for x in letters],
                    },
                )
                dead = int(cur.fetchone()[0])
            if rows:
                cur.execute(_STAGE_SQL)
                with cur.copy(_COPY_SQL) as copy:
                    copy.set_types([t for _, t in _STAGE_COLUMNS])
                    for row in rows:
                        copy.write_row(row)
                cur.execute(
                    _BATCH_SQL,
                    {
                        "now": now,
                        "cancelled": list(CANCELLED_REASONS),
                        "errored": list(ERRORED_REASONS),
                    },
                )
                inserted = int(cur.fetchone()[0])
    return Written(inserted=inserted, duplicates=len(rows) - inserted, dead_letters=dead)
