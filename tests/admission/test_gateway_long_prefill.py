"""A long prefill holds its slot of the long-context budget until its first token, through
RUNNING gateways (``python -m gateway``), real Redis and an emulated replica whose prefill
follows the replica cost model (attention included), slowed down so that it lasts seconds.

The version pushes a prefill rate of 100,000 tokens/s and a 10 ms TTFT target: a prompt of
1,000 tokens or more is a long context, and the linear estimate of a 12,000-token prompt's
prefill is 120 ms. The replica runs at 0.07 x model speed, so that prefill really takes
about 6 s. The budget runs one long prefill at a time (one replica, one slot). The safety
expiry is set far beyond the test (``LONG_PREFILL_HOLD_FACTOR``): only a first token (or the
request's end) frees the slot. No timing bound is tight: the real prefill only gets longer
on a loaded machine, and every check is an ordering of events.
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
from gateway.admission.quota import long_context_tag
from tests.admission.procs import (
    GatewayProc,
    Seeder,
    Tenant,
    after_scrapes,
    chat_body,
    held_streams,
    open_stream,
    two_gateways,
    wait_replica_idle,
)
from tests.support import bytes_map, wait_until_async

pytestmark = pytest.mark.slow

PROFILE = "llama-8b-tp1-h100"
VERSION = "lp-v1"
SPEED = 0.07  # 12,007 tokens: ~0.42 s of model time, ~6 s of wall time
LONG_WORDS = 12_000  # + 7 template tokens: long (>= 1,000), estimated at 120 ms
GW_ENV = {
    "GATEWAY_ADMISSION_TPOT_STALE_FACTOR": "1",
    # The safety expiry 1,000 x the upper bound (~1.4 s): ~24 min, far past the test.
    "GATEWAY_ADMISSION_LONG_PREFILL_HOLD_FACTOR": "1000",
    "GATEWAY_ADMISSION_EST_OUT_CAP": "100",
}


def limits() -> dict[str, schema.LimitRecord]:
    return {
        "lp": schema.LimitRecord(
            rpm=100_000,
            tpm=100_000_000,
            max_context=60_000,
            max_output=4_096,
            kv_seconds_cap=1_000_000,
            reserved_kv=0,
        )
    }


@pytest.fixture(scope="module")
def replica() -> Iterator[SpawnedEmulator]:
    with spawn_emulator(
        PROFILE, VERSION, SPEED, kv_capacity_tokens=65_536, no_prefix_caching=True
    ) as emu:
        yield emu


@pytest.fixture(scope="module")
def rm(rdb: redis.Redis, replica: SpawnedEmulator) -> Seeder:
    model = Seeder(rdb)
    model.add_version(
        schema.ModelVersionRecord(
            version=VERSION,
            family="lp",
            context_length=65_536,
            kv_bytes_per_token=128 * 1024,
            tpot_target_ms=50,
            kv_capacity_tokens=65_536,
            replicas=(schema.ReplicaRecord("lp-r0", replica.base_url, "shared"),),
            prefill_tokens_per_s=100_000,
            ttft_target_ms=10,
        )
    )
    return model


@pytest.fixture(scope="module")
def gws(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, rm: Seeder
) -> Iterator[tuple[GatewayProc, GatewayProc]]:
    with two_gateways(tmp_path_factory.mktemp("lp-gws"), redis_url, GW_ENV) as pair:
        yield pair


@pytest.fixture(autouse=True)
async def settled(replica: SpawnedEmulator, gws: tuple[GatewayProc, GatewayProc]) -> None:
    """Each test starts on an idle replica that both gateways have seen idle: an earlier
    test's streams end on the replica only once the gateway has aborted them upstream, and
    until a scrape shows their KV gone a class ceiling may refuse the next long prompt."""
    await asyncio.to_thread(wait_replica_idle, replica)
    await asyncio.gather(*(after_scrapes(gw) for gw in gws))


async def open_long(
    client: httpx.AsyncClient, held: list[httpx.Response], gw: GatewayProc, t: Tenant
) -> httpx.Response:
    """A long, slow stream; 200 once its first token arrived (the emulator sends its first
    chunk with the first token, and the gateway its headers with that chunk)."""
    body = chat_body("lp", LONG_WORDS, 2_000, ignore_eos=True)
    return await open_stream(client, held, gw, t, body)


def leases(rdb: redis.Redis, tenant: Tenant) -> list[tuple[int, int]]:
    """The tenant's leases on the ledger: (KV bytes, prefill end ms), and the store's now."""
    ledger = bytes_map(rdb.hgetall(f"{long_context_tag(VERSION)}:l"))
    out = []
    for field, value in ledger.items():
        parts = value.decode().split(":", 3)
        if (
            not field.startswith((b"#", b"u:", b"s:", b"p:", b"d:"))
            and parts[3] == tenant.tenant_id
        ):
            out.append((int(parts[0]), int(parts[1])))
    return out


def store_now_ms(rdb: redis.Redis) -> int:
    seconds, micros = rdb.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def refused_for_the_budget(
    client: httpx.AsyncClient, held: list[httpx.Response], gw: GatewayProc, t: Tenant
) -> None:
    r = await open_long(client, held, gw, t)
    assert r.status_code == 503, f"admitted ({r.status_code}) while the slot was held"
    assert r.json()["error"]["code"] == "long_context_capacity"


async def first_admitted(
    client: httpx.AsyncClient,
    held: list[httpx.Response],
    gw: GatewayProc,
    rdb: redis.Redis,
    t: Tenant,
) -> tuple[asyncio.Task[httpx.Response], list[tuple[int, int]]]:
    """Start ``t``'s long stream; return it (its 200 comes with the first token) once the
    ledger holds its lease, with that lease."""
    first = asyncio.create_task(open_long(client, held, gw, t))

    def admitted() -> list[tuple[int, int]]:
        held_now = leases(rdb, t)
        if not held_now and first.done() and first.result().status_code != 200:
            r = first.result()  # answered without a lease: refused, and why
            raise AssertionError(f"refused ({r.status_code}): {r.text[:300]}")
        return held_now

    lease = await wait_until_async(admitted, 30, 0.02, "admitted")
    return first, lease


async def test_a_second_long_prompt_waits_for_the_first_ones_first_token(
    rm: Seeder, rdb: redis.Redis, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    ga, gb = gws
    async with held_streams() as (client, held):
        first, held_a = await first_admitted(client, held, ga, rdb, a_t)
        # A's prefill slot is held far past the old estimate (its safety expiry is minutes
        # away: only its first token frees it in this test)
        assert held_a[0][1] - store_now_ms(rdb) > 60_000
        await asyncio.sleep(0.5)  # the old estimate (120 ms) of A's prefill has passed
        # B, through the other gateway, while A is still prefilling: refused for the budget
        await refused_for_the_budget(client, held, gb, b_t)
        assert not first.done()  # A's first token has not arrived yet
        a = await first
        assert a.status_code == 200, a.text
        # A's first token released its slot at once; its KV stays held until it ends
        released = await wait_until_async(
            lambda: [kv for kv, end in leases(rdb, a_t) if end <= store_now_ms(rdb)],
            10,
            0.02,
            "A's prefill slot released",
        )
        assert released == [held_a[0][0]]
        b = await open_long(client, held, gb, b_t)  # B's next attempt is admitted
        assert b.status_code == 200, b.text
    await wait_until_async(
        lambda: not leases(rdb, a_t) and not leases(rdb, b_t), 10, 0.05, "leases released"
    )


async def test_a_long_prompt_cancelled_before_its_first_token_frees_its_slot(
    rm: Seeder, rdb: redis.Redis, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    a_t, b_t = rm.tenant("standard", limits()), rm.tenant("standard", limits())
    ga, gb = gws
    async with held_streams() as (client, held):
        first, _ = await first_admitted(client, held, ga, rdb, a_t)
        await refused_for_the_budget(client, held, gb, b_t)
        assert not first.done()
        first.cancel()  # the client gives up before its first token
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await wait_until_async(lambda: not leases(rdb, a_t), 10, 0.02, "A's lease released")
        b = await open_long(client, held, gb, b_t)
        assert b.status_code == 200, b.text


async def test_a_non_streaming_long_prompt_frees_its_slot_at_its_first_token_too(
    rm: Seeder, rdb: redis.Redis, gws: tuple[GatewayProc, GatewayProc]
) -> None:
    """The gateway reads the replica's stream for a JSON client as well: the slot frees at
    the first token, while the response (30 tokens of decode, seconds on this replica) is
    still being generated."""
    a_t = rm.tenant("standard", limits())
    async with httpx.AsyncClient(timeout=120) as client:
        whole = asyncio.create_task(
            client.post(
                gws[0].base_url + "/v1/chat/completions",
                json=chat_body("lp", LONG_WORDS, 30, ignore_eos=True),
                headers=a_t.auth,
            )
        )
        held_a = await wait_until_async(lambda: leases(rdb, a_t), 30, 0.02, "A admitted")
        assert held_a[0][1] - store_now_ms(rdb) > 60_000
        await wait_until_async(
            lambda: [kv for kv, end in leases(rdb, a_t) if end <= store_now_ms(rdb)],
            30,
            0.02,
            "A's prefill slot released",
        )
        assert not whole.done()  # its answer is still being generated
        response = await whole
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 30
    await wait_until_async(lambda: not leases(rdb, a_t), 10, 0.05, "A's lease released")


def test_no_500s(gws: tuple[GatewayProc, GatewayProc]) -> None:
    for gw in gws:
        assert "Traceback" not in gw.log(), gw.log()[-3000:]
