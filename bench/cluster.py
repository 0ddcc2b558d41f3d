"""Real processes for the loopback benchmarks: emulated replicas, gateways, the read model.

A ``Cluster`` starts ``python -m emulator`` replicas and ``python -m gateway`` processes,
seeds the gateway's read model straight into Redis with ``gateway.schema`` records (what
the control plane would push; no Django needed), scrapes the replicas' ``/metrics`` while a
run is going, and stops everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx
import redis

from emulator.profiles import Profile
from emulator.testing import SpawnedEmulator
from fairway.embedded import free_port
from gateway import schema
from gateway.config import DEV_KEY_PEPPER

ROOT = Path(__file__).resolve().parent.parent


def redis_url_with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


@contextlib.contextmanager
def bench_redis() -> Iterator[str]:
    """BENCH_REDIS_URL, else the machine's Redis (REDIS_URL or :6379) on DB 15 so that a
    bench never touches a dev stack's DB 0; with no Redis at all, an embedded one that is
    stopped on exit."""
    explicit = os.environ.get("BENCH_REDIS_URL")
    if explicit:
        yield explicit
        return
    from fairway.embedded import EmbeddedServices

    services = EmbeddedServices()
    try:
        yield redis_url_with_db(services.redis_url(), 15)
    finally:
        services.stop()


# -- the read model ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantSeed:
    record: schema.TenantRecord
    secret: str  # the API key the load generator presents

    @property
    def tenant_id(self) -> str:
        return self.record.tenant_id


def api_key_for(tenant_id: str) -> str:
    return f"{schema.API_KEY_PREFIX}bench-{tenant_id}"


def seed_read_model(
    client: redis.Redis, tenants: Iterable[TenantSeed], catalog: schema.Catalog
) -> None:
    """Write tenants, keys and the catalog as the control plane's push would."""
    pepper = DEV_KEY_PEPPER.encode()
    pipe = client.pipeline()
    for t in tenants:
        key_hash = schema.hash_api_key(t.secret, pepper)
        key = schema.KeyRecord(
            key_id=f"key-{t.tenant_id}", tenant_id=t.tenant_id, scopes=("chat", "models:read")
        )
        pipe.set(schema.key_redis_key(key_hash), schema.dumps(key))
        pipe.set(schema.tenant_redis_key(t.tenant_id), schema.dumps(t.record))
    pipe.set(schema.CATALOG_KEY, schema.dumps(catalog))
    pipe.incr(schema.VERSION_KEY)
    version = pipe.execute()[-1]
    change = schema.Change(kind="all", ident="", version=int(version))
    client.publish(schema.CHANGES_CHANNEL, schema.dumps(change))


# -- processes --------------------------------------------------------------------------


@dataclass(slots=True)
class Replica:
    replica_id: str
    pool: schema.Pool
    proc: SpawnedEmulator

    @property
    def base_url(self) -> str:
        return self.proc.base_url


@dataclass(slots=True)
class Gateway:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)


def write_profile_file(profiles: Sequence[Profile], directory: Path) -> Path:
    path = directory / "profiles.json"
    path.write_text(json.dumps([p.to_dict() for p in profiles]))
    return path


def start_replicas(
    profile: Profile,
    profile_file: Path,
    served_model: str,
    pools: Sequence[schema.Pool],
    speed: float,
    seed: int,
    extra: dict[str, object] | None = None,
) -> list[Replica]:
    """Start one emulator per pool entry, in parallel (each prints its URL when ready)."""
    procs = []
    for i, _pool in enumerate(pools):
        procs.append(
            SpawnedEmulator(
                profile.name,
                served_model,
                speed,
                extra_args=["--profile-file", str(profile_file)],
                seed=seed + i,
                log_level="error",
                ready_timeout=60.0,
                **(extra or {}),
            )
        )
    # Start them in parallel so their interpreter start-ups overlap.
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(max_workers=len(procs)) as pool_exec:
            list(pool_exec.map(lambda p: p.start(), procs))
    except BaseException:
        for p in procs:
            with contextlib.suppress(Exception):
                p.stop()
        raise
    return [Replica(f"r{i}", pool, p) for i, (p, pool) in enumerate(zip(procs, pools, strict=True))]


def stop_replicas(replicas: Iterable[Replica]) -> None:
    for r in replicas:
        with contextlib.suppress(Exception):
            r.proc.stop()


def start_gateway(
    redis_url: str, workers: int, env_extra: dict[str, str], workdir: Path, timeout: float = 60.0
) -> Gateway:
    port = free_port()
    env = dict(os.environ)
    env.update(
        {
            "REDIS_URL": redis_url,
            "FAIRWAY_ENV": "development",
            "GATEWAY_SPOOL_DIR": str(workdir / f"spool-{port}"),
            "GATEWAY_UPSTREAM_READ_TIMEOUT_S": "300",
        }
    )
    env.pop("KAFKA_BOOTSTRAP", None)  # usage events go to the fsync'd spool in benches
    env.update(env_extra)
    log_path = workdir / f"gateway-{port}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--port", str(port), "--workers", str(workers),
         "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    gw = Gateway(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(gw.base_url + "/readyz", timeout=1.0).status_code == 200:
                return gw
        time.sleep(0.2)
    gw.stop()
    raise RuntimeError(f"gateway not ready in {timeout:.0f} s: {log_path.read_text()[-2000:]}")


# -- metrics ----------------------------------------------------------------------------


def parse_metric(text: str, name: str) -> float | None:
    """Sum of the samples of one metric in Prometheus text (labels ignored)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
                found = True
    return total if found else None


@dataclass(slots=True)
class ReplicaTrace:
    t: list[float] = field(default_factory=list)  # model seconds since the arm started
    occupancy: list[float] = field(default_factory=list)
    preemptions: float = 0.0
    preemptions_at_start: float | None = None


class MetricsScraper:
    """Polls every replica's /metrics on the load generator's loop (KV occupancy, preemptions)."""

    def __init__(self, replicas: Sequence[Replica], speed: float, interval_s: float = 0.5) -> None:
        self.replicas = list(replicas)
        self.speed = speed
        self.interval_s = interval_s
        self.traces = {r.replica_id: ReplicaTrace() for r in self.replicas}
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                for r in self.replicas:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with session.get(r.base_url + "/metrics") as resp:
                            text = await resp.text()
                        tr = self.traces[r.replica_id]
                        occ = parse_metric(text, "vllm:kv_cache_usage_perc")
                        pre = parse_metric(text, "vllm:num_preemptions_total")
                        if occ is not None:
                            tr.t.append((loop.time() - t0) * self.speed)
                            tr.occupancy.append(occ)
                        if pre is not None:
                            if tr.preemptions_at_start is None:
                                tr.preemptions_at_start = pre
                            tr.preemptions = pre - tr.preemptions_at_start
                await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="fairway-bench-"))
