"""The usage consumer: Kafka ``usage.v1`` → ``request_log`` + hourly ``usage``, exactly once.

A plain class owning one kafka-python ``KafkaConsumer`` on its own thread. The Celery
worker starts and stops it through a bootstep (``metering.bootsteps``); tests and the
benchmark run it in-process.

The loop, per batch (one ``poll``, up to ``batch_max`` messages):

1. parse and check every message (``metering.events``); refused ones become dead letters;
2. make sure each day's ``request_log`` partition exists (cached, its own transaction);
3. write dead letters, ``request_log`` rows and ``usage`` increments in ONE transaction
   (``metering.store.write_batch``) and commit it;
4. only then commit the batch's Kafka offsets.

Steps 2-3 run on a writer thread while the polling thread fetches and checks the next batch
(one batch in flight at most); step 4 waits for 3 and runs on the polling thread, in order.

A crash (or a failed offset commit, e.g. after a rebalance) before 4 redelivers the batch;
its events are already in ``request_log``, so they insert nothing and add nothing to
``usage`` the second time. On stop the current batch is finished if it is being written,
and otherwise abandoned with its offsets uncommitted. See metering/README.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection

from metering import metrics
from metering.events import Checks, Reason, Rejected, Row, canonical_uuid, check, parse
from metering.store import Letter, Partitions, Written, oldest_kept_day, write_batch

log = logging.getLogger("metering.consumer")

TOPIC = "usage.v1"
GROUP = "billing"


@dataclass
class ConsumerConfig:
    bootstrap: str
    topic: str = TOPIC
    group_id: str = GROUP
    batch_max: int = 5000
    poll_timeout_ms: int = 200
    # Short: a dead consumer's partitions move to a live one within seconds, and a group
    # join takes about half of it on the embedded broker.
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000
    max_future: timedelta = timedelta(minutes=5)
    retry_backoff_max_s: float = 5.0
    # Fault injection for the crash test only: SIGKILL this process right after the N-th
    # batch's transaction commits and before its offsets are committed (the worst moment).
    kill_after_batches: int = 0
    client_id: str = field(default_factory=lambda: f"fairway-ingest-{uuid.uuid4().hex[:8]}")


class Directory:
    """Known tenants and model versions, loaded on demand and cached.

    A tenant or version the cache lacks is looked up once per batch; only what the database
    does not have either is refused. Neither is ever deleted while usage refers to it (the
    usage foreign keys protect them), so a positive answer never goes stale.
    """

    def __init__(self) -> None:
        self.tenants: set[str] = set()  # canonical UUID text, as events.check compares
        self.versions: dict[str, int] = {}

    def resolve(self, tenant_ids: set[str], version_names: set[str]) -> None:
        from catalog.models import ModelVersion
        from tenants.models import Tenant

        wanted = [
            tid
            for tid in (canonical_uuid(raw) for raw in tenant_ids if raw not in self.tenants)
            if tid is not None and tid not in self.tenants
        ]
        if wanted:
            found = Tenant.objects.filter(id__in=wanted).values_list("id", flat=True)
            self.tenants.update(str(tid) for tid in found)
        names = [n for n in version_names if n not in self.versions]
        if names:
            self.versions.update(
                ModelVersion.objects.filter(name__in=names).values_list("name", "id")
            )


def _close_connection() -> None:
    """Close the calling thread's database connection. (Submit this, not the bound method
    ``connection.close``, which would resolve to the submitting thread's connection.)"""
    connection.close()


@dataclass
class _Checked:
    """A polled batch after the checks: what to write, and the offsets it covers."""

    polled: dict[Any, list[Any]]
    rows: list[Row]
    letters: list[Letter]
    now: datetime


@dataclass
class _InFlight:
    batch: _Checked
    future: Future[Written]


class UsageConsumer:
    """Polls and checks on its own thread; writes on a second one (one batch at a time), so
    that the next batch is fetched and checked while PostgreSQL works on the current one.
    Offsets are committed on the polling thread (a KafkaConsumer is not thread-safe), in
    batch order, each only after its batch's transaction has committed."""

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.config = config
        self.clock = clock
        self.directory = Directory()
        self.partitions = Partitions()
        self.batches = 0
        self.totals = {"ingested": 0, "duplicate": 0, "dead_letter": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Any = None
        self._assigned = threading.Event()
        self._writer: ThreadPoolExecutor | None = None
        self._inflight: _InFlight | None = None
        # Offsets of batches already stored whose commit failed: retried on later polls.
        self._pending: dict[Any, Any] = {}
        self._retry_commit_at = 0.0
        self._fails = 0
        # Where the time goes (busy seconds, cumulative): Kafka fetch + decode of non-empty
        # polls, parse + check, partition creation, the transaction, the offset commit. The
        # writer's stages overlap the poller's, so they add up to more than the wall time.
        self.seconds = dict.fromkeys(("poll", "check", "partitions", "write", "commit"), 0.0)
        self.last_error: BaseException | None = None

    # -- lifecycle (thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-writer")
        self._thread = threading.Thread(target=self._run, name="usage-consumer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling; the batch being written is finished (and its offsets committed),
        one only read is abandoned uncommitted (redelivered to the partition's next owner)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("usage consumer did not stop within %.0fs", timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_assigned(self, timeout: float) -> bool:
        return self._assigned.wait(timeout)

    def _make_consumer(self) -> Any:
        from kafka import KafkaConsumer

        cfg = self.config
        return KafkaConsumer(
            cfg.topic,
            bootstrap_servers=cfg.bootstrap,
            group_id=cfg.group_id,
            client_id=cfg.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_records=cfg.batch_max,
            # Larger fetches: a batch of a few thousand events is one or two fetches.
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=16 * 1024 * 1024,
            request_timeout_ms=max(cfg.session_timeout_ms + 5000, 15000),
            reconnect_backoff_max_ms=1000,
            # New partitions of the topic are picked up within half a minute.
            metadata_max_age_ms=30_000,
        )

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self._consumer is None:
                    self._consumer = self._make_consumer()
                self.poll_once()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - the broker, the client or a lookup failed
                # A fresh client re-joins the group and resumes from the committed offsets;
                # whatever was read but not committed is read again and counted once.
                log.warning("usage consumer error, restarting its Kafka client: %r", exc)
                self.last_error = exc
                self._settle_inflight()
                self._close_client()
                connection.close()  # this thread's (the directory's), if that was what failed
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.config.retry_backoff_max_s)
        try:
            self._settle_inflight()
            if self._pending and self._consumer is not None:
                self._commit_pending()
        except Exception as exc:  # noqa: BLE001 - stopping anyway; the batch is re-read
            log.warning("usage consumer: final commit failed: %r", exc)
        self._close_client()
        if self._writer is not None:
            self._writer.submit(_close_connection).result()
            self._writer.shutdown(wait=True)
        connection.close()

    def _close_client(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._assigned.clear()
        self._pending.clear()  # a new client resumes from what the group committed
        if consumer is not None:
            with contextlib.suppress(Exception):
                # No offset commit on close: only a committed transaction commits offsets.
                consumer.close(autocommit=False, timeout_ms=2000)

    # -- one batch -------------------------------------------------------------------------
    def poll_once(self) -> None:
        consumer = self._consumer
        t0 = time.perf_counter()
        # While a write is in flight, come back soon to commit it even if nothing arrives.
        timeout = 20 if self._inflight is not None else self.config.poll_timeout_ms
        polled = consumer.poll(timeout_ms=timeout)
        if polled:
            self.seconds["poll"] += time.perf_counter() - t0
        if consumer.assignment():
            self._assigned.set()
        self._update_lag()
        if self._stop.is_set():
            polled = {}  # abandon: never written, offsets not committed
        # The next batch is checked while the previous one is being written.
        checked = self._check(polled) if polled else None
        if self._inflight is not None and (checked is not None or self._inflight.future.done()):
            if not self._settle_inflight(later=checked.polled if checked else None):
                return  # the checked batch is dropped: it is re-read after the failed one
        if self._pending and time.monotonic() >= self._retry_commit_at:
            self._commit_pending()
        if checked is not None:
            assert self._writer is not None
            future = self._writer.submit(self._write, checked)
            self._inflight = _InFlight(checked, future)

    def _check(self, polled: dict[Any, list[Any]]) -> _Checked:
        t0 = time.perf_counter()
        records = [r for batch in polled.values() for r in batch]
        now = self.clock()
        parsed = [parse(r.value) if r.value is not None else None for r in records]
        self.directory.resolve(
            {p["tenant_id"] for p in parsed if isinstance(p, dict)},
            {p["model_version"] for p in parsed if isinstance(p, dict)},
        )
        checks = Checks(
            now=now,
            oldest_day=oldest_kept_day(now),
            max_future=self.config.max_future,
            tenants=self.directory.tenants,
            versions=self.directory.versions,
        )
        rows: list[Row] = []
        letters: list[Letter] = []
        for record, obj in zip(records, parsed, strict=True):
            if obj is None:
                outcome: Row | Rejected = Rejected(Reason.NOT_JSON, "empty message")
            elif isinstance(obj, Rejected):
                outcome = obj
            else:
                outcome = check(obj, checks)
            if isinstance(outcome, Row):
                rows.append(outcome)
            else:
                letters.append(
                    Letter(
                        topic=record.topic,
                        partition=record.partition,
                        offset=record.offset,
                        key=record.key,
                        payload=record.value or b"",
                        reason=str(outcome.reason),
                        detail=outcome.detail,
                    )
                )
        self.seconds["check"] += time.perf_counter() - t0
        return _Checked(polled, rows, letters, now)

    def _write(self, batch: _Checked) -> Written:
        """On the writer thread (its own database connection)."""
        t0 = time.perf_counter()
        self.partitions.ensure({r.started_at.date() for r in batch.rows})
        t1 = time.perf_counter()
        written = write_batch(batch.rows, batch.letters, now=batch.now)
        t2 = time.perf_counter()
        self.seconds["partitions"] += t1 - t0
        self.seconds["write"] += t2 - t1
        metrics.BATCH_SECONDS.observe(t2 - t0)
        return written

    def _settle_inflight(self, later: dict[Any, list[Any]] | None = None) -> bool:
        """Wait for the batch being written; commit its offsets if it was stored. If it was
        not, rewind to it (and to the ``later`` batch's start on partitions the failed batch
        did not have), and return False."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return True
        batch = inflight.batch
        try:
            written = inflight.future.result()
        except Exception:
            log.exception("usage batch of %d failed; it will be read again", len(batch.rows))
            metrics.BATCH_FAILURES.inc()
            self.partitions.forget()
            if self._writer is not None:
                # A broken connection is replaced on the writer's next use.
                with contextlib.suppress(Exception):
                    self._writer.submit(_close_connection).result()
            if self._consumer is not None:
                targets = {tp: records[0].offset for tp, records in batch.polled.items()}
                for tp, records in (later or {}).items():
                    targets.setdefault(tp, records[0].offset)
                self._rewind(targets)
            self._stop.wait(min(self.config.retry_backoff_max_s, 0.5 * 2 ** min(self._fails, 4)))
            self._fails += 1
            return False
        self._fails = 0
        self.totals["ingested"] += written.inserted
        self.totals["duplicate"] += written.duplicates
        self.totals["dead_letter"] += written.dead_letters
        metrics.EVENTS.labels("ingested").inc(written.inserted)
        metrics.EVENTS.labels("duplicate").inc(written.duplicates)
        for letter in batch.letters:
            metrics.DEAD_LETTERS.labels(letter.reason).inc()
        if self.config.kill_after_batches and self.batches + 1 >= self.config.kill_after_batches:
            log.warning("fault injection: SIGKILL after batch %d's commit", self.batches + 1)
            os.kill(os.getpid(), signal.SIGKILL)
        self.batches += 1
        if self._consumer is not None:
            t0 = time.perf_counter()
            self._commit(batch.polled)
            self.seconds["commit"] += time.perf_counter() - t0
        return True

    def _commit(self, polled: dict[Any, list[Any]]) -> None:
        from kafka.structs import OffsetAndMetadata

        for tp, records in polled.items():
            self._pending[tp] = OffsetAndMetadata(records[-1].offset + 1, "", -1)
        self._commit_pending()

    def _commit_pending(self) -> None:
        """Commit the stored batches' offsets; kept and retried on later polls if the
        commit fails (broker gone, a rebalance in progress)."""
        consumer = self._consumer
        owned = consumer.assignment()
        # A partition that moved away is its new owner's to commit (it re-reads from the
        # last commit; those events are duplicates in the database, counted once).
        offsets = {tp: o for tp, o in self._pending.items() if tp in owned}
        self._pending.clear()
        if not offsets:
            return
        try:
            consumer.commit(offsets)
        except Exception as exc:  # noqa: BLE001 - the batch is safely in the database
            log.warning("offset commit failed (batch already stored), will retry: %r", exc)
            metrics.COMMIT_FAILURES.inc()
            for tp, offset in offsets.items():
                self._pending.setdefault(tp, offset)
            self._retry_commit_at = time.monotonic() + 1.0

    def _rewind(self, targets: dict[Any, int]) -> None:
        for tp, offset in targets.items():
            with contextlib.suppress(Exception):  # not ours any more: nothing to rewind
                self._consumer.seek(tp, offset)

    def _update_lag(self) -> None:
        consumer = self._consumer
        with contextlib.suppress(Exception):
            for tp in consumer.assignment():
                high = consumer.highwater(tp)
                if high is None:
                    continue
                lag = max(0, high - consumer.position(tp, timeout_ms=0))
                metrics.LAG.labels(tp.topic, str(tp.partition)).set(lag)

    # -- helpers for tests and the benchmark ---------------------------------------------
    def lag(self) -> int | None:
        """Total lag over the assigned partitions as of the last poll (None if unknown)."""
        consumer = self._consumer
        if consumer is None:
            return None
        total = 0
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is None:
                return None
            total += max(0, high - consumer.position(tp, timeout_ms=0))
        return total
