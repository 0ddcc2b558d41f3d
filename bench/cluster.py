"""Real processes for the loopback benchmarks: emulated replicas, gateways, the read model.

A ``Cluster`` starts ``python -m emulator`` replicas and ``python -m gateway`` processes,
seeds the gateway's read model straight into Redis with ``contracts.schema`` records (what
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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx
import redis

from bench.prom_parse import metric_sums
from contracts import schema
from contracts.readmodel_writer import ReadModelWriter
from contracts.replica_flags import platform_replica_args
from emulator.profiles import Profile
from emulator.testing import SpawnedEmulator
from fairway.embedded import free_port

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
    seeds = list(tenants)
    keys = [
        (
            t.secret,
            schema.KeyRecord(
                key_id=f"key-{t.tenant_id}", tenant_id=t.tenant_id, scopes=("chat", "models:read")
            ),
        )
        for t in seeds
    ]
    ReadModelWriter(client).put_all(keys, [t.record for t in seeds], catalog)


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
    extra: dict[str, Any] | None = None,  # more SpawnedEmulator options
    omit_platform_flags: Sequence[str] = (),
    request_log_dir: Path | None = None,
) -> list[Replica]:
    """Start one emulator per pool entry, in parallel (each prints its URL when ready), with
    the platform's replica flags (``contracts.replica_flags``) less ``omit_platform_flags``;
    with ``request_log_dir``, replica ``r<i>`` logs its finished requests to
    ``r<i>.jsonl`` there (the emulator's ``--request-log``)."""
    procs = []
    for i, _pool in enumerate(pools):
        log_args = (
            ["--request-log", str(request_log_dir / f"r{i}.jsonl")] if request_log_dir else []
        )
        procs.append(
            SpawnedEmulator(
                profile.name,
                served_model,
                speed,
                extra_args=[
                    "--profile-file",
                    str(profile_file),
                    *platform_replica_args(omit=omit_platform_flags),
                    *log_args,
                ],
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
    redis_url: str,
    workers: int,
    env_extra: dict[str, str],
    workdir: Path,
    timeout: float = 60.0,
    root: Path = ROOT,
    python_args: Sequence[str] = (),
) -> Gateway:
    """``python -m gateway`` from the checkout at ``root`` (another commit's, to compare);
    ``python_args`` go before ``-m gateway`` (``-m cProfile -o FILE`` to profile it)."""
    port = free_port()
    env = dict(os.environ)
    if root != ROOT:
        env["PYTHONPATH"] = str(root)
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
        [sys.executable, *python_args, "-m", "gateway", "--port", str(port), "--workers",
         str(workers), "--log-level", "warning"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
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


@dataclass(frozen=True, slots=True)
class Checkout:
    """Another commit's tree (``git worktree add --detach DIR SHA``) whose gateway runs beside
    this one's, to compare the two in one sitting: its own code (``PYTHONPATH``), its own
    Redis DB, and a read model written by its own ``bench.gateway_overhead.seed`` (the
    contract's records may differ between the two commits)."""

    root: Path
    redis_url: str
    key: str  # the API key its seed wrote

    @classmethod
    def seeded(
        cls, root: Path, redis_url: str, replica_url: str, db: int = 1, tools: bool = False
    ) -> Checkout:
        own = redis_url_with_db(redis_url, db)
        code = (
            "import sys; from bench.gateway_overhead import seed; "
            "print(seed(*sys.argv[1:3], *([True] if sys.argv[3:] else [])))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, own, replica_url, *(["tools"] if tools else [])],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"seeding the read model of {root} failed: {done.stderr[-2000:]}")
        return cls(root, own, done.stdout.strip().splitlines()[-1])

    def start_gateway(
        self,
        workers: int,
        env_extra: dict[str, str],
        workdir: Path,
        python_args: Sequence[str] = (),
    ) -> Gateway:
        return start_gateway(
            self.redis_url, workers, env_extra, workdir, root=self.root, python_args=python_args
        )


def describe_tree(root: Path) -> str:
    """``<short sha> <subject>`` of the checkout's HEAD, "+ uncommitted changes" if any."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("log", "-1", "--format=%h %s")
    if not head:
        return str(root)
    if len(head) > 60:
        head = head[:60].rsplit(" ", 1)[0] + " …"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + (" + uncommitted changes" if dirty else "")


# -- metrics ----------------------------------------------------------------------------


@dataclass(slots=True)
class ReplicaTrace:
    t: list[float] = field(default_factory=list)  # model seconds since the arm started
    occupancy: list[float] = field(default_factory=list)
    # vllm:num_requests_running + _waiting at each sample (the decode batch and its queue)
    batch: list[float] = field(default_factory=list)
    preemptions: float = 0.0
    preemptions_at_start: float | None = None
    # vllm:request_success_total at the last sample: requests the replica finished (the
    # benches start fresh replicas per arm)
    finished: float = 0.0
    # Model seconds the replica skipped because the box could not keep its pace (CPU-bound):
    # latencies measured while it lagged are inflated by about this much.
    clock_lag_s: float = 0.0
    clock_lag_at_start: float | None = None


class MetricsScraper:
    """Polls every replica's /metrics on the load generator's loop (KV occupancy, running +
    waiting requests, finished requests, preemptions)."""

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
                        sums = metric_sums(text)
                        occ = sums.get("vllm:kv_cache_usage_perc")
                        pre = sums.get("vllm:num_preemptions_total")
                        lag = sums.get("emulator_clock_lag_seconds_total")
                        if lag is not None:
                            if tr.clock_lag_at_start is None:
                                tr.clock_lag_at_start = lag
                            tr.clock_lag_s = lag - tr.clock_lag_at_start
                        if occ is not None:
                            tr.t.append((loop.time() - t0) * self.speed)
                            tr.occupancy.append(occ)
                            tr.batch.append(
                                sums.get("vllm:num_requests_running", 0.0)
                                + sums.get("vllm:num_requests_waiting", 0.0)
                            )
                        tr.finished = sums.get("vllm:request_success_total", tr.finished)
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
