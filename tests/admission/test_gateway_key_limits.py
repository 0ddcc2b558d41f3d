# The module-scoped fixtures of test_gateway_admission are imported and used by name.
# ruff: noqa: F811
"""Per-key limits through RUNNING gateways: an API key's own requests/min, tokens/min and
concurrency cap, inside its tenant's, enforced across two gateway processes on one Redis.

The fixtures (emulated ``fast`` and ``slow`` replicas, the read model, two gateways) are
those of ``test_gateway_admission``; each test makes its own tenant and keys.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import httpx
import pytest
import redis

from contracts import schema
from gateway.admission.quota import tenant_tag
from tests.admission.procs import GatewayProc, Seeder, Tenant, chat_body, held_streams
from tests.admission.test_gateway_admission import (  # noqa: F401
    GW_ENV,
    RATE_HEADERS,
    both,
    fast,
    gws,
    open_stream,
    post,
    rm,
    slow,
)
from tests.support import wait_until

pytestmark = pytest.mark.slow

KEY_CODE = "key_rate_limit_exceeded"


def refused_401(client: httpx.Client, body: dict[str, Any]) -> bool:
    return client.post("/v1/chat/completions", json=body).status_code == 401


def own(**kw: int) -> dict[str, schema.KeyLimitRecord]:
    """A key's own limits on the ``fast`` and ``slow`` families."""
    return {"fast": schema.KeyLimitRecord(**kw), "slow": schema.KeyLimitRecord(**kw)}


def key_inflight(rdb: redis.Redis, key: Tenant, family: str) -> int:
    """The key's in-flight count beside its tenant-model's leases (0 once the field goes)."""
    raw = rdb.hget(f"{tenant_tag(key.tenant_id, family)}:l", f"#k:{key.key_id}")
    return int(raw or 0)


async def two_keys_in_one_burst(
    rm: Seeder, gws: tuple[GatewayProc, GatewayProc], tenant_rpm: int, key_rpm: int, n: int
) -> tuple[list[httpx.Response], list[httpx.Response], float]:
    """A tenant with two keys, one limited to ``key_rpm``, the other with no limits of its
    own: each key warmed on both gateways (so the burst measures admission, not cold
    lookups), then ``n`` requests of each at once, alternating gateways. Returns both
    keys' responses, the warm-up's first (always 200) included, and the seconds it took."""
    t = rm.tenant("standard", both(rpm=tenant_rpm))
    limited = rm.key(t.tenant_id, own(rpm=key_rpm))
    sibling = rm.key(t.tenant_id)
    started = time.monotonic()
    warmed: dict[str, list[httpx.Response]] = {limited.key_id: [], sibling.key_id: []}
    for key in (limited, sibling):
        for gw in gws:
            r = post(gw, key, chat_body("fast", 3, 1))
            assert r.status_code == 200, r.text
            warmed[key.key_id].append(r)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as c:

        async def one(key: Tenant, i: int) -> httpx.Response:
            return await c.post(
                gws[i % 2].base_url + "/v1/chat/completions",
                json=chat_body("fast", 3, 1),
                headers=key.auth,
            )

        mine, theirs = await asyncio.gather(
            asyncio.gather(*(one(limited, i) for i in range(n))),
            asyncio.gather(*(one(sibling, i) for i in range(n))),
        )
    elapsed = time.monotonic() - started
    return warmed[limited.key_id] + list(mine), warmed[sibling.key_id] + list(theirs), elapsed


async def test_a_keys_requests_limit_is_exact_across_two_gateways_and_its_sibling_is_unaffected(
    rm: Seeder, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    mine, theirs, elapsed = await two_keys_in_one_burst(rm, gws, 1_000, 20, 60)
    ok = sum(r.status_code == 200 for r in mine)
    refill = 20 * elapsed / 60
    assert 20 <= ok <= 20 + refill, (ok, refill)
    refused = [r for r in mine if r.status_code != 200]
    assert refused and all(r.status_code == 429 for r in refused)
    for r in refused:
        err = r.json()["error"]
        assert err["code"] == KEY_CODE and err["type"] == "requests", err
        assert set(err) == {"message", "type", "param", "code"}
        assert "this API key" in err["message"]
        assert int(r.headers["retry-after-ms"]) > 0 and int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == "20"
    # the sibling key of the same tenant: every request admitted
    assert [r.status_code for r in theirs] == [200] * 62
    print(f"\nkey rpm 20 via 2 gateways: {ok} admitted (bound 20 + {refill:.2f}); sibling 62/62")


async def test_the_tenants_limit_still_bounds_both_keys(
    rm: Seeder, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    mine, theirs, elapsed = await two_keys_in_one_burst(rm, gws, 30, 20, 40)
    ok_mine = sum(r.status_code == 200 for r in mine)
    ok_all = ok_mine + sum(r.status_code == 200 for r in theirs)
    assert 30 <= ok_all <= 30 + 30 * elapsed / 60, ok_all  # the tenant's limit, exactly
    assert ok_mine <= 20 + 20 * elapsed / 60, ok_mine  # and the key's inside it
    codes = {r.json()["error"]["code"] for r in theirs if r.status_code == 429}
    assert codes == {"rate_limit_exceeded"}  # the sibling meets only its tenant's limit


async def test_a_keys_concurrency_cap_is_exact_across_two_gateways_and_released_on_disconnect(
    rm: Seeder,
    gws: tuple[GatewayProc, GatewayProc],
    rdb: redis.Redis,
    slow: object,
) -> None:
    t = rm.tenant("standard", both())
    capped = rm.key(t.tenant_id, own(max_concurrency=3))
    sibling = rm.key(t.tenant_id)
    body = chat_body("slow", 93, 2_000, ignore_eos=True)
    async with held_streams() as (client, held):
        rs = await asyncio.gather(
            *(open_stream(client, held, gws[i % 2], capped, body) for i in range(10))
        )
        codes = sorted(r.status_code for r in rs)
        assert codes == [200] * 3 + [429] * 7, codes
        for r in rs:
            if r.status_code == 429:
                err = r.json()["error"]
                assert err["code"] == KEY_CODE and err["type"] == "concurrency", err
                assert "In flight 3" in err["message"]
        assert key_inflight(rdb, capped, "slow") == 3
        # the sibling key is not held back by it
        other = await asyncio.gather(
            *(open_stream(client, held, gws[i % 2], sibling, body) for i in range(4))
        )
        assert [r.status_code for r in other] == [200] * 4
    # every stream closed by the client: the key's slots come back
    await asyncio.to_thread(
        wait_until,
        lambda: key_inflight(rdb, capped, "slow") == 0,
        10,
        0.05,
        "the key's in-flight slots released",
    )
    async with held_streams() as (client, held):
        again = await asyncio.gather(
            *(open_stream(client, held, gws[i % 2], capped, body) for i in range(4))
        )
        assert sorted(r.status_code for r in again) == [200] * 3 + [429]


def test_the_headers_report_the_tighter_of_the_keys_and_the_tenants_limits(
    rm: Seeder, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    t = rm.tenant("standard", both(rpm=10, tpm=5_000))
    # requests: the key's 3 binds; tokens: the key's 50,000 is looser than the tenant's
    limited = rm.key(t.tenant_id, own(rpm=3, tpm=50_000))
    sibling = rm.key(t.tenant_id)
    first = post(gws[0], limited, chat_body("fast", 3, 1))
    assert first.status_code == 200, first.text
    h = first.headers
    assert all(name in h for name in RATE_HEADERS)
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("3", "2")
    assert h["x-ratelimit-limit-tokens"] == "5000"
    assert int(h["x-ratelimit-remaining-tokens"]) < 5_000
    # the sibling sees the tenant's requests (one already spent by the other key)
    h2 = post(gws[1], sibling, chat_body("fast", 3, 1)).headers
    assert (h2["x-ratelimit-limit-requests"], h2["x-ratelimit-remaining-requests"]) == ("10", "8")
    # the key's tokens/min binds once it is the tighter one
    rm.edit_key(limited, own(rpm=3, tpm=100))
    wait_until(
        lambda: (
            post(gws[0], limited, chat_body("fast", 3, 1)).headers.get("x-ratelimit-limit-tokens")
            == "100"
        ),
        2,
        0.05,
        "the key's tokens/min in the headers",
    )


def test_an_edit_lowering_a_keys_limit_and_a_revocation_take_effect_within_a_second(
    rm: Seeder, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    t = rm.tenant("standard", both(rpm=1_000))
    key = rm.key(t.tenant_id)
    clients = [httpx.Client(base_url=gw.base_url, headers=key.auth, timeout=10) for gw in gws]
    body = chat_body("fast", 3, 1)
    try:
        for c in clients:  # cached in both gateways, with no limits of its own
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        rm.edit_key(key, own(rpm=1))
        edited = time.monotonic()
        took: list[float] = []
        for c in clients:
            # The answer shows the new record: the key's limit in the headers (its one
            # request admitted) or, that spent, the key's 429.
            while True:
                r = c.post("/v1/chat/completions", json=body)
                if r.headers.get("x-ratelimit-limit-requests") == "1":
                    took.append(time.monotonic() - edited)
                    break
                assert r.status_code == 200 and time.monotonic() - edited < 1.0, r.text
        assert max(took) < 1.0, took
        for c in clients:
            refused = c.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == KEY_CODE
        rm.writer.announce("key", _revoke(rm, key))
        revoked = time.monotonic()
        for c in clients:
            wait_until(
                functools.partial(refused_401, c, body),
                1.0,
                0.02,
                "the revoked key refused",
            )
        assert time.monotonic() - revoked < 1.0
    finally:
        for c in clients:
            c.close()
    print(f"\nkey limit edit effective after {max(took) * 1000:.0f} ms on both gateways")


def _revoke(rm: Seeder, key: Tenant) -> str:
    key_hash = rm.writer.key_hash(key.secret)
    rm.writer.delete_key(key_hash)
    return key_hash
