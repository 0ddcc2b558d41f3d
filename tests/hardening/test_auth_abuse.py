"""One client guessing keys must not cost the store or the process anything unbounded:
checksummed keys are refused offline, remembered-unknown keys are a bounded LRU, and an
address that keeps failing is answered 429 without a lookup. Real Redis throughout; the
client wrapper below only counts the GETs it forwards."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from contracts import keyformat, schema
from contracts.defaults import DEV_KEY_PEPPER
from gateway.config import GatewayConfig
from gateway.errors import RateLimited, Unauthorized
from gateway.identity.auth import Authenticator, FailureLimiter, LastUsedRecorder
from gateway.identity.readmodel import ReadModelCache
from gateway.metrics import GatewayMetrics

PEPPER = DEV_KEY_PEPPER.encode()


class CountingRedis(aioredis.Redis):
    gets = 0

    async def get(self, name: Any) -> Any:
        type(self).gets += 1
        return await super().get(name)


@pytest.fixture
async def client(redis_url: str, rdb: redis.Redis) -> AsyncIterator[CountingRedis]:
    CountingRedis.gets = 0
    rdb.set(schema.LOADED_KEY, "1")  # as the control plane's rebuild leaves it
    conn = CountingRedis.from_url(redis_url, socket_timeout=2)
    assert isinstance(conn, CountingRedis)
    yield conn
    await conn.aclose()


def _auth(
    conn: aioredis.Redis, config: GatewayConfig, *, burst: int = 1000
) -> tuple[Authenticator, ReadModelCache]:
    model = ReadModelCache(conn, config, GatewayMetrics())
    auth = Authenticator(
        model,
        PEPPER,
        LastUsedRecorder(conn, 60),
        failures=FailureLimiter(burst, 0.001, 100),
        legacy_keys=config.legacy_api_keys,
    )
    return auth, model


def _seed(rdb: redis.Redis, secret: str, tenant_id: str) -> None:
    record = schema.KeyRecord(key_id="k-" + tenant_id, tenant_id=tenant_id, scopes=("chat",))
    rdb.set(schema.key_redis_key(schema.hash_api_key(secret, PEPPER)), schema.dumps(record))
    tenant = schema.TenantRecord(tenant_id, tenant_id, "standard", "standard", False)
    rdb.set(schema.tenant_redis_key(tenant_id), schema.dumps(tenant))


def _bearer(secret: str) -> bytes:
    return f"Bearer {secret}".encode()


def test_minted_keys_carry_a_checksum_and_a_typo_breaks_it() -> None:
    secret = keyformat.mint()
    assert secret.startswith("fw-") and len(secret) == keyformat.CHECKSUMMED_LEN
    assert keyformat.classify(secret) == "checksummed"
    body = secret[len(keyformat.CHECKSUM_PREFIX) :]
    typo = keyformat.CHECKSUM_PREFIX + ("A" if body[0] != "A" else "B") + body[1:]
    assert keyformat.classify(typo) == "malformed"
    # Keys minted before the checksum are still looked up, unless that is turned off.
    legacy = "fw-" + secrets.token_urlsafe(32)
    assert keyformat.classify(legacy) == "legacy"
    assert keyformat.classify(legacy, legacy_allowed=False) == "malformed"
    assert keyformat.classify("fw-has spaces") == "malformed"


async def test_checksummed_keys_authenticate_and_forged_ones_never_reach_the_store(
    client: CountingRedis, rdb: redis.Redis, redis_url: str
) -> None:
    auth, _ = _auth(client, GatewayConfig(redis_url=redis_url))
    good = keyformat.mint()
    _seed(rdb, good, "t-good")
    assert (await auth.authenticate(_bearer(good), "chat")).tenant.tenant_id == "t-good"
    before = CountingRedis.gets
    for _ in range(200):
        forged = keyformat.CHECKSUM_PREFIX + secrets.token_urlsafe(32) + "AAAAAA"
        with pytest.raises(Unauthorized):
            await auth.authenticate(_bearer(forged), "chat", "198.51.100.7")
    assert CountingRedis.gets == before


async def test_unknown_keys_are_remembered_in_a_bounded_lru(
    client: CountingRedis, redis_url: str
) -> None:
    config = GatewayConfig(redis_url=redis_url, auth_negative_cache_max=50)
    auth, model = _auth(client, config)
    for i in range(500):
        with pytest.raises(Unauthorized):
            # Legacy-shaped, so each is looked up; from many addresses (no limiter).
            await auth.authenticate(_bearer("fw-" + secrets.token_urlsafe(32)), "chat", f"a{i}")
    held = len(model._keys.entries) + len(getattr(model._keys, "negative", {}))
    assert held <= 50


async def test_an_address_that_keeps_failing_gets_429_without_lookups(
    client: CountingRedis, rdb: redis.Redis, redis_url: str
) -> None:
    auth, _ = _auth(client, GatewayConfig(redis_url=redis_url), burst=5)
    good = keyformat.mint()
    _seed(rdb, good, "t-nat")
    # A tenant behind the same address, already authenticated once (cached in process).
    assert (await auth.authenticate(_bearer(good), "chat", "203.0.113.9")).tenant
    for _ in range(5):
        with pytest.raises(Unauthorized):
            await auth.authenticate(
                _bearer("fw-" + secrets.token_urlsafe(32)), "chat", "203.0.113.9"
            )
    before = CountingRedis.gets
    for _ in range(100):
        with pytest.raises(RateLimited) as refused:
            await auth.authenticate(
                _bearer("fw-" + secrets.token_urlsafe(32)), "chat", "203.0.113.9"
            )
    assert CountingRedis.gets == before
    assert refused.value.status == 429 and int(refused.value.headers["retry-after"]) >= 1
    # The cached tenant key keeps working; another address is unaffected.
    assert (await auth.authenticate(_bearer(good), "chat", "203.0.113.9")).tenant
    with pytest.raises(Unauthorized):
        await auth.authenticate(_bearer("fw-" + secrets.token_urlsafe(32)), "chat", "192.0.2.1")


async def test_concurrent_guesses_from_one_address_reach_the_store_at_most_burst_times(
    client: CountingRedis, rdb: redis.Redis, redis_url: str
) -> None:
    """The budget holds for requests in flight together: each lookup reserves its token
    before the read (charged after it, all 40 would pass the check and read)."""
    auth, _ = _auth(client, GatewayConfig(redis_url=redis_url), burst=5)
    good = keyformat.mint()
    _seed(rdb, good, "t-burst")

    async def guess() -> int:
        try:
            await auth.authenticate(_bearer(keyformat.mint()), "chat", "198.51.100.7")
        except Unauthorized:
            return 401
        except RateLimited:
            return 429
        return 200

    answers = await asyncio.gather(*(guess() for _ in range(40)))
    assert sorted(set(answers)) == [401, 429] and answers.count(401) == 5
    assert CountingRedis.gets == 5
    # A good key from a fresh address reserves and gives its token back: never refused.
    for _ in range(10):
        assert (await auth.authenticate(_bearer(good), "chat", "198.51.100.8")).tenant
    # Thirty good cold keys together from one address (a customer behind one NAT): the
    # ones past the budget wait for the lookups in flight, which give their tokens back.
    goods = [keyformat.mint() for _ in range(30)]
    for i, secret in enumerate(goods):
        _seed(rdb, secret, f"t-nat{i}")
    principals = await asyncio.gather(
        *(auth.authenticate(_bearer(s), "chat", "198.51.100.9") for s in goods)
    )
    assert sorted(p.tenant.tenant_id for p in principals) == sorted(f"t-nat{i}" for i in range(30))


def test_the_failure_map_is_bounded() -> None:
    limiter = FailureLimiter(3, 1.0, 100)
    for i in range(10_000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter) == 100
