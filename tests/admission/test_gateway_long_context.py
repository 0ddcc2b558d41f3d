"""Long-context isolation through RUNNING gateways (``python -m gateway``), real Redis and two
emulated replicas: two heavy tenants split the fleet's long-context budget fairly across two
gateway processes; a long request lands on the long-context replica while short ones keep
off it.

The version pushes a prefill rate of 2,000 tokens/s and a 1 s TTFT target, so a prompt of
2,000 tokens or more is a long context; two shared replicas give one long-context replica
(``placement.long_context_order``'s first), whose KV up to the standard ceiling is the
budget: 16,384 x 0.85 = 13,926 tokens, five prompts of 2,500 tokens with 100 tokens of
output growth each (the KV estimate's output cap).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
import pytest
import redis

from contracts import schema
from emulator.testing import SpawnedEmulator, spawn_emulator
from gateway.admission.long_context import REFUSAL_CLAUSE_HEADER
from gateway.admission.placement import long_context_order
from gateway.admission.quota import long_context_tag
from tests.admission.procs import (
    GatewayProc,
    Seeder,
    Tenant,
    after_scrapes,
    chat_body,
    held_streams,
    metric,
    open_stream,
    two_gateways,
)
from tests.support import bytes_map, wait_until

pytestmark = pytest.mark.slow

PROFILE = "llama-8b-tp1-h100"
KV_BYTES = 128 * 1024
KV_TOKENS = 16_384
VERSION = "lc-v1"
LONG_WORDS = 2_493  # + 7 template tokens = 2,500 tokens: long (>= 2,000)
GROWTH = 100
CLAIM = 2_500 + GROWTH  # a long request's claim on the budget, in tokens
GW_ENV = {
    "GATEWAY_ADMISSION_TPOT_STALE_FACTOR": "1",
    # Prefill slots out of the way: these tests are about the KV budget and placement.
    "GATEWAY_ADMISSION_LONG_PREFILL_SLOTS_PER_REPLICA": "100",
    # A long context's claim and its ceiling check count its output growth as the KV charge
    # estimates it: capped at 100 tokens here, so five long prompts fit the budget.
    "GATEWAY_ADMISSION_EST_OUT_CAP": str(GROWTH),
}


def limits(model: str = "lc") -> dict[str, schema.LimitRecord]:
    return {
        model: schema.LimitRecord(
            rpm=100_000,
            tpm=100_000_000,
            max_context=16_000,
            max_output=4_096,
            kv_seconds_cap=1_000_000,
            reserved_kv=0,
        )
    }


@contextlib.contextmanager
def two_replicas(version: str) -> Iterator[list[SpawnedEmulator]]:
    """Two emulated replicas of ``version`` (16,384 tokens of KV, no prefix caching)."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                spawn_emulator(
                    PROFILE, version, 0.5, kv_capacity_tokens=KV_TOKENS, no_prefix_caching=True
                )
            )
            for _ in range(2)
        ]


def long_context_version(
    version: str, family: str, replicas: list[SpawnedEmulator]
) -> schema.ModelVersionRecord:
    """The version on ``replicas`` (ids ``<family>-r<i>``, all shared): 2,000 tokens/s and a
    1 s TTFT target, so a prompt of 2,000 tokens or more is a long context."""
    return schema.ModelVersionRecord(
        version=version,
        family=family,
        context_length=16_384,
        kv_bytes_per_token=KV_BYTES,
        tpot_target_ms=50,
        kv_capacity_tokens=KV_TOKENS,
        replicas=tuple(
            schema.ReplicaRecord(f"{family}-r{i}", emu.base_url, "shared")
            for i, emu in enumerate(replicas)
        ),
        prefill_tokens_per_s=2_000,
        ttft_target_ms=1_000,
    )


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[SpawnedEmulator]]:
    with two_replicas(VERSION) as emus:
        yield emus


@pytest.fixture(scope="module")
def designated(replicas: list[SpawnedEmulator]) -> str:
    return long_context_order(VERSION, ["lc-r0", "lc-r1"])[0]


@pytest.fixture(scope="module")
def rm(rdb: redis.Redis, replicas: list[SpawnedEmulator]) -> Seeder:
    model = Seeder(rdb)
    model.add_version(long_context_version(VERSION, "lc", replicas))
    return model


@pytest.fixture(scope="module")
def gws(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, rm: Seeder
) -> Iterator[tuple[GatewayProc, GatewayProc]]:
    with two_gateways(tmp_path_factory.mktemp("lc-gws"), redis_url, GW_ENV) as pair:
        yield pair


async def open_long(
    client: httpx.AsyncClient, held: list[httpx.Response], gw: GatewayProc, t: Tenant
) -> httpx.Response:
    """A long, slow stream; 200 once the replica sent its first chunk (admitted, placed)."""
    body = chat_body("lc", LONG_WORDS, 2_000, ignore_eos=True)
    return await open_stream(client, held, gw, t, body)


def running(emu: SpawnedEmulator) -> float:
    return metric(httpx.get(emu.base_url + "/metrics", timeout=5).text, "vllm:num_requests_running")


def kv_usage(emu: SpawnedEmulator) -> float:
    return metric(httpx.get(emu.base_url + "/metrics", timeout=5).text, "vllm:kv_cache_usage_perc")


def finished(emu: SpawnedEmulator) -> float:
    text = httpx.get(emu.base_url + "/metrics", timeout=5).text
    return metric(text, "vllm:request_success_total")


def idle(replicas: list[SpawnedEmulator]) -> None:
    wait_until(lambda: all(running(e) == 0 for e in replicas), 30, 0.2, "replicas idle")


def usage(rdb: redis.Redis) -> dict[str, int]:
    ledger = bytes_map(rdb.hgetall(f"{long_context_tag(VERSION)}:l"))
    return {k.decode()[2:]: int(v) for k, v in ledger.items() if k.startswith(b"u:")}


async def test_long_request_lands_on_the_long_context_replica_and_short_ones_avoid_it(
    rm: Seeder,
    gws: tuple[GatewayProc, GatewayProc],
    replicas: list[SpawnedEmulator],
    designated: str,
) -> None:
    await asyncio.to_thread(idle, replicas)
    by_id = {f"lc-r{i}": emu for i, emu in enumerate(replicas)}
    other = next(rid for rid in by_id if rid != designated)
    heavy, light = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    async with held_streams() as (client, held):
        r = await open_long(client, held, gws[0], heavy)
        assert r.status_code == 200, r.text
        assert running(by_id[designated]) == 1 and running(by_id[other]) == 0
        before = finished(by_id[designated]), finished(by_id[other])
        for i in range(16):  # short requests through both gateways, one of which never
            # placed a long context itself: it reads the fleet's ledger on admission
            short = await client.post(
                gws[i % 2].base_url + "/v1/chat/completions",
                json=chat_body("lc", 20, 2),
                headers=light.auth,
            )
            assert short.status_code == 200, short.text
        after = finished(by_id[designated]), finished(by_id[other])
        assert after[0] - before[0] == 0  # none on the long-context replica
        assert after[1] - before[1] == 16


async def test_two_heavy_tenants_split_the_budget_fairly_across_two_gateways(
    rm: Seeder,
    rdb: redis.Redis,
    gws: tuple[GatewayProc, GatewayProc],
    replicas: list[SpawnedEmulator],
) -> None:
    await asyncio.to_thread(idle, replicas)
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    ga, gb = gws
    async with held_streams() as (client, held):
        for _ in range(5):  # alone, A may use the whole budget: five prompts
            r = await open_long(client, held, ga, a_t)
            assert r.status_code == 200, r.text
            # the next one is checked against the ceiling with this one's KV counted; a
            # scrape after its first token lets the gateway stop double-counting it
            await after_scrapes(ga)
        full = await open_long(client, held, ga, a_t)
        assert full.status_code == 503, full.text
        err = full.json()["error"]
        assert err["code"] == "long_context_capacity" and "not your quota" in err["message"]
        assert int(full.headers["retry-after-ms"]) >= 1000
        assert full.headers[REFUSAL_CLAUSE_HEADER] == "kv_full"  # which clause refused it
        waits = await open_long(client, held, gb, b_t)  # B, through the other gateway
        assert waits.status_code == 503 and waits.json()["error"]["code"] == "long_context_capacity"
        assert waits.headers[REFUSAL_CLAUSE_HEADER] == "kv_full"
        assert usage(rdb) == {a_t.tenant_id: 5 * CLAIM * KV_BYTES}
        for response in held[:3]:  # three of A's requests end
            await response.aclose()
        del held[:3]
        await asyncio.to_thread(
            wait_until,
            lambda: usage(rdb).get(a_t.tenant_id) == 2 * CLAIM * KV_BYTES,
            10,
            0.05,
            "A's leases released",
        )
        # and the replica freed their KV, and the gateways have scraped that
        await asyncio.to_thread(
            wait_until,
            lambda: max(kv_usage(e) for e in replicas) < 0.5,
            10,
            0.05,
            "the cancelled requests' KV freed",
        )
        await asyncio.gather(after_scrapes(ga), after_scrapes(gb))
        # B waits: A may not grow past its fair half, though the budget has room
        again = await open_long(client, held, ga, a_t)
        assert again.status_code == 503, again.text
        assert again.headers[REFUSAL_CLAUSE_HEADER] == "kv_share"
        got = []
        for _ in range(3):
            r = await open_long(client, held, gb, b_t)
            got.append(r.status_code if r.status_code == 200 else r.json()["error"]["code"])
            await after_scrapes(gb)
        assert got == [200, 200, "long_context_capacity"], got
        # B's third: A waits ahead of it (served before it, holding no more) and the KV left
        # would not cover A's next request
        assert r.headers[REFUSAL_CLAUSE_HEADER] == "yield_kv"
        half = 2 * CLAIM * KV_BYTES
        assert usage(rdb) == {a_t.tenant_id: half, b_t.tenant_id: half}
    await asyncio.to_thread(
        wait_until, lambda: usage(rdb) == {}, 10, 0.05, "every long-context lease released"
    )


def test_long_context_metric_and_no_500s(gws: tuple[GatewayProc, GatewayProc]) -> None:
    text = httpx.get(gws[0].base_url + "/metrics", timeout=5).text
    assert metric(text, "fairway_admission_decisions_total", outcome="long_context_budget") >= 1
    # the refusals by the budget's clause, per model version
    refusals = "fairway_admission_long_context_refusals_total"
    assert metric(text, refusals, model=VERSION, clause="kv_full") >= 1
    for gw in gws:
        assert "Traceback" not in gw.log(), gw.log()[-3000:]
