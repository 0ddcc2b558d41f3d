"""A limits store that answers but refuses admission's writes is an outage for admission: it
degrades exactly as an unreachable store does (requests and tokens fail open, KV·seconds
fails closed), counts the error by kind and logs the change rate-limited; nothing reaches
the request as an error."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import redis

from emulator.testing import SpawnedEmulator
from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter, NullStats, QuotaRequest
from gateway.redis_client import connect
from tests.gateway.conftest import VERSION, ReadModelSeeder, start_gateway
from tests.support import PrivateRedis

BASE = QuotaRequest(
    "r",
    "t-open",
    "fam",
    "fam-v1",
    rpm=1,
    tpm=1000,
    est_tokens=100,
    est_kv_milli=1000,
    kv_cap_milli=8000,
    expected_ms=1000,
    is_retry=False,
    retry_exempt=False,
)


class Stats(NullStats):
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.opened: list[str] = []
        self.up: list[bool] = []

    def redis_up(self, up: bool) -> None:
        self.up.append(up)

    def fail_open(self, layer: str) -> None:
        self.opened.append(layer)

    def store_error(self, kind: str) -> None:
        self.errors.append(kind)


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, "--maxmemory-policy", "noeviction")
    yield server
    server.stop()


def fill(url: str) -> None:
    """Hold ~4 MB, then lower maxmemory to 1 MB: with nothing evictable, every write that may
    grow memory is refused (``OOM command not allowed``) until memory is freed."""
    client = redis.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    for i in range(8000):
        pipe.set(f"filler:{i}", "x" * 512)
    pipe.execute()
    client.config_set("maxmemory", "1mb")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", "x")
    client.close()


async def test_out_of_memory_degrades_like_an_outage_with_a_metric_and_few_log_lines(
    small_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect(small_redis.url, timeout_s=1)
    stats = Stats()
    # probe_interval 0: every call asks the store, the worst case for the log.
    lim = Limiter(client, AdmissionConfig(local_kv_fraction=0.25), stats=stats, probe_interval_s=0)
    empty = replace(BASE, tenant_id="t-empty")
    assert (await lim.admit(empty)).admitted  # its one request/min is spent: refusals next
    fill(small_redis.url)

    caplog.set_level(logging.WARNING, logger="fairway.gateway.limits")
    decisions = []
    for _ in range(10):
        # A refusal writes nothing, so the full store answers it (the store looks "up")...
        refused = await lim.admit(empty)
        assert not refused.admitted and refused.layer == "requests" and not refused.degraded
        # ...and an admission needs a write: OOM, decided locally, fail open on rpm.
        decisions.append(await lim.admit(BASE))
    assert all(d.admitted and d.degraded for d in decisions[:2])  # rpm 1, yet both pass
    assert "requests" in stats.opened
    # KV·seconds fails closed: 25 % of 8000 milli in this process, 1000 each.
    assert [d.admitted for d in decisions] == [True, True] + [False] * 8
    assert decisions[-1].layer == "kv_seconds"
    assert stats.errors == ["oom"] * 10 and False in stats.up
    flips = [r for r in caplog.records if "limits store" in r.getMessage()]
    assert 1 <= len(flips) <= 2, [r.getMessage() for r in flips]  # 19 changes, one line
    assert "oom" in flips[0].getMessage().lower()

    # Memory back: the next call is decided by the store again.
    redis.Redis.from_url(small_redis.url).config_set("maxmemory", "0")
    back = await lim.admit(replace(BASE, tenant_id="t-new"))
    assert back.admitted and not back.degraded and lim.redis_up
    await lim.aclose()
    await client.aclose()


def test_a_gateway_on_a_full_redis_serves_and_never_answers_500(
    small_redis: PrivateRedis, tmp_path: Path, replica: SpawnedEmulator
) -> None:
    """Through a gateway process: with Redis out of memory, requests are admitted (rates
    open), a request with an Idempotency-Key, whose claim cannot be written, gets 503
    ``config_store_unavailable``, nothing is a 500, and the log says so a few times, not
    per request."""
    seed = redis.Redis.from_url(small_redis.url)
    seeder = ReadModelSeeder(seed)
    seeder.set_replicas([("r1", replica.base_url)])
    tenant = seeder.tenant(rpm=2)
    gw = start_gateway(tmp_path, small_redis.url, None)
    try:
        body = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}]}
        auth = {"authorization": f"Bearer {tenant.secret}"}
        with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            fill(small_redis.url)
            plain = [client.post("/v1/chat/completions", json=body) for _ in range(4)]
            keyed = [
                client.post("/v1/chat/completions", json=body, headers={"idempotency-key": f"k{i}"})
                for i in range(20)
            ]
        assert [r.status_code for r in plain] == [200] * 4, [r.text for r in plain]  # rpm 2
        assert {r.status_code for r in keyed} == {503}
        assert {r.json()["error"]["code"] for r in keyed} == {"config_store_unavailable"}
        log = gw.log()
        assert log.count("limits store unavailable") == 1 and "oom" in log.lower()
        assert log.count("redis unavailable on the request path") == 1
    finally:
        gw.terminate(10)
        seed.close()
