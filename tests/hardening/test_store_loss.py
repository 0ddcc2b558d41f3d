"""A Redis restart or flush must not make every key look revoked: while the control plane's
loaded marker is absent the gateway answers unknown keys 503 (retry) instead of 401, keeps
serving keys it holds, and asks for a rebuild, which the control plane's beat task runs."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from contracts import keyformat, schema
from contracts.defaults import DEV_KEY_PEPPER
from gateway.config import GatewayConfig
from gateway.errors import Unauthorized, Unavailable
from gateway.identity.auth import Authenticator, LastUsedRecorder
from gateway.identity.readmodel import ReadModelCache
from gateway.metrics import GatewayMetrics
from tenants import services, tasks
from tenants.models import Tenant

PEPPER = DEV_KEY_PEPPER.encode()


@pytest.fixture
async def auth(redis_url: str, rdb: redis.Redis) -> AsyncIterator[Authenticator]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
    model = ReadModelCache(client, GatewayConfig(redis_url=redis_url), GatewayMetrics())
    yield Authenticator(model, PEPPER, LastUsedRecorder(client, 60))
    await client.aclose()


def _bearer(secret: str) -> bytes:
    return f"Bearer {secret}".encode()


async def test_after_a_flush_unknown_keys_are_told_to_retry_not_revoked(
    auth: Authenticator, rdb: redis.Redis
) -> None:
    secret = keyformat.mint()
    record = schema.KeyRecord(key_id="k-1", tenant_id="t-1", scopes=("chat",))
    rdb.set(schema.key_redis_key(schema.hash_api_key(secret, PEPPER)), schema.dumps(record))
    tenant = schema.TenantRecord("t-1", "t-1", "standard", "standard", False)
    rdb.set(schema.tenant_redis_key("t-1"), schema.dumps(tenant))
    rdb.set(schema.LOADED_KEY, "1")
    assert (await auth.authenticate(_bearer(secret), "chat")).tenant.tenant_id == "t-1"
    with pytest.raises(Unauthorized):  # loaded: an unknown key is revoked
        await auth.authenticate(_bearer(keyformat.mint()), "chat")

    rdb.flushdb()  # a Redis restart without persistence, or FLUSHALL

    with pytest.raises(Unavailable) as refused:
        await auth.authenticate(_bearer(keyformat.mint()), "chat")
    assert refused.value.status == 503 and int(refused.value.headers["retry-after"]) >= 1
    assert refused.value.code == "configuration_loading"
    # The key this process holds keeps working; a rebuild was asked for.
    assert (await auth.authenticate(_bearer(secret), "chat")).tenant.tenant_id == "t-1"
    assert rdb.exists(schema.REBUILD_REQUEST_KEY)


@pytest.mark.django_db
def test_the_beat_check_rebuilds_a_flushed_read_model(rm: Any, tenant_a: Tenant) -> None:
    _, secret = services.api_key_create(tenant=tenant_a, name="ci")
    tasks.readmodel_rebuild()
    assert rm.redis.exists(schema.LOADED_KEY)
    assert tasks.readmodel_check() == 0  # loaded, nothing asked: nothing to do
    key = schema.key_redis_key(schema.hash_api_key(secret, services.key_pepper()))
    assert rm.redis.exists(key)

    rm.redis.flushdb()
    tasks.readmodel_check()
    assert rm.redis.exists(key) and rm.redis.exists(schema.LOADED_KEY)

    # A gateway's request alone (the marker present) also triggers one, and is consumed.
    rm.redis.set(schema.REBUILD_REQUEST_KEY, "gw-" + secrets.token_hex(4))
    tasks.readmodel_check()
    assert not rm.redis.exists(schema.REBUILD_REQUEST_KEY)
