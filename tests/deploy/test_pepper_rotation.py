"""Rotating FAIRWAY_KEY_PEPPER without cutting off existing keys: the gateway accepts keys
hashed under FAIRWAY_KEY_PEPPER_PREVIOUS until it is removed (docs/operations.md)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

from contracts import schema
from gateway.config import GatewayConfig
from gateway.errors import Unauthorized
from gateway.identity.auth import Authenticator, LastUsedRecorder
from gateway.identity.readmodel import ReadModelCache
from gateway.metrics import GatewayMetrics

OLD, NEW = b"old-pepper-" + b"o" * 24, b"new-pepper-" + b"n" * 24


@pytest.fixture
async def readmodel(redis_url: str, rdb: redis.Redis) -> AsyncIterator[ReadModelCache]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
    yield ReadModelCache(client, GatewayConfig(redis_url=redis_url), GatewayMetrics())
    await client.aclose()


def _key(rdb: redis.Redis, pepper: bytes, tenant_id: str) -> str:
    secret = schema.API_KEY_PREFIX + secrets.token_urlsafe(24)
    record = schema.KeyRecord(key_id="k-" + tenant_id, tenant_id=tenant_id, scopes=("chat",))
    rdb.set(schema.key_redis_key(schema.hash_api_key(secret, pepper)), schema.dumps(record))
    tenant = schema.TenantRecord(tenant_id, tenant_id, "standard", "standard", False)
    rdb.set(schema.tenant_redis_key(tenant_id), schema.dumps(tenant))
    rdb.set(schema.LOADED_KEY, "1")  # as the control plane's rebuild leaves it
    return secret


def _bearer(secret: str) -> bytes:
    return f"Bearer {secret}".encode()


async def test_keys_of_both_peppers_work_during_a_rotation(
    readmodel: ReadModelCache, rdb: redis.Redis, redis_url: str
) -> None:
    before = _key(rdb, OLD, "t-before")  # created before the rotation
    after = _key(rdb, NEW, "t-after")  # created after it
    recorder = LastUsedRecorder(readmodel._redis, 60)
    rotating = Authenticator(readmodel, NEW, recorder, previous_pepper=OLD)
    assert (await rotating.authenticate(_bearer(before), "chat")).tenant.tenant_id == "t-before"
    assert (await rotating.authenticate(_bearer(after), "chat")).tenant.tenant_id == "t-after"
    with pytest.raises(Unauthorized):
        await rotating.authenticate(_bearer(schema.API_KEY_PREFIX + "unknown"), "chat")
    # Once FAIRWAY_KEY_PEPPER_PREVIOUS is removed, only keys of the new pepper remain.
    done = Authenticator(readmodel, NEW, recorder)
    assert (await done.authenticate(_bearer(after), "chat")).tenant.tenant_id == "t-after"
    with pytest.raises(Unauthorized):
        await done.authenticate(_bearer(before), "chat")


def test_the_previous_pepper_is_read_from_the_environment() -> None:
    config = GatewayConfig.from_env(
        {"FAIRWAY_KEY_PEPPER": NEW.decode(), "FAIRWAY_KEY_PEPPER_PREVIOUS": OLD.decode()}
    )
    assert (config.key_pepper, config.key_pepper_previous) == (NEW, OLD)
    assert GatewayConfig.from_env({}).key_pepper_previous is None
