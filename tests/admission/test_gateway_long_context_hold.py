"""The long-context hold (``GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S``) through RUNNING
gateways (``python -m gateway``), real Redis and one emulated replica whose long prefill
lasts seconds: the setting of test_gateway_long_prefill.py (one long prefill at a time, a
prompt of 12,007 tokens taking ~6 s of wall time to its first token, the slot's safety
expiry far past the test). One gateway holds (60 s bound, one held request per tenant), the
other does not (the default). While tenant A's long prompt prefills, tenant B's is refused
for the busy slot: the holding gateway keeps it and serves it once A's first token frees
the slot, the other answers 503 as before. Every check is an outcome or an ordering of
events, none a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
import pytest
import redis

from emulator.testing import SpawnedEmulator
from gateway.admission.hold import HELD_HEADER
from gateway.admission.long_context import REFUSAL_CLAUSE_HEADER
from gateway.admission.quota import long_context_tag
from tests.admission.procs import (
    GatewayProc,
    Seeder,
    Tenant,
    after_scrapes,
    chat_body,
    held_streams,
    metric,
    spawn_gateway,
    two_gateways,
    wait_replica_idle,
)
from tests.admission.test_gateway_long_prefill import (
    GW_ENV,
    LONG_WORDS,
    VERSION,
    first_admitted,
    leases,
    limits,
    open_long,
    store_now_ms,
)
from tests.admission.test_gateway_long_prefill import replica as replica  # noqa: F401 - fixture
from tests.admission.test_gateway_long_prefill import rm as rm  # noqa: F401 - fixture
from tests.support import wait_until_async

pytestmark = pytest.mark.slow

HOLD_ENV = {
    **GW_ENV,
    "GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S": "60",
    "GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_PER_TENANT": "1",
}


@pytest.fixture(scope="module")
def gws(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    rm: Seeder,  # noqa: F811
) -> Iterator[tuple[GatewayProc, GatewayProc]]:
    """(holding, not holding): two gateway processes on one Redis."""
    with two_gateways(tmp_path_factory.mktemp("hold-gws"), redis_url, HOLD_ENV, GW_ENV) as pair:
        yield pair


@pytest.fixture(autouse=True)
async def settled(
    replica: SpawnedEmulator,  # noqa: F811
    gws: tuple[GatewayProc, GatewayProc],
) -> None:
    await asyncio.to_thread(wait_replica_idle, replica)
    await asyncio.gather(*(after_scrapes(gw) for gw in gws))


def holds(gw: GatewayProc, outcome: str) -> float:
    text = httpx.get(gw.base_url + "/metrics", timeout=5).text
    return metric(text, "fairway_admission_long_context_holds_total", outcome=outcome)


def held_now(gw: GatewayProc) -> float:
    text = httpx.get(gw.base_url + "/metrics", timeout=5).text
    return metric(text, "fairway_admission_long_context_held_requests")


async def until_held(gw: GatewayProc, n: int = 1) -> None:
    async def enough() -> bool:
        return await asyncio.to_thread(held_now, gw) >= n

    await wait_until_async(enough, 30, 0.05, f"{n} request(s) held")


async def held_beside(
    client: httpx.AsyncClient,
    held: list[httpx.Response],
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
    a_t: Tenant,
    b_t: Tenant,
) -> tuple[asyncio.Task[httpx.Response], asyncio.Task[httpx.Response]]:
    """A's long prompt prefilling (admitted through ``gws[1]``), then B's asked through
    ``gws[0]`` and held there: (A's stream, B's)."""
    holder, busy = gws
    first, _ = await first_admitted(client, held, busy, rdb, a_t)
    b = asyncio.create_task(open_long(client, held, holder, b_t))
    await until_held(holder)
    return first, b


async def test_a_long_prompt_refused_for_the_busy_slot_is_held_and_served(
    rm: Seeder,  # noqa: F811
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
) -> None:
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    holding, plain = gws
    admitted_before = await asyncio.to_thread(holds, holding, "admitted")
    async with held_streams() as (client, held):
        first, _ = await first_admitted(client, held, plain, rdb, a_t)
        # without the hold (the default), B is answered 503 at once, as before
        r = await open_long(client, held, plain, b_t)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "long_context_capacity"
        assert HELD_HEADER not in r.headers
        assert REFUSAL_CLAUSE_HEADER in r.headers and int(r.headers["retry-after-ms"]) >= 1000
        # with it, B's stream is held (nothing sent: its first byte is only later)
        b = asyncio.create_task(open_long(client, held, holding, b_t))
        await until_held(holding)
        assert not b.done() and not leases(rdb, b_t)
        # the ledger sees it as it sees a refused client coming back: waiting, due back
        assert waiting_and_due(rdb, b_t)
        a = await first
        assert a.status_code == 200, a.text
        served = await b
        # admitted once A's first token freed the slot, never answered 503
        assert served.status_code == 200, served.text
        assert int(served.headers[HELD_HEADER]) > 0
        assert leases(rdb, b_t)
    assert await asyncio.to_thread(holds, holding, "admitted") == admitted_before + 1
    assert await asyncio.to_thread(held_now, holding) == 0


async def test_a_held_non_streaming_request_is_served_too(
    rm: Seeder,  # noqa: F811
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
) -> None:
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    holding, plain = gws
    async with held_streams() as (client, held):
        first, _ = await first_admitted(client, held, plain, rdb, a_t)
        whole = asyncio.create_task(
            client.post(
                holding.base_url + "/v1/chat/completions",
                json=chat_body("lp", LONG_WORDS, 3, ignore_eos=True),
                headers=b_t.auth,
            )
        )
        await until_held(holding)
        assert (await first).status_code == 200
        response = await whole
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        assert int(response.headers[HELD_HEADER]) > 0


async def test_the_tenants_cap_turns_the_surplus_into_503s(
    rm: Seeder,  # noqa: F811
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
) -> None:
    """One held request per tenant on this gateway: B's second long prompt, asked while
    its first is held, gets the 503 at once; another tenant's is still held."""
    a_t, b_t, c_t = (rm.tenant("standard", limits()) for _ in range(3))
    holding = gws[0]
    over_cap = await asyncio.to_thread(holds, holding, "over_cap")
    async with held_streams() as (client, held):
        first, b1 = await held_beside(client, held, rdb, gws, a_t, b_t)
        b2 = await open_long(client, held, holding, b_t)  # the surplus
        assert b2.status_code == 503 and b2.json()["error"]["code"] == "long_context_capacity"
        assert HELD_HEADER not in b2.headers
        c = asyncio.create_task(open_long(client, held, holding, c_t))
        await until_held(holding, 2)  # C's own place
        assert not b1.done() and not c.done()
        assert (await first).status_code == 200
        # the slot goes to one of them, then the other: both are served, neither refused
        got = await asyncio.gather(b1, c)
        assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    assert await asyncio.to_thread(holds, holding, "over_cap") == over_cap + 1


async def test_a_client_gone_during_the_hold_ends_it(
    rm: Seeder,  # noqa: F811
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
) -> None:
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    holding = gws[0]
    gone_before = await asyncio.to_thread(holds, holding, "client_gone")
    async with held_streams() as (client, held):
        first, b = await held_beside(client, held, rdb, gws, a_t, b_t)
        b.cancel()  # B's client gives up while held
        with contextlib.suppress(asyncio.CancelledError):
            await b

        async def ended() -> bool:
            return await asyncio.to_thread(holds, holding, "client_gone") == gone_before + 1

        await wait_until_async(ended, 30, 0.05, "the hold ended by the client")
        assert await asyncio.to_thread(held_now, holding) == 0
        assert (await first).status_code == 200
        await slot_released(rdb, a_t)
        # the slot is free and the ended hold asks for nothing: no lease of B's appears
        await after_scrapes(holding)
        assert not leases(rdb, b_t)


async def test_the_drain_ends_the_hold_with_the_503(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    rm: Seeder,  # noqa: F811
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
) -> None:
    """A gateway told to stop while it holds a request answers it at once: the long-context
    503 with what is left of its retry-after, closing the connection; then it exits
    cleanly, long before the hold's bound."""
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    _, plain = gws
    draining = await asyncio.to_thread(
        spawn_gateway, tmp_path_factory.mktemp("hold-drain"), redis_url, HOLD_ENV
    )
    try:
        async with held_streams() as (client, held):
            first, b = await held_beside(client, held, rdb, (draining, plain), a_t, b_t)
            code = await asyncio.to_thread(draining.terminate, 30)
            r = await b
            assert r.status_code == 503 and r.json()["error"]["code"] == "long_context_capacity"
            assert r.headers["connection"] == "close" and int(r.headers[HELD_HEADER]) >= 0
            assert int(r.headers["retry-after-ms"]) >= 1
            assert code == 0
            assert not leases(rdb, b_t)
            assert (await first).status_code == 200
        assert "Traceback" not in draining.log(), draining.log()[-3000:]
    finally:
        draining.terminate(20)


def waiting_and_due(rdb: redis.Redis, t: Tenant) -> bool:
    """Whether the budget's ledger records ``t`` waiting (``w``) and when it is due back
    (``d:<tenant>``), as every refusal records the refused tenant."""
    tag = long_context_tag(VERSION)
    waiting = rdb.zscore(f"{tag}:w", t.tenant_id) is not None
    return waiting and rdb.hget(f"{tag}:l", f"d:{t.tenant_id}") is not None


async def slot_released(rdb: redis.Redis, t: Tenant) -> None:
    """Until ``t``'s lease no longer holds its prefill slot (its first token arrived)."""
    await wait_until_async(
        lambda: [kv for kv, end in leases(rdb, t) if end <= store_now_ms(rdb)],
        10,
        0.02,
        "the prefill slot released",
    )


def test_no_500s(gws: tuple[GatewayProc, GatewayProc]) -> None:
    for gw in gws:
        assert "Traceback" not in gw.log(), gw.log()[-3000:]
