"""Fixtures for the admission tests: a flushed Redis DB (never FLUSHALL) per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis


@pytest.fixture
def redis_sync(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
async def aredis(redis_url: str, redis_sync: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    await client.aclose()
