"""gateway/admission/scriptchannel.py against real Redis servers: the shared test Redis for the
ordinary paths, private ``redis-server`` processes for what must not touch a shared one
(SCRIPT FLUSH, a password, a server frozen with SIGSTOP)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter
from gateway.admission.scriptchannel import LuaScript, ScriptChannel, pack
from gateway.redis_client import connect
from tests.support import PrivateRedis, free_port, wait_until_async

ECHO = LuaScript.of("redis.call('INCR', KEYS[1]); return {ARGV[1], tonumber(ARGV[2]) * 2}")
FAILS = LuaScript.of("return redis.error_reply('ERR deliberately refused')")


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    yield server
    server.stop()


def test_pack_is_resp2() -> None:
    assert pack(b"SET", "k", 12, 0.5) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$3\r\n0.5\r\n"
    assert pack("é") == b"*1\r\n$2\r\n\xc3\xa9\r\n"


async def test_concurrent_calls_get_their_own_replies_in_the_selected_db(
    redis_url: str, redis_sync: redis.Redis
) -> None:
    client = connect(redis_url, timeout_s=5)
    channel = ScriptChannel.for_client(client)
    assert channel is not None
    results = await asyncio.gather(
        *(channel.evalsha(ECHO, ["fw:test:count"], [f"caller-{i}", i]) for i in range(300))
    )
    assert results == [[f"caller-{i}".encode(), 2 * i] for i in range(300)]
    # the channel SELECTed the URL's database: the counter is there, for the test client
    assert int(redis_sync.get("fw:test:count") or 0) == 300
    many = await channel.evalsha_many(ECHO, [(["fw:test:count"], [b"x", n]) for n in range(5)])
    assert many == [[b"x", 2 * n] for n in range(5)]
    await channel.aclose()
    await client.aclose()


async def test_error_reply_raises_and_the_channel_stays_in_step(
    redis_url: str, redis_sync: redis.Redis
) -> None:
    channel = ScriptChannel.for_client(connect(redis_url, timeout_s=5))
    assert channel is not None
    outcome = await asyncio.gather(
        channel.evalsha(ECHO, ["fw:test:a"], ["before", 1]),
        channel.evalsha(FAILS, [], []),
        channel.evalsha(ECHO, ["fw:test:a"], ["after", 2]),
        return_exceptions=True,
    )
    assert outcome[0] == [b"before", 2] and outcome[2] == [b"after", 4]
    assert isinstance(outcome[1], ResponseError) and "deliberately" in str(outcome[1])
    await channel.aclose()


def awaiting_replies(channel: ScriptChannel) -> int:
    """Calls sent on the channel's connection and not yet answered (its own queue)."""
    return len(channel._protocol.pending) if channel._protocol is not None else 0


async def test_cancelled_caller_does_not_shift_the_replies(
    redis_url: str, redis_sync: redis.Redis
) -> None:
    channel = ScriptChannel.for_client(connect(redis_url, timeout_s=5))
    assert channel is not None
    await channel.call(b"PING")  # connected
    slow = asyncio.ensure_future(channel.call(b"BLPOP", b"fw:test:never", b"0.2"))
    await wait_until_async(lambda: awaiting_replies(channel), 2, 0.001, "the BLPOP sent")
    slow.cancel()
    # replies after the abandoned one still reach their own callers
    assert await channel.evalsha(ECHO, ["fw:test:b"], ["mine", 3]) == [b"mine", 6]
    assert await channel.call(b"ECHO", b"last") == b"last"
    await channel.aclose()


async def test_unknown_script_is_loaded_after_a_flush(private: PrivateRedis) -> None:
    url = f"redis://127.0.0.1:{private.port}/0"
    channel = ScriptChannel.for_client(connect(url, timeout_s=5))
    assert channel is not None
    assert await channel.evalsha(ECHO, ["k"], ["one", 1]) == [b"one", 2]
    await channel.call(b"SCRIPT", b"FLUSH")  # e.g. a restarted Redis
    assert await channel.evalsha(ECHO, ["k"], ["two", 2]) == [b"two", 4]
    await channel.call(b"SCRIPT", b"FLUSH")
    assert await channel.evalsha_many(ECHO, [(["k"], ["three", 3])]) == [[b"three", 6]]
    await channel.aclose()


async def test_password_is_sent_and_a_wrong_one_refused(tmp_path: Path) -> None:
    server = PrivateRedis(tmp_path, "--requirepass", "s3cret")
    try:
        good = ScriptChannel.for_client(
            connect(f"redis://:s3cret@127.0.0.1:{server.port}/3", timeout_s=5)
        )
        assert good is not None
        assert await good.evalsha(ECHO, ["k"], ["ok", 5]) == [b"ok", 10]
        await good.aclose()
        bad = ScriptChannel.for_client(
            connect(f"redis://:wrong@127.0.0.1:{server.port}/0", timeout_s=5)
        )
        assert bad is not None
        with pytest.raises(AuthenticationError):
            await bad.call(b"PING")
        await bad.aclose()
    finally:
        server.stop()


async def test_unreachable_and_frozen_store_fail_fast_then_recover(
    private: PrivateRedis,
) -> None:
    dead = ScriptChannel(port=free_port(), timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(RedisConnectionError):
        await dead.call(b"PING")
    assert time.monotonic() - started < 5  # generous: refused connections fail at once

    channel = ScriptChannel(port=private.port, timeout_s=0.3)
    assert await channel.call(b"PING") == b"PONG"
    os.kill(private.proc.pid, signal.SIGSTOP)  # the store stops answering
    try:
        started = time.monotonic()
        outcome = await asyncio.gather(
            *(channel.evalsha(ECHO, ["k"], ["x", i]) for i in range(20)), return_exceptions=True
        )
        assert all(isinstance(o, RedisTimeoutError) for o in outcome), outcome
        assert time.monotonic() - started < 5  # bounded by the 0.3 s timeout, not retries
    finally:
        os.kill(private.proc.pid, signal.SIGCONT)
    # a fresh connection once the store answers again

    async def answers() -> bool:
        try:
            return await channel.evalsha(ECHO, ["k"], ["back", 7]) == [b"back", 14]
        except (RedisConnectionError, RedisTimeoutError):
            return False

    await wait_until_async(answers, 10, 0.1, "the channel to recover")
    await channel.aclose()


def test_tls_and_plain_clients() -> None:
    # TLS is spoken by the channel too (tests/hardening/test_redis_tls.py).
    assert ScriptChannel.for_client(aioredis.Redis.from_url("rediss://127.0.0.1:1/0")) is not None
    unix = ScriptChannel.for_client(aioredis.Redis.from_url("unix:///tmp/redis.sock?db=2"))
    assert unix is not None


class _OwnConnection(aioredis.Connection):
    """A connection class of its own: no URL makes one."""


def test_an_unknown_connection_class_is_refused_not_sent_elsewhere() -> None:
    # The channel is admission's one path (no redis-py script fallback beside it): a client
    # it cannot speak for is refused when the limiter is built, not degraded at run time.
    client = aioredis.Redis(
        connection_pool=aioredis.ConnectionPool(connection_class=_OwnConnection)
    )
    with pytest.raises(ValueError, match="_OwnConnection"):
        ScriptChannel.for_client(client)
    with pytest.raises(ValueError, match="_OwnConnection"):
        Limiter(client, AdmissionConfig())
