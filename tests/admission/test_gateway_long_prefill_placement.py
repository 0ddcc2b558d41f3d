"""Long contexts placed by their prefill slots through a RUNNING gateway (``python -m
gateway``), real Redis and two emulated replicas, both designated for long contexts
(``GATEWAY_ADMISSION_LONG_CONTEXT_REPLICA_SHARE`` 1), one prefill slot each (no lane), with
``GATEWAY_ADMISSION_LONG_PREFILL_PLACEMENT`` on (off by default): a long request goes to the
designated replica with no long prefill in flight, not to the lower-ranked one still
prefilling another (``placement.prefill_slot_free``); once that one's first token is out,
the next goes back to packing onto the lowest-ranked. With two gateway processes, each sees
the other's long prefills: every long context's replica is recorded on its lease in the
fleet's ledger at dispatch and read back before placing one (``Limiter.placed``,
``Limiter.placements``).

The replicas hold each chat request ``LATENCY_MS`` before queueing it (the emulator's
``extra_latency_ms`` fault): the long prefill is in flight, as the gateway sees it, until its
first token. The version pushes a prefill rate of 2,000 tokens/s and a 1 s TTFT target, so a
prompt of 2,000 tokens or more is a long context.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import redis

from emulator.testing import SpawnedEmulator
from gateway.admission.placement import long_context_order
from gateway.admission.quota import long_context_tag
from tests.admission.procs import (
    GatewayProc,
    Seeder,
    Tenant,
    chat_body,
    held_streams,
    open_stream,
    spawn_gateway,
)
from tests.admission.test_gateway_long_context import (
    LONG_WORDS,
    limits,
    long_context_version,
    running,
    two_replicas,
)
from tests.support import bytes_map, wait_until, wait_until_async

pytestmark = pytest.mark.slow

VERSION = "lcp-v1"
LATENCY_MS = 2_000
GW_ENV = {
    "GATEWAY_ADMISSION_TPOT_STALE_FACTOR": "1",
    "GATEWAY_ADMISSION_LONG_CONTEXT_REPLICA_SHARE": "1",
    "GATEWAY_ADMISSION_LONG_PREFILL_SLOTS_PER_REPLICA": "1",
    "GATEWAY_ADMISSION_SHORT_LONG_PREFILL_SLOTS_PER_REPLICA": "0",
    "GATEWAY_ADMISSION_EST_OUT_CAP": "100",
    "GATEWAY_ADMISSION_LONG_PREFILL_PLACEMENT": "1",  # off by default
}


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[SpawnedEmulator]]:
    with two_replicas(VERSION) as emus:
        yield emus


@pytest.fixture(scope="module")
def rm(rdb: redis.Redis, replicas: list[SpawnedEmulator]) -> Seeder:
    model = Seeder(rdb)
    model.add_version(long_context_version(VERSION, "lcp", replicas))
    return model


def spawned(tmp: Path, redis_url: str) -> Iterator[GatewayProc]:
    proc = spawn_gateway(tmp, redis_url, GW_ENV)
    try:
        yield proc
    finally:
        proc.terminate(20)


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, rm: Seeder
) -> Iterator[GatewayProc]:
    yield from spawned(tmp_path_factory.mktemp("lcp-gw"), redis_url)


@pytest.fixture(scope="module")
def gw2(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, rm: Seeder, gw: GatewayProc
) -> Iterator[GatewayProc]:
    yield from spawned(tmp_path_factory.mktemp("lcp-gw2"), redis_url)


def set_latency(emu: SpawnedEmulator, ms: int) -> None:
    r = httpx.post(emu.base_url + "/_emulator/faults", json={"extra_latency_ms": ms}, timeout=5)
    r.raise_for_status()


def leases(rdb: redis.Redis) -> int:
    """The long-context leases the fleet's ledger holds (its tenants' usage entries)."""
    ledger = bytes_map(rdb.hgetall(f"{long_context_tag(VERSION)}:l"))
    return sum(1 for k, v in ledger.items() if k.startswith(b"u:") and int(v) > 0)


@asynccontextmanager
async def slow_first_tokens(
    rm: Seeder, replicas: list[SpawnedEmulator]
) -> AsyncIterator[tuple[tuple[str, str], tuple[Tenant, Tenant], dict[str, object]]]:
    """Idle replicas holding each chat request ``LATENCY_MS`` (reset on exit): the two
    designated replicas in their long-context order, two standard tenants and a long
    request's body."""
    await asyncio.to_thread(
        wait_until, lambda: all(running(e) == 0 for e in replicas), 30, 0.2, "replicas idle"
    )
    order = long_context_order(VERSION, [f"lcp-r{i}" for i in range(len(replicas))])
    tenants = rm.tenant("standard", limits("lcp")), rm.tenant("standard", limits("lcp"))
    for emu in replicas:
        set_latency(emu, LATENCY_MS)
    try:
        yield (order[0], order[1]), tenants, chat_body("lcp", LONG_WORDS, 2_000, ignore_eos=True)
    finally:
        for emu in replicas:
            set_latency(emu, 0)


async def test_a_long_context_avoids_the_replica_prefilling_another(
    rm: Seeder, rdb: redis.Redis, gw: GatewayProc, replicas: list[SpawnedEmulator]
) -> None:
    by_id = {f"lcp-r{i}": emu for i, emu in enumerate(replicas)}
    async with slow_first_tokens(rm, replicas) as ((first, second), (a, b), body):
        async with held_streams() as (client, held):
            one = asyncio.create_task(open_stream(client, held, gw, a, body))
            # admitted (its lease is in the ledger) and so placed: this process has a long
            # prefill in flight on the lowest-ranked designated replica until its first token

            async def admitted() -> bool:
                return await asyncio.to_thread(leases, rdb) == 1

            await wait_until_async(admitted, 10, 0.01, "A admitted")
            two = await open_stream(client, held, gw, b, body)
            assert two.status_code == 200, two.text
            assert (await one).status_code == 200
            # packing by KV alone would have put both on the first replica
            assert running(by_id[first]) == 1 and running(by_id[second]) == 1
            for emu in replicas:
                set_latency(emu, 0)
            # both first tokens are out: no prefill in flight, the next packs onto the first
            three = await open_stream(client, held, gw, a, body)
            assert three.status_code == 200, three.text
            assert running(by_id[first]) == 2 and running(by_id[second]) == 1
    assert "Traceback" not in gw.log(), gw.log()[-3000:]


async def test_a_gateway_avoids_the_replica_another_gateway_is_prefilling_on(
    rm: Seeder,
    rdb: redis.Redis,
    gw: GatewayProc,
    gw2: GatewayProc,
    replicas: list[SpawnedEmulator],
) -> None:
    """A long context through one gateway is prefilling on the lowest-ranked designated
    replica; the next, through the other gateway (which placed nothing there), goes to the
    other replica: it read the first one's replica from the ledger. Its own count alone
    would have packed it onto the first."""
    by_id = {f"lcp-r{i}": emu for i, emu in enumerate(replicas)}
    await asyncio.to_thread(wait_until, lambda: leases(rdb) == 0, 30, 0.2, "no lease left")
    async with slow_first_tokens(rm, replicas) as ((first, second), (a, b), body):
        async with held_streams() as (client, held):
            one = asyncio.create_task(open_stream(client, held, gw, a, body))

            async def placed() -> bool:
                return await asyncio.to_thread(
                    lambda: (
                        set(bytes_map(rdb.hgetall(f"{long_context_tag(VERSION)}:r")).values())
                        == {first.encode()}
                    )
                )

            await wait_until_async(placed, 10, 0.01, "A's lease recorded on the first replica")
            two = await open_stream(client, held, gw2, b, body)
            assert two.status_code == 200, two.text
            assert (await one).status_code == 200
            assert running(by_id[first]) == 1 and running(by_id[second]) == 1
    for proc in (gw, gw2):
        assert "Traceback" not in proc.log(), proc.log()[-3000:]
