"""Fixtures for the admission tests: a flushed Redis DB (never FLUSHALL) per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from tests.support import flushed_redis


@pytest.fixture
def redis_sync(redis_url: str) -> Iterator[redis.Redis]:
    with flushed_redis(redis_url) as client:
        yield client


@pytest.fixture
async def aredis(redis_url: str, redis_sync: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    await client.aclose()
