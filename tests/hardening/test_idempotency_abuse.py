"""Idempotency records must not be a way around the quota: a refused claim keeps only a
brief tombstone, and each tenant's records and stored bytes are capped in the same atomic
call that claims. Real Redis; one real gateway process for the refused-claim path."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from emulator.testing import SpawnedEmulator
from gateway.admission.config import AdmissionConfig
from gateway.admission.idempotency import KIND_JSON, Claim, IdempotencyStore
from gateway.admission.quota import Limiter
from gateway.errors import RateLimited
from tests.gateway.conftest import VERSION, GatewayProcess, ReadModelSeeder
from tests.support import wait_until

BODY = b'{"model": "m", "messages": []}'


@pytest.fixture
async def aredis(redis_url: str, rdb: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
    yield client
    await client.aclose()


async def test_a_tenant_cannot_claim_more_than_its_record_budget(
    aredis: aioredis.Redis, rdb: redis.Redis
) -> None:
    store = IdempotencyStore(aredis, 3600, 60, max_records=5)
    tenant = "t-" + secrets.token_hex(4)
    for _ in range(5):
        assert isinstance(await store.begin(tenant, secrets.token_hex(8), BODY), Claim)
    with pytest.raises(RateLimited) as refused:
        await store.begin(tenant, secrets.token_hex(8), BODY)
    assert refused.value.code == "idempotency_quota_exceeded"
    assert int(refused.value.headers["retry-after"]) > 0
    # Nothing was written for the refused key; another tenant is unaffected.
    assert len(list(rdb.scan_iter(match=f"fw:idem:*{tenant}*:[0-9a-f]*", count=1000))) == 5
    assert isinstance(await store.begin("t-other-" + tenant, "k", BODY), Claim)


async def test_responses_past_the_byte_budget_are_not_kept(
    aredis: aioredis.Redis, rdb: redis.Redis
) -> None:
    store = IdempotencyStore(aredis, 3600, 60, max_bytes=4000)
    tenant = "t-" + secrets.token_hex(4)
    small = await store.begin(tenant, "small", BODY)
    assert isinstance(small, Claim)
    assert await store.complete(small, KIND_JSON, b"x" * 100)
    big = await store.begin(tenant, "big", BODY)
    assert isinstance(big, Claim)
    # Random bytes do not compress: well past the remaining budget.
    assert not await store.complete(big, KIND_JSON, secrets.token_bytes(8000))
    assert rdb.hget(big.redis_key, "resp") is None
    # The over-budget key is a tombstone: a retry generates again (is_retry), no replay.
    again = await store.begin(tenant, "big", BODY)
    assert isinstance(again, Claim) and again.is_retry


def test_a_refused_claim_leaves_only_a_brief_tombstone(
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
    rdb: redis.Redis,
) -> None:
    seeder.set_replicas([("r1", replica.base_url)])
    # The claim path itself: with the refusal memory these requests are refused before it.
    gw = gateways(None, extra_env={"GATEWAY_REFUSAL_MEMORY": "0"})
    tenant = seeder.tenant(rpm=1)
    body = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    auth = {"authorization": f"Bearer {tenant.secret}"}
    with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        keys = [secrets.token_hex(8) for _ in range(5)]
        for key in keys:
            refused = client.post(
                "/v1/chat/completions", json=body, headers={"idempotency-key": key}
            )
            assert refused.status_code == 429, refused.text
    records = [IdempotencyStore.redis_key(tenant.tenant_id, key) for key in keys]
    # Every refusal came from admission, after the claim: the tombstones are written off
    # the request path, and kept briefly.
    wait_until(lambda: all(rdb.hget(r, "state") == b"failed" for r in records), timeout=10)
    assert all(0 < rdb.ttl(r) <= 60 for r in records), [rdb.ttl(r) for r in records]


def test_replays_cost_one_request_per_minute_each_and_no_tokens(
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
) -> None:
    """A client hammering one stored response gets it while its requests/min lasts, then the
    same 429 as any request: a replay is one request of requests/min (nothing generated, so
    no tokens and no KV)."""
    seeder.set_replicas([("r1", replica.base_url)])
    gw = gateways(None, extra_env={"GATEWAY_REFUSAL_MEMORY": "0"})
    tenant = seeder.tenant(rpm=4)
    body = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {tenant.secret}", "idempotency-key": "same"}
    with httpx.Client(base_url=gw.base_url, headers=headers, timeout=30) as client:
        first = client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200 and "idempotent-replayed" not in first.headers
        replays = [client.post("/v1/chat/completions", json=body) for _ in range(5)]
    assert [r.status_code for r in replays] == [200, 200, 200, 429, 429], [r.text for r in replays]
    assert all(r.headers.get("idempotent-replayed") == "true" for r in replays[:3])
    assert replays[0].content == first.content  # the stored response, byte for byte
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replays[:3]] == ["2", "1", "0"]
    refused = replays[3].json()["error"]
    assert refused["code"] == "rate_limit_exceeded" and refused["type"] == "requests"
    assert int(replays[3].headers["retry-after"]) >= 1


async def test_a_replay_is_charged_to_its_api_keys_own_requests_per_minute(
    aredis: aioredis.Redis,
) -> None:
    """A key with its own requests/min (per-key limits) pays for replays from it too; the
    refusal names the key, and the tenant's bucket is not charged for the refused one."""
    lim = Limiter(aredis, AdmissionConfig())
    charge = [
        await lim.charge_request("t-1", "fam", 100, key_id="k-1", key_rpm=2) for _ in range(3)
    ]
    assert [d.admitted for d in charge] == [True, True, False]
    assert charge[2].key_limited and charge[2].layer == "requests"
    assert 25_000 <= charge[2].frees_in_ms <= 30_000  # a whole request back at 2/min
    assert [d.state.remaining_requests for d in charge[:2]] == [99, 98]
    # Another key of the tenant is not limited by k-1's bucket.
    assert (await lim.charge_request("t-1", "fam", 100, key_id="k-2", key_rpm=2)).admitted
    # A key without limits of its own: only the tenant's requests/min.
    tenant_only = await lim.charge_request("t-1", "fam", 100)
    assert tenant_only.admitted and tenant_only.state.remaining_requests == 96
