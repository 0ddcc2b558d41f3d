"""Plan classes through a RUNNING gateway: the class reaches vLLM as ``priority`` (so the replica's
own scheduler agrees with the gateway), and the reserved pool (docs/design.md R2) takes only
reserved traffic within its floor.

The replicas run in-process (``emulator.testing.running_emulator``) so the test can read
the engine's own view of each request; the gateway is a real ``python -m gateway`` process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import redis

from contracts import schema
from emulator.testing import EmulatorHandle, running_emulator
from tests.admission.procs import GatewayProc, Seeder, chat_body, metric, spawn_gateway
from tests.support import wait_until_async

pytestmark = pytest.mark.slow

PROFILE = "llama-8b-tp1-h100"
KV_BYTES = 128 * 1024
EXPECTED_PRIORITY: dict[schema.AdmissionClass, int] = {
    "reserved": 0,
    "standard": 1,
    "best_effort": 2,
}


def limits(family: str, *, floor: int = 0) -> dict[str, schema.LimitRecord]:
    return {
        family: schema.LimitRecord(
            rpm=100_000,
            tpm=100_000_000,
            max_context=16_000,
            max_output=4_096,
            kv_seconds_cap=1_000_000,
            reserved_kv=floor,
        )
    }


def version_on(
    name: str, family: str, replicas: list[tuple[EmulatorHandle, schema.Pool]]
) -> schema.ModelVersionRecord:
    return schema.ModelVersionRecord(
        version=name,
        family=family,
        context_length=16_384,
        kv_bytes_per_token=KV_BYTES,
        tpot_target_ms=50,
        kv_capacity_tokens=442_368,
        replicas=tuple(
            schema.ReplicaRecord(f"{name}-{i}", emu.base_url, pool)
            for i, (emu, pool) in enumerate(replicas)
        ),
    )


def prompt_tokens(emu: EmulatorHandle) -> float:
    return metric(httpx.get(emu.base_url + "/metrics", timeout=5).text, "vllm:prompt_tokens_total")


async def test_class_reaches_the_replica_as_vllm_priority(
    redis_sync: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    async with running_emulator(PROFILE, "prio-v1", speed=0.5) as emu:
        rm = Seeder(redis_sync)
        rm.add_version(version_on("prio-v1", "prio", [(emu, "shared")]))
        tenants = {
            cls: rm.tenant(cls, limits("prio", floor=500_000 if cls == "reserved" else 0))
            for cls in EXPECTED_PRIORITY
        }
        gw: GatewayProc = await asyncio.to_thread(spawn_gateway, tmp_path, redis_url)
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                for cls, tenant in tenants.items():
                    body = {**chat_body("prio", 5, 400, ignore_eos=True), "stream": True}
                    request = client.build_request(
                        "POST", gw.base_url + "/v1/chat/completions", json=body, headers=tenant.auth
                    )
                    response = await client.send(request, stream=True)
                    try:
                        assert response.status_code == 200, await response.aread()
                        live = list(emu.engine.requests.values())
                        assert [r.priority for r in live] == [EXPECTED_PRIORITY[cls]], cls
                    finally:
                        await response.aclose()  # disconnect: the replica aborts it
                    await wait_until_async(
                        lambda: not emu.engine.requests, 10, 0.05, "the replica aborted it"
                    )
        finally:
            await asyncio.to_thread(gw.terminate, 20)


async def test_reserved_pool_takes_only_reserved_floor_traffic(
    redis_sync: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    async with (
        running_emulator(PROFILE, "pool-v1", speed=20.0) as shared,
        running_emulator(PROFILE, "pool-v1", speed=20.0) as reserved,
    ):
        rm = Seeder(redis_sync)
        rm.add_version(version_on("pool-v1", "pool", [(shared, "shared"), (reserved, "reserved")]))
        enterprise = rm.tenant("reserved", limits("pool", floor=500_000))
        standard = rm.tenant("standard", limits("pool"))
        free = rm.tenant("best_effort", limits("pool"))
        gw: GatewayProc = await asyncio.to_thread(spawn_gateway, tmp_path, redis_url)
        try:
            async with httpx.AsyncClient(timeout=30) as client:

                async def send(tenant_auth: dict[str, str]) -> None:
                    r = await client.post(
                        gw.base_url + "/v1/chat/completions",
                        json=chat_body("pool", 20, 4),
                        headers=tenant_auth,
                    )
                    assert r.status_code == 200, r.text

                for _ in range(12):
                    await send(standard.auth)
                    await send(free.auth)
                assert await asyncio.to_thread(prompt_tokens, reserved) == 0
                assert await asyncio.to_thread(prompt_tokens, shared) > 0

                shared_before = await asyncio.to_thread(prompt_tokens, shared)
                for _ in range(6):
                    await send(enterprise.auth)
                # Floor traffic goes to the reserved pool first (docs/design.md R2), not the
                # shared fleet.
                assert await asyncio.to_thread(prompt_tokens, reserved) > 0
                assert await asyncio.to_thread(prompt_tokens, shared) == shared_before
        finally:
            await asyncio.to_thread(gw.terminate, 20)
