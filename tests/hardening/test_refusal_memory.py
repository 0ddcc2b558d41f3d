"""The recently-refused memory (``GATEWAY_REFUSAL_MEMORY``) against a gateway process of
its own and a ``redis-server`` of the test's own (so that it can be stopped, and its command
counts are this gateway's alone): a remembered tenant fails open like every other tenant
when the limits store goes away, and what the memory saves is measured."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from emulator.testing import SpawnedEmulator
from gateway.errors import RateLimited
from gateway.serving.connections import RecentRefusals
from tests.gateway.conftest import VERSION, GatewayProcess, ReadModelSeeder, start_gateway
from tests.support import PrivateRedis

BODY = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def private_gateway(
    tmp_path: Path, store: PrivateRedis, replica: SpawnedEmulator
) -> Iterator[tuple[ReadModelSeeder, Callable[..., GatewayProcess]]]:
    client = redis.Redis.from_url(store.url)
    seeder = ReadModelSeeder(client)
    seeder.set_replicas([("r1", replica.base_url)])
    started: list[GatewayProcess] = []

    def start(**env: str) -> GatewayProcess:
        gw = start_gateway(tmp_path, store.url, None, extra_env=env)
        started.append(gw)
        return gw

    yield seeder, start
    for gw in started:
        gw.terminate(10)
    client.close()


def test_a_remembered_tenant_fails_open_when_the_limits_store_goes_away(
    private_gateway: tuple[ReadModelSeeder, Callable[..., GatewayProcess]], store: PrivateRedis
) -> None:
    seeder, start = private_gateway
    gw = start(GATEWAY_REFUSAL_MEMORY="1")
    tenant = seeder.tenant(rpm=1)
    auth = {"authorization": f"Bearer {tenant.secret}"}
    with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200
        refused = client.post("/v1/chat/completions", json=BODY)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 30
        store.stop()  # the limits store is gone; the key and tenant stay cached
        # Only this tenant sends, and it is remembered: nothing else would notice.
        time.sleep(1.2)
        during = client.post("/v1/chat/completions", json=BODY)
        assert during.status_code == 200, during.text  # requests/min fails open (§8)
        again = client.post("/v1/chat/completions", json=BODY)
        assert again.status_code == 200, again.text


def _evalsha_calls(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def test_what_the_memory_saves_for_a_refused_tenant(
    private_gateway: tuple[ReadModelSeeder, Callable[..., GatewayProcess]], store: PrivateRedis
) -> None:
    """A refused tenant sends 200 requests of ~200 KB each: with the memory, the body is not
    parsed or estimated and the store is asked about once a second instead of per request."""
    seeder, start = private_gateway
    big = {**BODY, "messages": [{"role": "user", "content": "word " * 40_000}]}
    figures = {}
    for memory in ("0", "1"):
        gw = start(GATEWAY_REFUSAL_MEMORY=memory)
        tenant = seeder.tenant(rpm=1, max_context=131_072)
        auth = {"authorization": f"Bearer {tenant.secret}"}
        with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
            first = client.post("/v1/chat/completions", json=BODY)
            assert first.status_code == 200, first.text
            before = _evalsha_calls(store.url)
            t0 = time.perf_counter()
            answers = [client.post("/v1/chat/completions", json=big) for _ in range(200)]
            elapsed = time.perf_counter() - t0
            calls = _evalsha_calls(store.url) - before
        assert all(a.status_code == 429 for a in answers), [a.text for a in answers[:3]]
        figures[memory] = (elapsed / 200 * 1000, calls)
        gw.terminate(10)
    off_ms, off_calls = figures["0"]
    on_ms, on_calls = figures["1"]
    print(
        f"refused 200 KB requests: memory off {off_ms:.2f} ms each, {off_calls} store calls; "
        f"memory on {on_ms:.2f} ms each, {on_calls} store calls"
    )
    assert off_calls >= 200  # one admit script per refused request
    assert on_calls <= off_calls // 10  # about one a second (the memory's trust window)
    assert on_ms < off_ms


def test_the_memory_lasts_until_the_limit_frees_not_the_jittered_retry_after() -> None:
    memory = RecentRefusals()
    refusal = RateLimited(
        "Rate limit reached", code="rate_limit_exceeded", type="requests",
        headers={"retry-after": "5", "retry-after-ms": "4500"},
    )  # fmt: skip
    refusal.frees_in_s = 0.2  # the bucket has a whole request again in 0.2 s
    memory.remember("t-1", VERSION, refusal)
    with pytest.raises(RateLimited) as repeated:
        memory.check("t-1", VERSION)
    assert 4 <= int(repeated.value.headers["retry-after-ms"]) / 1000 <= 4.5  # still jittered
    memory.check("t-2", VERSION)  # another tenant: not remembered
    time.sleep(0.25)
    memory.check("t-1", VERSION)  # the store would admit now: so does the memory
    # New limits for a tenant (a read-model change) forget its refusals at once.
    memory.remember("t-1", VERSION, refusal)
    memory.forget("t-1")
    memory.check("t-1", VERSION)
