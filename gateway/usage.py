"""Usage events: one per admitted request, to Kafka ``usage.v1``, through a durable spool.

The request path only calls ``UsageProducer.emit`` — a non-blocking put onto a queue, so
it cannot be lost to cancellation once called. Two background threads do the rest as a
write-ahead log (the outbox pattern of §5 decision 5):

1. the writer appends what is queued to this process's spool file and ``fsync``s it (one
   fsync per batch, not per event), whatever the broker is doing;
2. the sender sends everything past the spool's committed offset to Kafka, in order, keyed
   by tenant;
3. after the broker acknowledges, it advances the committed offset; once the whole file is
   acknowledged, the file is truncated.

A broker outage therefore just grows the spool; the thread retries with backoff and drains
it in order when the broker returns. A gateway that stops (or dies) leaves its spool file
behind; the next gateway process to start finds the file unlocked and drains it first.
At-least-once: an event may be sent twice (crash between ack and offset write); the
consumer dedupes on ``request_id``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.usage")

USAGE_SCHEMA_VERSION = 1
FINISH_REASONS = ("stop", "length", "cancelled", "error", "timeout")
_OFFSET_WIDTH = 20
GROUP_COMMIT_S = 0.005
# Events are durable in the spool before they are sent, so delivery may linger: 0.2 s
# instead of 0.05 s cut the gateway's CPU per request by ~0.1-0.2 ms at 200 req/s
# (kafka-python's per-produce-request work, all of it under the GIL the event loop needs).
SEND_LINGER_S = 0.2
_BATCH_MAX = 500


@dataclass(frozen=True, slots=True)
class UsageEvent:
    request_id: str
    tenant_id: str
    api_key_id: str
    model: str  # the name the client asked for (alias or pinned version)
    model_version: str  # the weights version that served it
    replica_id: str
    started_at: str  # UTC ISO-8601
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    finish_reason: str  # stop | length | cancelled | error | timeout
    status: int  # HTTP status the client saw (200 even when a stream failed midway)
    is_retry: bool

    def to_json(self) -> bytes:
        # orjson serialises a dataclass natively (dataclasses.asdict would cost ~100 µs);
        # the schema version goes first so that a reader can branch before parsing on.
        return b'{"schema_version":%d,' % USAGE_SCHEMA_VERSION + orjson.dumps(self)[1:]


class Spool:
    """An append-only file of JSON lines plus a committed byte offset.

    The offset lives in a sidecar file as a fixed-width field rewritten in place. It is not
    fsynced: a stale offset after a crash only re-sends acknowledged events (duplicates
    are allowed); the events themselves are fsynced before they count as spooled.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd  # holds the flock for the owner's lifetime
        self._offset_fd = os.open(self._offset_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(fd).st_size
        self.committed = min(self._read_offset(), size)
        self.size = self._trim_torn_tail(size)
        self.depth = self._count_lines(self.committed, self.size)

    @staticmethod
    def _offset_path(path: Path) -> Path:
        return path.with_suffix(".offset")

    @classmethod
    def create(cls, directory: Path, name: str) -> Spool:
        """A new spool, locked before it becomes visible under its final name."""
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        final = directory / f"{name}.spool"
        os.replace(tmp, final)
        return cls(final, fd)

    @classmethod
    def adopt(cls, path: Path) -> Spool | None:
        """Open another process's spool if that process is gone (its lock is free)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if not path.exists():  # drained and removed by another adopter meanwhile
            os.close(fd)
            return None
        return cls(path, fd)

    def _read_offset(self) -> int:
        raw = os.pread(self._offset_fd, _OFFSET_WIDTH, 0)
        try:
            return int(raw) if raw.strip() else 0
        except ValueError:
            return 0

    def _write_offset(self, offset: int) -> None:
        os.pwrite(self._offset_fd, b"%0*d" % (_OFFSET_WIDTH, offset), 0)

    def _trim_torn_tail(self, size: int) -> int:
        """Drop a partial last line left by a crash mid-append."""
        if size == 0:
            return 0
        tail_start = max(self.committed, size - 65536)
        tail = os.pread(self._fd, size - tail_start, tail_start)
        if tail.endswith(b"\n") or not tail:
            return size
        cut = tail.rfind(b"\n")
        new_size = tail_start + cut + 1 if cut >= 0 else self.committed
        os.ftruncate(self._fd, new_size)
        return new_size

    def _count_lines(self, start: int, end: int) -> int:
        count, pos = 0, start
        while pos < end:
            chunk = os.pread(self._fd, min(1 << 20, end - pos), pos)
            if not chunk:
                break
            count += chunk.count(b"\n")
            pos += len(chunk)
        return count

    def append(self, records: list[bytes]) -> None:
        data = b"".join(r + b"\n" for r in records)
        os.write(self._fd, data)
        os.fsync(self._fd)
        self.size += len(data)
        self.depth += len(records)

    def pending(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` uncommitted records, each with the offset just past it."""
        out: list[tuple[int, bytes]] = []
        pos = self.committed
        while pos < self.size and len(out) < limit:
            chunk = os.pread(self._fd, min(1 << 20, self.size - pos), pos)
            start = 0
            while len(out) < limit:
                end = chunk.find(b"\n", start)
                if end < 0:
                    break
                out.append((pos + end + 1, chunk[start:end]))
                start = end + 1
            if start == 0:  # a single line longer than the read: cannot happen (< 1 MiB)
                break
            pos += start
        return out

    def commit(self, offset: int, count: int) -> None:
        self.committed = offset
        self.depth -= count
        if self.committed >= self.size:
            # Fully acknowledged: reclaim the file. A crash between the two steps leaves
            # offset > size, which opening clamps to the (empty) size.
            os.ftruncate(self._fd, 0)
            self.size = self.committed = 0
            self.depth = 0
        self._write_offset(self.committed)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._offset_path(self.path))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._offset_fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)


class KafkaSink:
    """kafka-python producer, created lazily and thrown away after a failure.

    Recreating after a failure drops whatever the old producer still buffered, so the only
    copy that is retried is the spool's (no second in-producer retry racing it).
    """

    def __init__(self, bootstrap: str, topic: str, timeout_s: float = 2.0) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._timeout_s = timeout_s
        self._producer: Any = None

    def send_batch(self, records: list[bytes]) -> int:
        """Send in order; return how many leading records the broker acknowledged."""
        from kafka import KafkaProducer

        if self._producer is None:
            ms = int(self._timeout_s * 1000)
            self._producer = KafkaProducer(
                bootstrap_servers=self._bootstrap,
                client_id="fairway-gateway",
                acks="all",
                linger_ms=2,
                max_block_ms=ms,
                request_timeout_ms=ms,
                delivery_timeout_ms=2 * ms,
                bootstrap_timeout_ms=ms,
                max_in_flight_requests_per_connection=1,
                reconnect_backoff_max_ms=1000,
            )
        futures = []
        acked = 0
        try:
            for record in records:
                key = orjson.loads(record).get("tenant_id", "").encode()
                futures.append(self._producer.send(self._topic, value=record, key=key))
            self._producer.flush(timeout=2 * self._timeout_s)
            for future in futures:
                if not future.succeeded():
                    break
                acked += 1
        except Exception as exc:  # noqa: BLE001 - any broker failure: back off, retry
            log.warning("kafka send failed after %d/%d records: %r", acked, len(records), exc)
        if acked < len(records):
            self.reset()
        return acked

    def reset(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=0)

    def close(self) -> None:
        self.reset()


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
    ) -> None:
        self._dir = spool_dir
        self._bootstrap = bootstrap
        self._topic = topic
        self._metrics = metrics
        self._name = f"usage-{instance_id or uuid.uuid4().hex}"
        self._kafka_timeout_s = kafka_timeout_s
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._spool: Spool | None = None
        self._orphans: list[Spool] = []
        self._sink: KafkaSink | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._writer_done = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards spool files: writer appends, sender commits
        self._closed = False
        self._retry_at = 0.0
        self._backoff = 0.1
        self._last_failed = False
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
            if self._spool is not None:
                self._spool.append([record])
            else:
                log.error("usage event after close, no spool: %s", record.decode())

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._spool = Spool.create(self._dir, self._name)
        if self._bootstrap:
            self._sink = KafkaSink(self._bootstrap, self._topic, self._kafka_timeout_s)
        else:
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
        spool for the next start (or another live gateway) to send.
        """
        self._stop_deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout_s + 2 * self._kafka_timeout_s + 1.0)
        with self._lock:
            self._closed = True
            self._absorb_queue()
        if self._sink is not None:
            self._sink.close()
        for orphan in self._orphans:
            orphan.close()
        self._orphans = []

    def close(self) -> None:
        """Release the spool file (after ``stop``); the file stays for the next owner."""
        with self._lock:
            if self._spool is not None:
                if self._spool.size == 0:
                    self._spool.remove()
                else:
                    self._spool.close()
                self._spool = None

    @property
    def depth(self) -> int:
        own = self._spool.depth if self._spool is not None else 0
        return own + sum(o.depth for o in self._orphans) + self._queue.qsize()

    # -- writer thread -----------------------------------------------------------------
    def _absorb_queue(self, first: bytes | None = None) -> int:
        batch: list[bytes] = [] if first is None else [first]
        with contextlib.suppress(queue.Empty):
            while len(batch) < 10 * _BATCH_MAX:
                batch.append(self._queue.get_nowait())
        if batch and self._spool is not None:
            self._spool.append(batch)
        return len(batch)

    def _write_loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                first: bytes | None = self._queue.get(timeout=0.05)
            except queue.Empty:
                first = None
            if first is not None and not stopping:
                # Group commit: one write + fsync for what arrives within a few ms, instead
                # of one per event (the events wait in memory either way).
                time.sleep(GROUP_COMMIT_S)
            try:
                with self._lock:
                    written = self._absorb_queue(first)
                if written:
                    self._wake.set()
                    self._metrics.spool_depth.set(self.depth)
            except Exception:  # noqa: BLE001 - keep the writer alive whatever happens
                log.exception("usage spool write failed")
                time.sleep(0.1)
            if stopping and self._queue.empty():
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
                self._last_failed = True
            self._metrics.spool_depth.set(self.depth)
            if stopping and (
                self.depth == 0
                or self._sink is None
                or self._last_failed
                or time.monotonic() >= self._stop_deadline
            ):
                return

    def _scan_orphans(self) -> None:
        now = time.monotonic()
        if now < self._next_scan:
            return
        self._next_scan = now + 5.0
        known = {o.path for o in self._orphans}
        if self._spool is not None:
            known.add(self._spool.path)
        for path in sorted(self._dir.glob("usage-*.spool")):
            if path in known:
                continue
            orphan = Spool.adopt(path)
            if orphan is not None:
                log.info("adopted spool %s with %d undelivered events", path, orphan.depth)
                self._orphans.append(orphan)

    def _deliver(self) -> None:
        """Send pending records, orphans first (they are older)."""
        if self._sink is None or time.monotonic() < self._retry_at:
            return
        for orphan in list(self._orphans):
            if not self._drain(orphan):
                return
            with self._lock:
                orphan.remove()
            self._orphans.remove(orphan)
        if self._spool is not None:
            self._drain(self._spool)

    def _drain(self, spool: Spool) -> bool:
        assert self._sink is not None
        while True:
            with self._lock:
                pending = spool.pending(_BATCH_MAX)
            if not pending:
                self._last_failed = False
                return True
            acked = self._sink.send_batch([record for _, record in pending])
            if acked:
                with self._lock:
                    spool.commit(pending[acked - 1][0], acked)
                self._metrics.usage_events.labels("delivered").inc(acked)
            if acked < len(pending):
                self._last_failed = True
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 2.0)
                return False
            self._backoff = 0.1
