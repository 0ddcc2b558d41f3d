"""Usage events: one per admitted request, to Kafka ``usage.v1``, through a durable spool.

Delivery is at-least-once with an exactly-once effect: an event may reach Kafka more than
once (a crash between the broker's acknowledgement and the offset write, a power loss that
rolls the offset back), never zero times once it is in the spool, and the consumer dedupes
on ``request_id``.

The request path only calls ``UsageProducer.emit``: a non-blocking put onto a queue, so it
cannot be lost to cancellation once called and never waits for a disk. Two background
threads do the rest as a write-ahead log (the outbox pattern):

1. the writer appends what is queued to this process's spool and ``fsync``s it (one write
   and one fsync per group commit, not per event), whatever the broker is doing. A failed
   write (disk full, EIO) or fsync keeps the batch in memory, in order, cuts the file back
   to its last good size (no half line stays behind) and is retried with backoff until the
   disk takes it again; past ``unhealthy_after_s`` or ``unhealthy_events`` of unwritten
   events the spool is reported unwritable (``spool_problem``: a degraded dependency in
   ``/readyz``'s details and a gauge, not a readiness failure: the process still serves);
2. the sender sends everything past the committed position to Kafka, in order, keyed by
   tenant, and advances the position on acknowledgement. A line that is not a JSON object
   with a ``tenant_id`` is moved to a quarantine file and skipped, so it cannot stall the
   lines behind it.

Files of one producer ``usage-<instance>`` in the spool directory:

- ``usage-<instance>.lock``: held with ``flock`` for the producer's lifetime; a free lock
  means its owner is gone and the files may be adopted;
- ``usage-<instance>-<seq>.spool``: segments of JSON lines, appended to and never
  rewritten. The writer starts a new one past ``segment_bytes``; the sender deletes one
  once every line in it is acknowledged and a newer one exists;
- ``usage-<instance>.pos``: the committed position ``<seq> <offset> <crc32>``, rewritten in
  place and fsynced after each acknowledgement (a torn or garbled record reads as "from
  the first segment's start", which only re-sends);
- ``usage-<instance>.quarantine``: lines that could not be sent, one JSON object each with
  where they came from; kept for an operator.

The directory is fsynced after every file is created or removed. On opening (start or
adoption) a partial last line is quarantined and cut off, segments older than the position
are deleted (they were acknowledged), and a position beyond its segment or not at a line
start falls back to the start of that line or segment: duplicates, never skips.

A request in flight is in the spool too: ``mark`` queues an in-flight mark (the event it
would be billed if the process died now) at dispatch, at its first token and every few
seconds of a stream, written with the next group commit and never sent. The request's real
event supersedes its marks. A process that adopts a dead one's spool (``_settle``) appends,
for every mark that no event follows, the event the mark stands for: a request cut off by
a SIGKILL is billed once, under the billing rule for failed requests (metering/rules.py),
as of its last mark. Both cannot be delivered for one request: the synthetic event is
written only by a process holding the dead owner's lock, after reading every segment
through, so a real event is either in those files (and no mark is settled) or was never
written; a request's events are only ever in the spool of the process that served it.

A broker outage just grows the spool; each spool (this process's and every adopted one)
has its own backoff and they take turns, so a spool that cannot be delivered does not hold
up the others. A gateway that stops (or dies) leaves its files behind; another gateway
process finds the lock free and drains them, in segment order.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from pathlib import Path

from gateway.metrics import GatewayMetrics
from gateway.usage.events import UsageEvent, mark_record, record_key
from gateway.usage.sink import KafkaSink, Sink
from gateway.usage.spool import SEGMENT_NAME, Spool

log = logging.getLogger("gateway.usage")

GROUP_COMMIT_S = 0.005
# Events are durable in the spool before they are sent, so delivery may linger: 0.2 s
# instead of 0.05 s cut the gateway's CPU per request by ~0.1-0.2 ms at 200 req/s
# (kafka-python's per-produce-request work, all of it under the GIL the event loop needs).
SEND_LINGER_S = 0.2
_BATCH_MAX = 500
# Records per write+fsync when a backlog of held events is written after a disk error.
_WRITE_MAX = 10 * _BATCH_MAX
# Batches one spool may send before the next spool gets its turn.
_ROUND_BATCHES = 20
SEGMENT_BYTES = 64 << 20
UNHEALTHY_AFTER_S = 5.0
UNHEALTHY_EVENTS = 10_000
MAX_UNWRITTEN_EVENTS = 200_000
_WRITE_BACKOFF_MAX_S = 1.0
_SEND_BACKOFF_MAX_S = 2.0


class UsageProducer:
    """Two threads: the writer makes events durable promptly (queue → spool, fsync) whatever
    the broker is doing; the sender drains spools to Kafka and may block on a dead broker
    without holding up the writer."""

    def __init__(
        self,
        *,
        spool_dir: Path,
        bootstrap: str | None,
        topic: str,
        metrics: GatewayMetrics,
        instance_id: str | None = None,
        kafka_timeout_s: float = 2.0,
        sink: Sink | None = None,
        segment_bytes: int = SEGMENT_BYTES,
        unhealthy_after_s: float = UNHEALTHY_AFTER_S,
        unhealthy_events: int = UNHEALTHY_EVENTS,
        max_unwritten_events: int = MAX_UNWRITTEN_EVENTS,
    ) -> None:
        self._dir = spool_dir
        self._bootstrap = bootstrap
        self._topic = topic
        self._metrics = metrics
        self._name = f"usage-{instance_id or uuid.uuid4().hex}"
        self._kafka_timeout_s = kafka_timeout_s
        self._sink: Sink | None = sink
        self._segment_bytes = segment_bytes
        self._unhealthy_after_s = unhealthy_after_s
        self._unhealthy_events = unhealthy_events
        self._max_unwritten_events = max_unwritten_events
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._spool: Spool | None = None
        self._orphans: list[Spool] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._writer_done = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards spool files: writer appends, sender commits
        self._closed = False
        # Taken off the queue, not yet in the spool (a write failed): retried in order.
        self._held: list[bytes] = []
        self._unwritten_since: float | None = None
        self._write_error: str | None = None
        self._write_backoff = 0.05
        self._next_scan = 0.0
        self._stop_deadline = 0.0

    # -- request path ------------------------------------------------------------------
    def emit(self, event: UsageEvent) -> None:
        """Hand one event over; never blocks on I/O, never raises into the request path."""
        record = event.to_json()
        self._metrics.usage_events.labels("emitted").inc()
        if not self._closed:
            self._queue.put(record)
            return
        # After shutdown (a late finaliser): write it straight to the spool.
        with self._lock:
            self._held.append(record)
            if not self._write_held():
                self._log_unspooled()

    def mark(self, event: UsageEvent) -> None:
        """Spool an in-flight mark: ``event`` is what the request is billed if this process
        dies before its real event is written. Written with the next group commit (no fsync
        of its own); never sent, superseded by the request's ``emit``."""
        if not self._closed:
            self._queue.put(mark_record(event))

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._spool = Spool.create(self._dir, self._name)
        # Files taken over under this name are a dead process's: settle its marks.
        self._settle(self._spool)
        self._update_gauges()
        if self._sink is None and self._bootstrap:
            self._sink = KafkaSink(self._bootstrap, self._topic, self._kafka_timeout_s)
        elif self._sink is None:
            log.warning(
                "KAFKA_BOOTSTRAP not set: usage events stay in the spool %s", self._spool.path
            )
        self._threads = [
            threading.Thread(target=self._write_loop, name="usage-writer", daemon=True),
            threading.Thread(target=self._send_loop, name="usage-sender", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Spool what is queued, try to deliver it for up to ``timeout_s``, then stop.

        A broker that has just failed is not waited for: undelivered events stay in the
        spool for the next start (or another live gateway) to send. Events the disk still
        refuses at the deadline are logged in full at ERROR, the last copy there is.
        """
        self._stop_deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout_s + 2 * self._kafka_timeout_s + 1.0)
        with self._lock:
            self._closed = True
            self._take_queue()
            if not self._write_held():
                self._log_unspooled()
        if self._sink is not None:
            self._sink.close()
        for orphan in self._orphans:
            orphan.close()
        self._orphans = []

    def close(self) -> None:
        """Release the spool files (after ``stop``); they stay for the next owner unless
        everything in them was delivered."""
        with self._lock:
            if self._spool is not None:
                # Marks without an event (requests cut off by the drain deadline) keep the
                # files, so that the next owner bills them.
                if self._spool.depth == 0 and not self._held and not self._spool.inflight:
                    self._spool.remove()
                else:
                    self._spool.close()
                self._spool = None

    @property
    def depth(self) -> int:
        own = self._spool.depth if self._spool is not None else 0
        orphans = sum(o.depth for o in self._orphans)
        return own + orphans + len(self._held) + self._queue.qsize()

    # -- health ------------------------------------------------------------------------
    def spool_problem(self) -> str | None:
        """Why readiness should fail: events emitted but not in the spool for longer than
        ``unhealthy_after_s``, or more than ``unhealthy_events`` of them. Lock-free, so a
        writer stuck in a hung fsync cannot stall the caller."""
        since = self._unwritten_since
        waiting = len(self._held) + self._queue.qsize()
        age = time.monotonic() - since if since is not None else 0.0
        if age <= self._unhealthy_after_s and waiting <= self._unhealthy_events:
            return None
        cause = self._write_error or "no error yet, the write has not returned"
        return f"usage spool cannot write: {waiting} events unwritten for {age:.1f} s ({cause})"

    def backlog_problem(self) -> str | None:
        """Why this process should leave the balancer: more events wait unwritten in memory
        than ``max_unwritten_events`` (the disk has refused them for a long while at load).
        Below that the spool is only degraded (``spool_problem``)."""
        waiting = len(self._held) + self._queue.qsize()
        if waiting <= self._max_unwritten_events:
            return None
        return f"usage spool backlog past its memory bound: {waiting} events unwritten"

    def broker_problem(self) -> str | None:
        """Why delivery to Kafka is failing (the last attempt from this process's spool
        failed), or None; also None without a broker (events then stay in the spool)."""
        spool = self._spool
        if self._sink is None or spool is None or not spool.failed:
            return None
        return f"usage broker unreachable: {spool.depth} lines wait in the spool"

    def _update_gauges(self) -> bool:
        problem = self.spool_problem()
        self._metrics.spool_writable.set(0 if problem else 1)
        self._metrics.spool_unwritten.set(len(self._held) + self._queue.qsize())
        self._metrics.spool_depth.set(self.depth)
        self._metrics.broker_up.set(0 if self.broker_problem() else 1)
        return problem is None

    # -- writer thread -----------------------------------------------------------------
    def _take_queue(self, first: bytes | None = None) -> None:
        if first is not None:
            self._held.append(first)
        with contextlib.suppress(queue.Empty):
            for _ in range(_WRITE_MAX):
                self._held.append(self._queue.get_nowait())

    def _write_held(self) -> bool:
        """Append the held events to the spool, in order (caller holds ``_lock``); False
        while the disk refuses them, which keeps them held."""
        if not self._held:
            return True
        if self._unwritten_since is None:
            self._unwritten_since = time.monotonic()
        if self._spool is None:
            return False
        try:
            while self._held:
                chunk = self._held[:_WRITE_MAX]
                self._spool.append(chunk)
                del self._held[: len(chunk)]
        except Exception as exc:  # noqa: BLE001 - OSError mostly; keep the events either way
            if self._write_error is None:
                log.error("usage spool write failed, %d events held: %r", len(self._held), exc)
            self._write_error = repr(exc)
            return False
        if self._write_error is not None:
            log.warning("usage spool writable again")
        self._write_error = None
        self._unwritten_since = None
        self._spool.rotate(self._segment_bytes)
        return True

    def _log_unspooled(self) -> None:
        for record in self._held:
            log.error("usage event NOT spooled: %s", record.decode(errors="replace"))
        self._held.clear()

    def _write_loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            first: bytes | None = None
            if self._held:
                # The disk refused the last write: retry with backoff (new events queue).
                time.sleep(self._write_backoff)
                self._write_backoff = min(self._write_backoff * 2, _WRITE_BACKOFF_MAX_S)
            else:
                with contextlib.suppress(queue.Empty):
                    first = self._queue.get(timeout=0.05)
                if first is not None and not stopping:
                    # Group commit: one write + fsync for what arrives within a few ms,
                    # instead of one per event (the events wait in memory either way).
                    time.sleep(GROUP_COMMIT_S)
            try:
                with self._lock:
                    self._take_queue(first)
                    written = bool(self._held) and self._write_held()
                if written:
                    self._write_backoff = 0.05
                    self._wake.set()
                    self._metrics.spool_depth.set(self.depth)
                elif self._held:
                    self._update_gauges()
            except Exception:  # noqa: BLE001 - keep the writer alive whatever happens
                log.exception("usage spool write step failed")
            if stopping and self._queue.empty():
                if not self._held or time.monotonic() >= self._stop_deadline:
                    self._writer_done.set()
                    self._wake.set()
                    return

    # -- sender thread -----------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            if self._wake.wait(0.1) and not self._stop.is_set():
                # Linger: events are durable in the spool already, so trading a little
                # delivery delay for fewer, larger produce requests costs nothing; tiny
                # batches made the Kafka client the gateway's biggest CPU user.
                time.sleep(SEND_LINGER_S)
            self._wake.clear()
            stopping = self._writer_done.is_set()
            try:
                self._scan_orphans()
                self._deliver()
            except Exception:  # noqa: BLE001 - keep the sender alive whatever happens
                log.exception("usage delivery step failed")
            self._update_gauges()
            if stopping and (
                self._sink is None
                or time.monotonic() >= self._stop_deadline
                or all(s.depth == 0 or s.failed for s in self._spools())
            ):
                return

    def _spools(self) -> list[Spool]:
        """Adopted spools first (they are older), then this process's."""
        own = [self._spool] if self._spool is not None else []
        return [*self._orphans, *own]

    def _scan_orphans(self) -> None:
        now = time.monotonic()
        if now < self._next_scan:
            return
        self._next_scan = now + 5.0
        known = {s.lock_path for s in self._spools()}
        locks = [(path, Spool.adopt) for path in sorted(self._dir.glob("usage-*.lock"))]
        legacy = [
            (path, Spool.adopt_legacy)
            for path in sorted(self._dir.glob("usage-*.spool"))
            if not SEGMENT_NAME.fullmatch(path.name)
        ]
        for path, adopt in locks + legacy:
            if path in known:
                continue
            try:
                orphan = adopt(path)
            except OSError as exc:
                log.warning("cannot adopt usage spool %s: %r", path, exc)
                continue
            if orphan is None:
                continue
            if not orphan.segments:
                orphan.remove()
                continue
            log.info("adopted spool %s with %d undelivered lines", path, orphan.depth)
            self._settle(orphan)
            self._orphans.append(orphan)

    def _settle(self, spool: Spool) -> None:
        """Bill the requests a dead process left in flight (its marks with no event after
        them); on a disk error they stay marks and the next round tries again."""
        if not spool.inflight:
            return
        try:
            with self._lock:
                settled = spool.settle_inflight()
        except OSError as exc:
            log.warning("cannot settle in-flight requests of spool %s: %r", spool.name, exc)
            return
        log.warning(
            "spool %s: %d requests were in flight when their process died; billed as failed",
            spool.name,
            settled,
        )
        self._metrics.usage_events.labels("settled").inc(settled)

    def _deliver(self) -> None:
        """One round: each spool not backing off sends up to ``_ROUND_BATCHES`` batches."""
        if self._sink is None:
            return
        for spool in self._spools():
            if time.monotonic() < spool.retry_at:
                continue
            if spool is not self._spool:
                self._settle(spool)
            try:
                ok = self._drain(spool)
            except Exception:  # noqa: BLE001 - this spool backs off; the others go on
                log.exception("usage delivery from %s failed", spool.name)
                ok = False
            if not ok:
                spool.failed = True
                spool.retry_at = time.monotonic() + spool.backoff
                spool.backoff = min(spool.backoff * 2, _SEND_BACKOFF_MAX_S)
                continue
            spool.failed = False
            spool.backoff = 0.1
            if spool is not self._spool and spool.depth == 0 and not spool.inflight:
                with self._lock:
                    spool.remove()
                self._orphans.remove(spool)

    def _drain(self, spool: Spool) -> bool:
        """Send what ``spool`` holds, quarantining lines that cannot be sent; False when the
        broker (or the quarantine file) failed and the spool should back off."""
        assert self._sink is not None
        for _ in range(_ROUND_BATCHES):
            with self._lock:
                pending = spool.pending(_BATCH_MAX)
            if not pending:
                return True
            keys = [record_key(record) for _, record in pending]
            # Marks are skipped (committed past, neither sent nor quarantined).
            bad = [
                (end - len(record) - 1, record, reason)
                for (end, record), (key, reason) in zip(pending, keys, strict=True)
                if key is None and reason != "inflight" and end > spool.quarantined_through
            ]
            quarantine_failed = False
            if bad:
                try:
                    spool.quarantine(bad)
                except OSError as exc:
                    # Send (and commit) only what comes before the first bad line.
                    log.error("usage quarantine %s failed: %r", spool.quarantine_path, exc)
                    quarantine_failed = True
                    first_bad = next(
                        i
                        for i, ((end, _), (key, reason)) in enumerate(
                            zip(pending, keys, strict=True)
                        )
                        if key is None and reason != "inflight" and end > spool.quarantined_through
                    )
                    pending, keys = pending[:first_bad], keys[:first_bad]
                else:
                    spool.quarantined_through = pending[-1][0]
                    for _, record, reason in bad:
                        log.error("usage line quarantined (%s): %r", reason, record[:200])
                    self._metrics.usage_events.labels("quarantined").inc(len(bad))
            sendable = [
                (key, record)
                for (_, record), (key, _) in zip(pending, keys, strict=True)
                if key is not None
            ]
            acked = self._sink.send_batch(sendable) if sendable else 0
            # Commit through the last line before the first unacknowledged good one.
            commit_end, count, seen = 0, 0, 0
            for (end, _), (key, _) in zip(pending, keys, strict=True):
                if key is not None:
                    if seen == acked:
                        break
                    seen += 1
                commit_end, count = end, count + 1
            if count:
                with self._lock:
                    spool.acknowledge(commit_end, count)
                spool.save_position()  # its fsync outside the lock the writer needs
            if acked:
                self._metrics.usage_events.labels("delivered").inc(acked)
            if acked < len(sendable) or quarantine_failed:
                return False
        return True
