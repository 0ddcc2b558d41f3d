"""The in-process read model against real Redis: caching, invalidation, resubscription."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from contracts import schema
from gateway.config import GatewayConfig
from gateway.identity.readmodel import ReadModelCache, _Cache
from gateway.metrics import GatewayMetrics
from tests.gateway.conftest import ReadModelSeeder
from tests.support import wait_until_async


@pytest.fixture
async def readmodel(redis_url: str, rdb: redis.Redis) -> AsyncIterator[tuple[ReadModelCache, str]]:
    name = "gw-test-" + secrets.token_hex(4)
    client = aioredis.Redis.from_url(redis_url, client_name=name, socket_timeout=2)
    model = ReadModelCache(client, GatewayConfig(redis_url=redis_url), GatewayMetrics())
    await model.start()
    await wait_until_async(lambda: model.subscribed, 5, 0.01, "the read model subscribed")
    yield model, name
    await model.stop()
    await client.aclose()


async def test_revoked_key_refused_within_one_second(
    readmodel: tuple[ReadModelCache, str], seeder: ReadModelSeeder
) -> None:
    model, _ = readmodel
    tenant = seeder.tenant()
    await _caught_up(model, seeder.client)
    key = await model.key(tenant.key_hash)
    assert key is not None and key.tenant_id == tenant.tenant_id
    assert (await model.tenant(tenant.tenant_id)) is not None
    # Cached: deleting the record without an announcement is not seen...
    seeder.client.delete(schema.key_redis_key(tenant.key_hash))
    assert await model.key(tenant.key_hash) == key
    # ...the control plane's announcement drops it at once.
    seeder.revoke(tenant)
    started = time.monotonic()
    await wait_until_async(lambda: _is_none(model.key(tenant.key_hash)), 1.0, 0.005)
    assert time.monotonic() - started < 1.0


async def _caught_up(model: ReadModelCache, rdb: redis.Redis) -> None:
    """Wait until the announcements made so far have reached the model."""
    target = int(rdb.get(schema.VERSION_KEY) or 0)

    await wait_until_async(lambda: model.version >= target, 2.0, 0.005, f"version {target}")


async def _is_none(pending: Awaitable[object]) -> bool:
    return (await pending) is None


async def test_catalog_change_reloads_and_tenant_change_drops(
    readmodel: tuple[ReadModelCache, str], seeder: ReadModelSeeder
) -> None:
    model, _ = readmodel
    seeder.set_replicas([("a", "http://127.0.0.1:9")], version="fam-x-1", family="fam-x")
    await wait_until_async(lambda: _resolves(model, "fam-x", "fam-x-1"), 1.0, 0.005)
    seeder.set_replicas([("a", "http://127.0.0.1:9")], version="fam-x-2", family="fam-x")
    await wait_until_async(lambda: _resolves(model, "fam-x", "fam-x-2"), 1.0, 0.005)
    # A pinned version keeps its weights while the alias moves on.
    assert model.catalog.resolve("fam-x-1") is not None
    assert model.catalog.resolve("fam-x-1").version == "fam-x-1"  # type: ignore[union-attr]

    tenant = seeder.tenant()
    await _caught_up(model, seeder.client)
    record = await model.tenant(tenant.tenant_id)
    assert record is not None and not record.suspended
    seeder.client.set(
        schema.tenant_redis_key(tenant.tenant_id),
        schema.dumps(
            schema.TenantRecord(
                tenant_id=tenant.tenant_id,
                name="x",
                plan="standard",
                admission_class="standard",
                suspended=True,
            )
        ),
    )
    seeder._announce("tenant", tenant.tenant_id)
    await wait_until_async(lambda: _suspended(model, tenant.tenant_id), 1.0, 0.005)


async def _resolves(model: ReadModelCache, alias: str, version: str) -> bool:
    resolved = model.catalog.resolve(alias)
    return resolved is not None and resolved.version == version


async def _suspended(model: ReadModelCache, tenant_id: str) -> bool:
    record = await model.tenant(tenant_id)
    return record is not None and record.suspended


async def test_lost_subscription_drops_cache_on_resubscribe(
    readmodel: tuple[ReadModelCache, str], seeder: ReadModelSeeder, rdb: redis.Redis
) -> None:
    model, name = readmodel
    tenant = seeder.tenant()
    await _caught_up(model, rdb)
    assert await model.key(tenant.key_hash) is not None
    # Kill only this test's pub/sub connection (other suites share the Redis server).
    victims = [
        c["id"] for c in rdb.client_list() if c.get("name") == name and int(c.get("sub", 0)) > 0
    ]
    assert victims
    for client_id in victims:
        rdb.client_kill_filter(_id=client_id)
    # The revocation happens while nobody listens: no message reaches this gateway.
    rdb.delete(schema.key_redis_key(tenant.key_hash))
    rdb.incr(schema.VERSION_KEY)
    await wait_until_async(lambda: _is_none(model.key(tenant.key_hash)), 2.5, 0.005)


def test_stale_read_is_not_stored_after_an_invalidation() -> None:
    cache: _Cache[str] = _Cache()
    epoch = cache.epoch  # a lookup starts...
    cache.drop("k")  # ...the key is revoked meanwhile...
    cache.put("k", "old record", time.monotonic() + 30, epoch)  # ...its read lands late
    assert cache.get("k", time.monotonic()) == (False, None)


class CountingRedis(aioredis.Redis):
    """The real client, counting the reads the read model makes."""

    gets = 0

    async def get(self, name: Any) -> Any:
        CountingRedis.gets += 1
        return await super().get(name)


async def test_concurrent_misses_share_one_read_unless_invalidated_meanwhile(
    redis_url: str, seeder: ReadModelSeeder
) -> None:
    tenant = seeder.tenant()
    client = CountingRedis.from_url(redis_url, socket_timeout=2)
    model = ReadModelCache(client, GatewayConfig(redis_url=redis_url), GatewayMetrics())
    try:
        CountingRedis.gets = 0
        keys = await asyncio.gather(*(model.key(tenant.key_hash) for _ in range(200)))
        assert all(k is not None and k.tenant_id == tenant.tenant_id for k in keys)
        assert CountingRedis.gets == 1
        # A lookup that starts after an invalidation must not join a read begun before it
        # (that read may return what was just revoked).
        model.invalidate_all()
        CountingRedis.gets = 0
        first = asyncio.ensure_future(model.key(tenant.key_hash))
        # the first read is in flight
        await wait_until_async(lambda: CountingRedis.gets == 1, 2, 0)
        model.invalidate_all()
        second = await model.key(tenant.key_hash)
        assert (await first) is not None and second is not None
        assert CountingRedis.gets == 2
    finally:
        await client.aclose()
