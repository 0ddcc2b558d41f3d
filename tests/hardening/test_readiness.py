"""/readyz says what a balancer needs: not ready only when this process cannot serve
(draining, starting, no read model, no replica reachable). A Redis freeze or restart, a
full spool disk or a broker outage are degraded dependencies it serves through: reported
behind the metrics token and as gauges, never a 503 that would take every gateway sharing
the dependency out of the balancer at once. In process against a redis-server of the
test's own (frozen and restarted without touching the machine's shared one)."""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.faults import OwnRedis
from emulator.testing import SpawnedEmulator
from gateway.config import GatewayConfig
from gateway.serving.server import Gateway
from tests.gateway.conftest import ReadModelSeeder
from tests.support import free_port, wait_until_async

TOKEN = "m" * 40
OPERATOR = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def _seed(url: str, replicas: list[tuple[str, str]]) -> None:
    client = redis.Redis.from_url(url)
    ReadModelSeeder(client).set_replicas(replicas)
    client.close()


@asynccontextmanager
async def _gateway(
    tmp_path: Path, redis_url: str
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    config = GatewayConfig(
        redis_url=redis_url,
        spool_dir=tmp_path / "spool",
        instance_id=f"ready-{free_port()}",
        metrics_token=TOKEN,
    )
    gw = Gateway(config)
    app = gw.app()
    await gw.startup()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield gw, client
    finally:
        await gw.shutdown()
        gc.unfreeze()  # startup froze the collector's view of this (test) process


async def _until(
    client: httpx.AsyncClient, ok: Callable[[httpx.Response], bool], path: str = "/readyz"
) -> httpx.Response:
    async def answered() -> httpx.Response | None:
        response = await client.get(path, headers=OPERATOR)
        return response if ok(response) else None

    return await wait_until_async(answered, 10, 0.05, f"{path} to answer as expected")


def _gauge(name: str, value: float) -> Callable[[httpx.Response], bool]:
    return lambda response: f"{name} {value}" in response.text.splitlines()


def _redis(up: bool) -> Callable[[httpx.Response], bool]:
    return lambda response: response.json()["dependencies"]["redis"] is up


async def test_a_frozen_redis_is_reported_degraded_and_readiness_holds(
    tmp_path: Path, own_redis: OwnRedis, replica: SpawnedEmulator
) -> None:
    _seed(own_redis.url, [("r1", replica.base_url)])
    async with _gateway(tmp_path, own_redis.url) as (gw, client):
        ready = await client.get("/readyz", headers=OPERATOR)
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ready",
            "problems": [],
            "degraded": [],
            "dependencies": {"redis": True, "usage_spool_writable": True, "usage_broker": True},
        }
        own_redis.signal(signal.SIGSTOP)
        try:
            frozen = await _until(client, _redis(False))
            assert frozen.status_code == 200 and frozen.json()["problems"] == []
            (degraded,) = frozen.json()["degraded"]
            assert degraded.startswith("redis: ")
            # The balancer's view: ready, nothing more, answered at once (no Redis call).
            started = time.monotonic()
            public = await client.get("/readyz")
            assert time.monotonic() - started < 0.2
            assert (public.status_code, public.json()) == (200, {"status": "ready"})
            await _until(
                client, _gauge('fairway_gateway_redis_up{role="readmodel"}', 0.0), "/metrics"
            )
            metrics = (await client.get("/metrics", headers=OPERATOR)).text.splitlines()
            assert "fairway_gateway_ready 1.0" in metrics
        finally:
            own_redis.signal(signal.SIGCONT)
        await _until(client, _redis(True))
        await _until(client, _gauge('fairway_gateway_redis_up{role="readmodel"}', 1.0), "/metrics")

        gw.begin_drain()  # what does make it not ready: this process stops serving
        draining = await client.get("/readyz", headers=OPERATOR)
        assert draining.status_code == 503 and draining.json()["problems"] == ["draining"]
        assert (await client.get("/readyz")).json() == {"status": "not ready"}


async def test_a_redis_restart_keeps_the_catalog_and_the_replicas(
    tmp_path: Path, own_redis: OwnRedis, replica: SpawnedEmulator
) -> None:
    """After a restart the store is empty until the control plane rebuilds it: the process
    keeps its catalog (and its replicas' health) instead of dropping every replica."""
    _seed(own_redis.url, [("r1", replica.base_url)])
    async with _gateway(tmp_path, own_redis.url) as (gw, client):
        assert (await client.get("/readyz")).status_code == 200
        own_redis.kill()
        own_redis.start()  # same port, empty
        seen: list[Any] = []
        deadline = time.monotonic() + 6  # resubscription and version polls (1 s) happen
        while time.monotonic() < deadline:
            response = await client.get("/readyz", headers=OPERATOR)
            seen.append((response.status_code, response.json()["problems"]))
            await asyncio.sleep(0.1)
        assert gw.readmodel.subscribed  # it did reconnect (and reload) meanwhile
        assert {s for s, _ in seen} == {200}, [p for s, p in seen if s != 200][:3]
        assert gw.registry.any_healthy() and gw.readmodel.catalog.versions
        # The rebuild announces the catalog again; all is as before.
        _seed(own_redis.url, [("r1", replica.base_url)])
        await _until(client, lambda r: r.status_code == 200 and r.json()["degraded"] == [])


async def test_no_replica_reachable_is_not_ready(tmp_path: Path, own_redis: OwnRedis) -> None:
    _seed(own_redis.url, [("r1", f"http://127.0.0.1:{free_port()}")])  # nobody listens
    async with _gateway(tmp_path, own_redis.url) as (_, client):
        response = await client.get("/readyz", headers=OPERATOR)
        assert response.status_code == 503
        assert response.json()["problems"] == ["no replica reachable"]
        await _until(client, _gauge("fairway_gateway_ready", 0.0), "/metrics")
