"""Usage ingestion: Kafka usage.v1 → committed PostgreSQL rows, with the guarantees on.

The real consumer (``metering.consumer.UsageConsumer``, the class the Celery bootstep runs)
reads a topic of gateway-shaped events (``gateway.usage.events.UsageEvent`` JSON, keyed by tenant,
4 partitions) and writes each batch in one transaction — ``request_log`` with ON CONFLICT,
``usage`` upserted from the inserted rows — then commits the offsets. Two measurements:

1. **Sustained**: a backlog of N events is produced first; the clock runs from the first
   batch's commit (after the group join) until every event is in committed rows. Events /
   that time is the rate the consumer sustains; three runs, the median kept.
2. **Burst**: with the consumer idle and caught up, events are produced at 5× the sustained
   rate (as fast as this machine's producer can, up to that) for a burst; reported: the
   rate actually produced, the peak lag and the time from the burst's end until the lag is
   drained (every event committed). The burst lasts ``--burst-s`` seconds (default 60)
   unless that many events cannot be produced here, in which case it is shortened and the
   report says so (``--burst-mode live``).
3. **Burst, pre-loaded** (``--burst-mode preload``): this machine's producers cannot send 5×
   the sustained rate R live, but the state a burst leaves behind can be built: at the end of
   ``--burst-s`` seconds at 5R, with the consumer committing C events/s all along (C = R: it
   is saturated at its sustained rate), (5R − C)·burst_s events are not yet committed. That
   backlog is produced into the broker first, with no consumer in the group; then one
   consumer starts and the clock runs until every event is in committed rows, the group's
   committed offsets equal each partition's end (lag 0) and the rows counted in request_log
   equal the events produced. ``both`` (the default) runs the live burst and then this one.

``--keep-earlier`` skips the sustained runs: R is the median recorded in the existing
ingest.md, and every section not rerun is kept from it, labelled with the run it came from.

Also: where the consumer's time goes (Kafka poll and decode, parse + check, the
transaction, the offset commit), from the consumer's own stage timers.

``python -m bench.ingest`` writes bench/results/ingest.md. PostgreSQL: DATABASE_URL, else the
machine's (database ``--db-name``, default ``fairway_bench``, created and migrated), else an
embedded one; Kafka: an embedded broker of its own.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
TOPIC_PARTITIONS = 4
TENANTS = 200
PRODUCERS = 2  # burst producer processes


def setup_django(services: Any, db_name: str = "fairway_bench") -> tuple[str, bool]:
    """Django on the bench's database; True when it is our own ``db_name`` (then the
    rows the run wrote are removed at the end; a DATABASE_URL given is never cleaned)."""
    own = not os.environ.get("DATABASE_URL")
    url = services.database_url(name=db_name)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairway.settings.local")
    os.environ["DEBUG"] = "0"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    # Like the other benchmarks: never the development Redis DB 0.
    os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)
    return url, own


def cleanup(fx: Fixture) -> None:
    """Drop what the run wrote to its own database: request_log partitions (nothing else
    writes there) and the bench tenants' usage rows and dead letters."""
    from django.db import connection

    from metering.store import existing_partitions

    with connection.cursor() as cur:
        for name in existing_partitions().values():
            cur.execute(f"DROP TABLE IF EXISTS {name}")
        cur.execute("DELETE FROM usage WHERE tenant_id = ANY(%s::uuid[])", [fx.tenants])
        cur.execute("DELETE FROM usage_dead_letter WHERE topic LIKE 'bench-usage-%%'")


@dataclass
class Fixture:
    tenants: list[str]
    keys: list[str]
    version: str


def seed() -> Fixture:
    from catalog.testing import priced_version
    from tenants.models import Plan, Tenant

    plan, _ = Plan.objects.get_or_create(
        name="bench-ingest", defaults={"admission_class": "standard"}
    )
    version = priced_version(
        family="bench-8b",
        display_name="Bench 8B",
        version="bench-8b-2026-05",
        actor_label="system:bench.ingest",
    )
    have = list(Tenant.objects.filter(plan=plan).values_list("id", flat=True)[:TENANTS])
    if len(have) < TENANTS:
        # bulk_create: no per-tenant read-model push (the gateway plays no part here).
        made = Tenant.objects.bulk_create(
            Tenant(name=f"bench-{uuid.uuid4().hex[:10]}", plan=plan)
            for _ in range(TENANTS - len(have))
        )
        have += [t.id for t in made]
    return Fixture(
        tenants=[str(t) for t in have],
        keys=[str(uuid.uuid4()) for _ in range(TENANTS)],
        version=version.name,
    )


def make_events(fx: Fixture, n: int, run: str) -> list[tuple[bytes, bytes]]:
    """``n`` gateway-shaped events (value, key), spread over the last two hours."""
    return list(iter_events(fx, n, run))


def iter_events(fx: Fixture, n: int, run: str) -> Iterator[tuple[bytes, bytes]]:
    """The events of :func:`make_events`, made one at a time (a multi-million backlog is
    never held in the producer's memory)."""
    from gateway.usage.events import UsageEvent

    now = datetime.now(UTC)
    for i in range(n):
        t = i % TENANTS
        finish = "cancelled" if i % 50 == 0 else ("error" if i % 97 == 0 else "stop")
        prompt = 200 + (i * 37) % 4000
        event = UsageEvent(
            request_id=f"{run}-{i}",
            tenant_id=fx.tenants[t],
            api_key_id=fx.keys[t],
            model="bench-8b",
            model_version=fx.version,
            replica_id=f"r{i % 8}",
            started_at=(now - timedelta(seconds=(i * 7) % 7200)).isoformat(),
            prompt_tokens=prompt,
            completion_tokens=(i * 13) % 600,
            cached_tokens=prompt // 4,
            ttft_ms=120.5,
            tpot_ms=31.25,
            finish_reason=finish,
            status=200,
            is_retry=False,
        )
        yield event.to_json(), fx.tenants[t].encode()


def produce(
    bootstrap: str,
    topic: str,
    events: Iterable[tuple[bytes, bytes]],
    rate: float,
    sent: list[int] | None = None,
    progress: Any = None,
    ends: dict[int, int] | None = None,
) -> float:
    """Send at up to ``rate`` events/s (0: as fast as possible); return the seconds taken.
    ``sent[0]`` follows how many have been handed to the producer; ``ends`` gets each
    partition's end offset (last acknowledged offset + 1)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=20,
        batch_size=1 << 20,
        max_request_size=8 << 20,
    )

    def acked(meta: Any) -> None:
        if ends is not None:  # only called when given; narrowed for the type checker
            ends[meta.partition] = max(ends.get(meta.partition, 0), meta.offset + 1)

    started = time.perf_counter()
    count = 0
    for i, (value, key) in enumerate(events):
        future = producer.send(topic, value=value, key=key)
        if ends is not None:
            future.add_callback(acked)
        count = i + 1
        if sent is not None:
            sent[0] = i + 1
        if rate and i % 1000 == 999:
            if progress is not None:
                progress(i + 1)
            ahead = (i + 1) / rate - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)
    producer.flush(timeout=120)
    if progress is not None:
        progress(count)
    took = time.perf_counter() - started
    producer.close(timeout=10)
    return took


def committed_count(run: str) -> int:
    """Rows of this run in request_log (checked once at the end, not polled)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM request_log WHERE request_id LIKE %s AND started_at > %s",
            [f"{run}-%", datetime.now(UTC) - timedelta(hours=3)],
        )
        return int(cur.fetchone()[0])


def wait_committed(consumer: Any, n: int, timeout: float, stall_s: float = 60.0) -> float:
    """Seconds until the consumer has committed ``n`` events (its counters move only after
    the transaction commits), polling every 10 ms. Dead letters count as handled (the rows
    check afterwards catches them); no progress for ``stall_s`` fails at once, saying where
    the consumer stands, rather than waiting out ``timeout``."""
    started = time.perf_counter()
    last, moved = -1, started
    while True:
        handled = sum(consumer.totals.values())
        if handled >= n:
            return time.perf_counter() - started
        now = time.perf_counter()
        if handled != last:
            last, moved = handled, now
        if now - started > timeout or now - moved > stall_s:
            why = "timed out" if now - started > timeout else f"no progress for {stall_s:.0f} s"
            raise TimeoutError(
                f"{why}: {consumer.totals} of {n} handled, {consumer.batches} batches, "
                f"assigned {consumer.wait_assigned(0)}, running {consumer.running}, "
                f"last error {consumer.last_error!r}"
            )
        time.sleep(0.01)


def joined_consumer(
    bootstrap: str, topic: str, group: str, batch_max: int, *, wait_s: float = 45.0
) -> tuple[Any, float]:
    """A started consumer of ``topic`` that holds its partitions, and the seconds its group
    join took (about half the session timeout here). The embedded broker can leave a join
    unfinished for good (seen: after a member left mid-join, no later member of that group
    was ever assigned), so a join unfinished after ``wait_s`` is abandoned for a new group:
    nothing is committed yet, so it too starts from the earliest offsets."""
    from metering.consumer import ConsumerConfig, UsageConsumer

    for attempt in range(3):
        group_id = group if attempt == 0 else f"{group}-r{attempt}"
        consumer = UsageConsumer(
            ConsumerConfig(bootstrap=bootstrap, topic=topic, group_id=group_id, batch_max=batch_max)
        )
        started = time.perf_counter()
        consumer.start()
        if consumer.wait_assigned(wait_s):
            return consumer, time.perf_counter() - started
        print(f"group {group_id}: join unfinished after {wait_s:.0f} s; a new group", flush=True)
        consumer.stop()
    raise TimeoutError(f"no join completed in 3 groups; last error {consumer.last_error!r}")


@dataclass
class Sustained:
    events: int
    seconds: float
    produce_rate: float
    stage_seconds: dict[str, float]
    batches: int

    @property
    def rate(self) -> float:
        return self.events / self.seconds


@dataclass
class Burst:
    target_rate: float
    events: int
    produce_seconds: float
    peak_lag: int
    lag_at_end: int  # sent - committed when the last event was acknowledged
    drain_after_s: float
    shortened: bool

    @property
    def produced_rate(self) -> float:
        return self.events / self.produce_seconds


@dataclass
class Preload:
    sustained_rate: float  # R, the median sustained run of the same invocation
    consumer_rate: float  # C, assumed committed per second during the burst
    burst_s: float
    wanted: int  # (5R - C) * burst_s
    events: int  # produced (wanted, unless memory did not allow it)
    produce_seconds: float
    join_s: float  # consumer started -> partitions assigned (the group join)
    drain_s: float  # partitions assigned -> last event in committed rows
    batches: int
    lag_after: int  # sum over partitions of end offset - the group's committed offset
    rows: int  # this run's rows in request_log
    broker_rss_mb: tuple[int, int]  # the broker's RSS before the preload and at its peak
    min_available_mb: int  # the machine's MemAvailable at its lowest during the run
    memory_cap: int  # most events the memory check allowed
    stage_seconds: dict[str, float]  # the consumer's busy time by stage, over the drain

    @property
    def drain_rate(self) -> float:
        return self.events / self.drain_s

    @property
    def from_start_s(self) -> float:
        return self.join_s + self.drain_s


def median_run(runs: list[Sustained]) -> Sustained:
    return sorted(runs, key=lambda r: r.rate)[len(runs) // 2]


def run_sustained(bootstrap: str, fx: Fixture, n: int, batch_max: int) -> Sustained:
    from fairway.embedded import ensure_topic

    run = f"s{uuid.uuid4().hex[:8]}"
    topic = f"bench-usage-{run}"
    ensure_topic(bootstrap, topic, TOPIC_PARTITIONS)
    events = make_events(fx, n, run)
    print(f"producing a backlog of {n} events ...", flush=True)
    produce_s = produce(bootstrap, topic, events, 0)
    consumer, _ = joined_consumer(bootstrap, topic, run, batch_max)
    try:
        # The clock starts when the first batch is committed: the group join before it is
        # not ingest time.
        wait_committed(consumer, 1, timeout=120)
        first = consumer.totals["ingested"] + consumer.totals["duplicate"]
        started = time.perf_counter()
        stages_before = dict(consumer.seconds)
        wait_committed(consumer, n, timeout=600)
        took = time.perf_counter() - started
    finally:
        consumer.stop()
    if committed_count(run) != n:
        raise RuntimeError("rows in request_log differ from events produced")
    return Sustained(
        events=n - first,
        seconds=took,
        produce_rate=n / produce_s,
        stage_seconds={k: v - stages_before[k] for k, v in consumer.seconds.items()},
        batches=consumer.batches,
    )


def run_burst(
    bootstrap: str,
    fx: Fixture,
    sustained_rate: float,
    burst_s: float,
    max_events: int,
    batch_max: int,
) -> Burst:
    from fairway.embedded import ensure_topic

    run = f"b{uuid.uuid4().hex[:8]}"
    topic = f"bench-usage-{run}"
    ensure_topic(bootstrap, topic, TOPIC_PARTITIONS)
    target = 5 * sustained_rate
    n = int(target * burst_s)
    shortened = n > max_events
    n = min(n, max_events)
    consumer, _ = joined_consumer(bootstrap, topic, run, batch_max)
    # The burst comes from producer processes (as from gateways), not from the consumer's
    # process: one producer thread there would compete with the consumer for the GIL.
    ctx = mp.get_context("spawn")
    sent = [ctx.Value("q", 0) for _ in range(PRODUCERS)]
    ready = ctx.Barrier(PRODUCERS + 1)
    shares = [n // PRODUCERS + (1 if i < n % PRODUCERS else 0) for i in range(PRODUCERS)]
    children = [
        ctx.Process(
            target=_burst_child,
            args=(
                bootstrap,
                topic,
                fx,
                shares[i],
                f"{run}-{i}",
                target / PRODUCERS,
                sent[i],
                ready,
            ),
        )
        for i in range(PRODUCERS)
    ]
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        # Lag = sent - committed: it also counts what the consumer has not fetched yet (the
        # embedded broker's ListOffsets answer, end_offsets(), is wrong: 1 for any partition).
        nonlocal peak
        while not stop.is_set():
            done = consumer.totals["ingested"] + consumer.totals["duplicate"]
            peak = max(peak, sum(v.value for v in sent) - done)
            time.sleep(0.05)

    try:
        for child in children:
            child.start()
        print(f"burst: {n} events at up to {target:.0f}/s ...", flush=True)
        ready.wait(300)  # every producer has its events ready
        started = time.perf_counter()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for child in children:
            child.join(600)
        produce_s = time.perf_counter() - started
        lag_at_end = n - (consumer.totals["ingested"] + consumer.totals["duplicate"])
        if any(c.exitcode != 0 for c in children):
            raise RuntimeError("a burst producer failed")
        drain = wait_committed(consumer, n, timeout=600)
        stop.set()
        watcher.join(1)
    finally:
        stop.set()
        consumer.stop()
        for child in children:
            if child.is_alive():
                child.kill()
    if committed_count(run) != n:
        raise RuntimeError("rows in request_log differ from events produced")
    return Burst(
        target_rate=target,
        events=n,
        produce_seconds=produce_s,
        peak_lag=max(peak, lag_at_end),
        lag_at_end=lag_at_end,
        drain_after_s=drain,
        shortened=shortened,
    )


def _mem_mb(path: str, field: str) -> int:
    """A ``kB`` field of /proc/meminfo or /proc/<pid>/status, in MiB (0 if unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


# Bytes of broker memory per event (its ~430-byte value, the tenant key and Tansu's own
# per-record cost: ~680 B measured here with the in-memory storage), with a margin.
BROKER_BYTES_PER_EVENT = 900
MEMORY_RESERVE_MB = 4096  # left to PostgreSQL, the consumer and the other work on the machine


def preload_cap(available_mb: int) -> int:
    """The most events the broker can hold here, leaving the reserve free."""
    return max(0, (available_mb - MEMORY_RESERVE_MB) * (1 << 20) // BROKER_BYTES_PER_EVENT)


def run_preload(
    bootstrap: str,
    broker_pid: int,
    fx: Fixture,
    sustained_rate: float,
    consumer_rate: float,
    burst_s: float,
    batch_max: int,
) -> Preload:
    """The backlog a burst of ``burst_s`` at 5R leaves, produced with no consumer in the
    group; then one consumer drains it. Checked at the end: lag 0 and rows = events."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    from fairway.embedded import ensure_topic

    run = f"p{uuid.uuid4().hex[:8]}"
    topic = f"bench-usage-{run}"
    ensure_topic(bootstrap, topic, TOPIC_PARTITIONS)
    wanted = int((5 * sustained_rate - consumer_rate) * burst_s)
    cap = preload_cap(_mem_mb("/proc/meminfo", "MemAvailable"))
    n = min(wanted, cap)
    rss_before = _mem_mb(f"/proc/{broker_pid}/status", "VmRSS")
    peak_rss, min_avail = rss_before, _mem_mb("/proc/meminfo", "MemAvailable")
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak_rss, min_avail
        while not stop.wait(0.5):
            peak_rss = max(peak_rss, _mem_mb(f"/proc/{broker_pid}/status", "VmRSS"))
            min_avail = min(min_avail, _mem_mb("/proc/meminfo", "MemAvailable"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # Producer processes (as the gateways are), each making its share of events as it sends.
    ctx = mp.get_context("spawn")
    shares = [n // PRODUCERS + (1 if i < n % PRODUCERS else 0) for i in range(PRODUCERS)]
    ends = [ctx.Array("q", TOPIC_PARTITIONS) for _ in range(PRODUCERS)]
    children = [
        ctx.Process(
            target=_preload_child,
            args=(bootstrap, topic, fx, shares[i], f"{run}-{i}", ends[i]),
        )
        for i in range(PRODUCERS)
    ]
    consumer = None
    try:
        print(
            f"preload: {n} events (a {burst_s:.0f} s burst at 5R leaves {wanted}) ...", flush=True
        )
        started = time.perf_counter()
        for child in children:
            child.start()
        for child in children:
            child.join(3600)
        produce_s = time.perf_counter() - started
        if any(c.exitcode != 0 for c in children):
            raise RuntimeError("a preload producer failed")
        end = [max(e[p] for e in ends) for p in range(TOPIC_PARTITIONS)]
        if sum(end) != n:
            raise RuntimeError(f"the broker acknowledged {sum(end)} of {n} events")
        print(f"preload: produced in {produce_s:.0f} s; draining ...", flush=True)
        consumer, join_s = joined_consumer(bootstrap, topic, run, batch_max)
        assigned = time.perf_counter()
        wait_committed(consumer, n, timeout=3600)
        done = time.perf_counter()
        consumer.stop()  # its last offsets are committed before it returns
        batches = consumer.batches
        stage_seconds = dict(consumer.seconds)
    finally:
        stop.set()
        if consumer is not None:
            consumer.stop()
        for child in children:
            if child.is_alive():
                child.kill()
    group = consumer.config.group_id
    reader = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        committed = [reader.committed(TopicPartition(topic, p)) or 0 for p in range(len(end))]
    finally:
        reader.close(autocommit=False)
    watcher.join(1)
    result = Preload(
        sustained_rate=sustained_rate,
        consumer_rate=consumer_rate,
        burst_s=burst_s,
        wanted=wanted,
        events=n,
        produce_seconds=produce_s,
        join_s=join_s,
        drain_s=done - assigned,
        batches=batches,
        lag_after=sum(e - c for e, c in zip(end, committed, strict=True)),
        rows=committed_count(run),
        broker_rss_mb=(rss_before, peak_rss),
        min_available_mb=min_avail,
        memory_cap=cap,
        stage_seconds=stage_seconds,
    )
    if result.rows != n or result.lag_after != 0:
        raise RuntimeError(f"not drained: {result.rows} rows of {n}, lag {result.lag_after}")
    return result


def _preload_child(
    bootstrap: str, topic: str, fx: Fixture, n: int, run: str, ends_out: Any
) -> None:
    ends: dict[int, int] = {}
    produce(bootstrap, topic, iter_events(fx, n, run), 0, ends=ends)
    for partition, end in ends.items():
        ends_out[partition] = end


def _burst_child(
    bootstrap: str,
    topic: str,
    fx: Fixture,
    n: int,
    run: str,
    rate: float,
    sent: Any,
    ready: Any,
) -> None:
    events = make_events(fx, n, run)
    counter = [0]
    ready.wait(300)

    def progress(count: int) -> None:
        sent.value = count

    produce(bootstrap, topic, events, rate, counter, progress)


@dataclass
class Earlier:
    """What an earlier run left in ingest.md, for ``--keep-earlier``: its sustained median,
    its sections by heading and a line saying which run they came from."""

    rate: float
    sections: dict[str, str]
    origin: str

    def section(self, prefix: str) -> list[str]:
        """The section whose heading starts with ``prefix``, labelled as kept ([] if none)."""
        for heading, body in self.sections.items():
            if heading.startswith(prefix):
                lines = body.rstrip("\n").split("\n")
                if not any(line.startswith(KEPT) for line in lines[:3]):
                    lines[1:1] = ["", f"{KEPT} ({self.origin}); not rerun by this one.*"]
                return ["", *lines, ""]
        return []


KEPT = "*Kept from an earlier run"


def read_earlier(path: Path) -> Earlier:
    """Parse an ingest.md this module wrote."""
    text = path.read_text()
    found = re.search(r"Median \*\*([\d,]+) events/s\*\*", text)
    if found is None:
        raise SystemExit(f"--keep-earlier: no sustained median in {path}")
    parts = re.split(r"^(?=## )", text, flags=re.M)
    sections = {part.split("\n", 1)[0]: part for part in parts if part.startswith("## ")}
    # The run that wrote the file (a section it had kept in turn keeps its own label).
    command = re.search(r"^`([^`]+)`", text, flags=re.M)
    load = re.search(
        r"load average (\([^)]*\) .*?at\s+the\s+end\s+of\s+the\s+run)", text, flags=re.S
    )
    origin = (
        f"`{command.group(1) if command else '?'}`, "
        f"load average {' '.join(load.group(1).split()) if load else 'not recorded'}"
    )
    return Earlier(rate=float(found.group(1).replace(",", "")), sections=sections, origin=origin)


def report(
    runs: list[Sustained],
    b: Burst | None,
    pre: Preload | None,
    args: argparse.Namespace,
    db: str,
    command: str,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
    earlier: Earlier | None = None,
) -> str:
    """ingest.md, one function per section; with ``earlier``, the sections this invocation
    did not run are the earlier run's, labelled so."""
    sustained = _sustained_section(runs, median_run(runs)) if runs else []
    preload = _preload_section(pre, b, kept=not runs) if pre is not None else []
    live = _burst_section(b, args) if b is not None else []
    if earlier is not None:
        sustained = sustained or earlier.section("## Sustained ingest")
        preload = preload or earlier.section("## Drain after")
        live = live or earlier.section("## Burst at 5×")
    sections = [*_intro(args, db, command, load), *sustained, *preload, *live]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(sections))


def _loads(avg: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.1f}" for x in avg)


def _intro(
    args: argparse.Namespace,
    db: str,
    command: str,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
) -> list[str]:
    """The command, the machine and the consumer's guarantees."""
    return [
        "# Usage ingestion: Kafka → committed PostgreSQL rows",
        "",
        f"`{command}` on {os.cpu_count()} CPU cores (shared with other work), PostgreSQL "
        f"{db.split('@')[-1].split('?')[0]}, the embedded Kafka-protocol broker (Tansu, in "
        f"memory), topic of {TOPIC_PARTITIONS} partitions, {TENANTS} tenants, one consumer "
        f"(`metering.consumer.UsageConsumer`: a polling thread and a writer thread), batches "
        f"of up to {args.batch_max}. "
        "Guarantees on: one transaction per batch (request_log ON CONFLICT DO NOTHING "
        "RETURNING → usage upsert), offsets committed synchronously after it, "
        "synchronous_commit on. The machine was shared with other work: load average "
        f"(1/5/15 min) {_loads(load[0])} at the start and {_loads(load[1])} at the end of "
        f"the run, on {os.cpu_count()} cores.",
        "",
    ]


def _sustained_section(runs: list[Sustained], s: Sustained) -> list[str]:
    """Each sustained run, the median, and where the median run's consumer time went."""
    lines = [
        "## Sustained ingest",
        "",
        "| run | events | seconds (first batch committed → last) | events/s | batches |",
        "|---|---|---|---|---|",
        *(
            f"| {i + 1} | {r.events} | {r.seconds:.2f} | {r.rate:,.0f} | {r.batches} |"
            for i, r in enumerate(runs)
        ),
        "",
        f"Median **{s.rate:,.0f} events/s** (each run a fresh topic, consumer group and "
        f"backlog). Target ≥ 20,000 events/s: **{'met' if s.rate >= 20_000 else 'not met'}**"
        " (median). The clock runs from the first batch's commit (after the group join) to "
        "the last one's; the events of the first batch are not counted. The backlogs were "
        f"produced beforehand at {s.produce_rate:,.0f} events/s (median run).",
        "",
        "Where the consumer's time goes in the median run (busy time from its own stage "
        "timers; the write runs on a second thread, overlapped with the next batch's poll and "
        "check, so the shares are of the busy total, not of the wall time):",
        "",
        "| stage | seconds | µs per event | share |",
        "|---|---|---|---|",
    ]
    return lines + _stage_rows(s.stage_seconds, s.events)


STAGES = {
    "poll": "Kafka fetch + record decode (kafka-python, non-empty polls)",
    "check": "JSON parse + checks + billing rule (metering.events)",
    "partitions": "day partitions (cached)",
    "write": "the transaction: request_log + usage (+ dead letters)",
    "commit": "offset commit",
}


def _stage_rows(stage_seconds: dict[str, float], events: int) -> list[str]:
    """| stage | seconds | µs per event | share | rows from the consumer's stage timers."""
    total = sum(stage_seconds.values())
    rows = []
    for key, label in STAGES.items():
        sec = stage_seconds.get(key, 0.0)
        share = 100 * sec / total if total else 0
        rows.append(f"| {label} | {sec:.2f} | {1e6 * sec / events:.1f} | {share:.0f} % |")
    return rows


def _preload_section(pre: Preload, live: Burst | None, *, kept: bool = False) -> list[str]:
    """The drain of the backlog a full burst at 5x leaves: the arithmetic, its assumptions,
    the measured drain and the checks."""
    r, c = pre.sustained_rate, pre.consumer_rate
    live_note = "a live burst, --burst-mode live, reaches about 1.2R"
    lines = [
        "",
        f"## Drain after a {pre.burst_s:.0f} s burst at 5× (backlog pre-loaded)",
        "",
        f"R = {r:,.0f} events/s (the median sustained run above"
        f"{', recorded by the earlier run' if kept else ''}). A burst of "
        f"{pre.burst_s:.0f} s at 5R = {5 * r:,.0f} events/s brings {5 * r * pre.burst_s:,.0f} "
        f"events; the consumer, saturated, commits C = R = {c:,.0f} events/s meanwhile, so "
        f"when the burst ends (5R − C) × {pre.burst_s:.0f} s = **{pre.wanted:,} events** are "
        "not yet committed. This machine's producers cannot send 5R live ("
        f"{'see the live burst below' if live is not None else live_note}"
        "), so that state is built instead: the backlog is produced into the broker "
        "first, with no consumer in the group, then one consumer (the same class and "
        "settings) starts and drains it.",
        "",
        "| backlog events | produced in s | consumer start → assigned s | assigned → all "
        "committed s | drain rate | batches | lag after | rows = events |",
        "|---|---|---|---|---|---|---|---|",
        f"| {pre.events:,} | {pre.produce_seconds:.0f} | {pre.join_s:.1f} | "
        f"**{pre.drain_s:.0f}** | **{pre.drain_rate:,.0f}/s** | {pre.batches} | "
        f"{pre.lag_after} | {'yes' if pre.rows == pre.events else f'no ({pre.rows})'} |",
        "",
        f"Time to drain the lag after the burst: **{pre.drain_s:.0f} s** "
        f"({pre.drain_s / 60:.1f} min) at {pre.drain_rate:,.0f} events/s "
        f"({pre.drain_rate / r:.2f} R), from the consumer holding its partitions until the "
        "last event is in committed rows; "
        f"{pre.from_start_s:.0f} s counting the group join (consumer start → partitions "
        f"assigned, {pre.join_s:.1f} s — the running consumer of a real burst is already in "
        "the group). Checked at the end: the group's committed offsets equal every "
        f"partition's end offset (lag {pre.lag_after}) and request_log holds {pre.rows:,} rows "
        f"of this run for {pre.events:,} events.",
        "",
        "Where the consumer's time went during the drain (busy time, as for the sustained "
        "runs; the group join included):",
        "",
        "| stage | seconds | µs per event | share |",
        "|---|---|---|---|",
        *_stage_rows(pre.stage_seconds, pre.events),
        "",
        "Assumptions: (1) the consumer commits at R throughout the burst — it was saturated "
        "at that rate in the sustained runs, which start from a backlog just like this one; "
        "(2) no new events arrive during the drain: with normal traffic of r events/s "
        f"still arriving, the drain takes backlog / (drain rate − r) instead, e.g. "
        f"{pre.events / max(pre.drain_rate - 333, 1):.0f} s at the ~333 events/s of "
        "the capacity section of docs/operations.md (333 req/s, one event each); (3) one "
        "consumer, as in the sustained figure — the "
        "deployment runs one per partition (4, deploy/k8s/base/config.yaml), each on its own "
        "pod, which splits the backlog four ways by partition; that is not measured here "
        "(2 cores). "
        f"The broker (Tansu, in memory) held the backlog in {pre.broker_rss_mb[1]:,} MiB of RSS "
        f"at its peak ({pre.broker_rss_mb[0]:,} MiB before); the machine's available memory "
        f"was at least {pre.min_available_mb:,} MiB throughout.",
    ]
    if pre.events < pre.wanted:
        lines += [
            "",
            f"**Shortened**: memory here allowed {pre.memory_cap:,} events "
            f"({BROKER_BYTES_PER_EVENT} B each in the broker, {MEMORY_RESERVE_MB} MiB kept "
            f"free), not {pre.wanted:,}; the drain time of the full backlog at the measured "
            f"rate would be {pre.wanted / pre.drain_rate:.0f} s (extrapolated).",
        ]
    if live is not None and live.produce_seconds > 0:
        c_live = (live.events - live.lag_at_end) / live.produce_seconds
        if c_live < c:
            bigger = int((5 * r - c_live) * pre.burst_s)
            lines += [
                "",
                f"With C as measured under the live burst below instead ({c_live:,.0f} "
                "events/s, the consumer sharing the 2 cores with the producers, which the "
                f"gateways do not in production) the backlog would be {bigger:,} events: "
                f"{bigger / pre.drain_rate:.0f} s at the drain rate measured here "
                "(extrapolated, not measured).",
            ]
    return lines


def _burst_section(b: Burst, args: argparse.Namespace) -> list[str]:
    """The burst at 5x the sustained rate: peak lag and drain time, with its caveats."""
    lines: list[str] = []
    lines += [
        "",
        "## Burst at 5× the sustained rate, live (capped)",
        "",
        "| target rate | events | produced in s | produced rate | peak lag (sent − committed) "
        "| drain after burst s |",
        "|---|---|---|---|---|---|",
        f"| {b.target_rate:,.0f}/s | {b.events} | {b.produce_seconds:.1f} | "
        f"{b.produced_rate:,.0f}/s | {b.peak_lag} | **{b.drain_after_s:.1f}** |",
        "",
    ]
    notes = []
    if b.shortened:
        notes.append(
            f"The burst was shortened from {args.burst_s:.0f} s to "
            f"{b.events / b.target_rate:.1f} s of the target rate (at most {args.max_burst} "
            "events: memory and producer time on this machine)."
        )
    if b.produced_rate < 0.9 * b.target_rate:
        notes.append(
            f"The producers (kafka-python, {PRODUCERS} processes on this shared machine) could "
            "not reach "
            f"the target rate: the burst ran at {5 * b.produced_rate / b.target_rate:.1f}× the "
            "sustained rate instead of 5×, and the consumer ran concurrently with it on the "
            "same cores."
        )
    during = (b.events - b.lag_at_end) / b.produce_seconds
    after = b.lag_at_end / b.drain_after_s if b.drain_after_s > 0 else float("nan")
    notes.append(
        "Drain time = from the last event's acknowledgement by the broker until the last "
        f"event is in committed rows: {b.lag_at_end} events were behind then. During the "
        f"burst the consumer committed {during:,.0f} events/s (sharing the cores with the "
        f"producers), and drained the rest at {after:,.0f} events/s."
    )
    lines += [*notes, ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="sustained backlog size")
    ap.add_argument("--repeats", type=int, default=3, help="sustained runs (median kept)")
    ap.add_argument("--burst-s", type=float, default=60.0)
    ap.add_argument("--max-burst", type=int, default=400_000, help="cap on live burst events")
    ap.add_argument(
        "--burst-mode",
        choices=("both", "preload", "live"),
        default="both",
        help="preload: the backlog a full burst leaves, pre-loaded, then drained; "
        "live: a burst produced while the consumer runs (capped); both: live, then preload",
    )
    ap.add_argument("--batch-max", type=int, default=5000)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--db-name",
        default="fairway_bench",
        help="database on the machine's PostgreSQL (created and migrated; its request_log "
        "is emptied between runs, so no two runs may share one)",
    )
    ap.add_argument(
        "--keep-earlier",
        action="store_true",
        help="no sustained runs: R is the median recorded in OUT/ingest.md, and the sections "
        "this invocation does not run are kept from that file, labelled as such",
    )
    args = ap.parse_args(argv)
    earlier = read_earlier(args.out / "ingest.md") if args.keep_earlier else None
    command = "python -m bench.ingest " + " ".join(argv if argv is not None else sys.argv[1:])

    from fairway.embedded import EmbeddedServices

    services = EmbeddedServices()
    load_start = os.getloadavg()
    own_db, fx = False, None
    try:
        db, own_db = setup_django(services, args.db_name)
        bootstrap = services.start_kafka()
        broker_pid = services.processes[-1].pid
        fx = seed()
        runs: list[Sustained] = []
        for _ in range(0 if earlier else args.repeats):
            if own_db:
                cleanup(fx)  # every run starts from the same (empty) request_log
            runs.append(run_sustained(bootstrap, fx, args.events, args.batch_max))
            print(f"sustained: {runs[-1].rate:,.0f} events/s; stages {runs[-1].stage_seconds}")
        rate = earlier.rate if earlier else median_run(runs).rate
        burst = pre = None
        if args.burst_mode in ("both", "live"):
            if own_db:
                cleanup(fx)
            burst = run_burst(bootstrap, fx, rate, args.burst_s, args.max_burst, args.batch_max)
            print(
                f"burst: {burst.events} events at {burst.produced_rate:,.0f}/s, "
                f"peak lag {burst.peak_lag}, drained {burst.drain_after_s:.1f}s after"
            )
        if args.burst_mode in ("both", "preload"):
            if own_db:
                cleanup(fx)
            pre = run_preload(bootstrap, broker_pid, fx, rate, rate, args.burst_s, args.batch_max)
            print(
                f"preload: {pre.events} events drained in {pre.drain_s:.1f}s "
                f"({pre.drain_rate:,.0f}/s), join {pre.join_s:.1f}s, lag {pre.lag_after}"
            )
        args.out.mkdir(parents=True, exist_ok=True)
        load = (load_start, os.getloadavg())
        text = report(runs, burst, pre, args, db, command.strip(), load, earlier)
        (args.out / "ingest.md").write_text(text)
        print(text)
    finally:
        if own_db and fx is not None:
            cleanup(fx)
        services.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
