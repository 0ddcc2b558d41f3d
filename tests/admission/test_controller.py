"""``AdmissionController`` in-process against real Redis, with a registry whose replica states the
test sets (as the scraper would): measured-TPOT wiring (docs/design.md R1), the reserved floor and
pool, class ceilings, vLLM priorities, refunds on capacity 503s and the renewer."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from contracts import schema
from contracts.formulas import kv_gib_seconds
from gateway.admission.config import AdmissionConfig
from gateway.admission.controller import AdmissionController, AdmissionRequest
from gateway.admission.estimates import to_milli
from gateway.admission.quota import tenant_tag
from gateway.admission.replicas import ReplicaState
from gateway.admission.router import Router
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.redis_client import connect
from tests.support import bytes_list, bytes_map

KV = 128 * 1024
VERSION = schema.ModelVersionRecord(
    version="m-v1",
    family="m",
    context_length=32_768,
    kv_bytes_per_token=KV,
    tpot_target_ms=50,
    kv_capacity_tokens=100_000,
    replicas=(
        schema.ReplicaRecord("pool-1", "http://pool-1", "reserved"),
        schema.ReplicaRecord("shared-1", "http://shared-1", "shared"),
        schema.ReplicaRecord("shared-2", "http://shared-2", "shared"),
    ),
)


class StubRegistry:
    """The registry's queries over states the test controls; ``p95`` feeds the TPOT estimate."""

    def __init__(self) -> None:
        self._states = {
            r.replica_id: ReplicaState(
                record=r, version=VERSION.version, healthy=True, scraped_at=1.0
            )
            for r in VERSION.replicas
        }
        self.p95: tuple[float | None, float] = (None, math.inf)

    def states(self, version: str) -> Sequence[ReplicaState]:
        return list(self._states.values()) if version == VERSION.version else []

    def state(self, replica_id: str) -> ReplicaState | None:
        return self._states.get(replica_id)

    def tpot_p95(self, version: str, window_s: float = 30.0) -> tuple[float | None, float]:
        return self.p95

    def occupy(self, **occ: float) -> None:
        for rid, value in occ.items():
            self._states[rid.replace("_", "-")].kv_usage = value


@pytest.fixture
async def setup(
    redis_url: str, aredis: aioredis.Redis
) -> AsyncIterator[tuple[AdmissionController, StubRegistry]]:
    registry = StubRegistry()
    controller = await started_controller(
        redis_url, aredis, registry, AdmissionConfig(best_effort_floor_share=0.01)
    )
    yield controller, registry
    await controller.stop()


async def started_controller(
    redis_url: str, aredis: aioredis.Redis, registry: StubRegistry, admission: AdmissionConfig
) -> AdmissionController:
    """One gateway process's admission: its own router and in-process state."""
    config = replace(GatewayConfig(), redis_url=redis_url, admission=admission)
    router = Router(registry, config=config.admission, clock=lambda: 0.5)
    controller = AdmissionController(
        registry=registry,  # type: ignore[arg-type]
        router=router,
        config=config,
        metrics=GatewayMetrics(),
        client=connect(redis_url, timeout_s=config.admission_redis_timeout_s),
    )
    await controller.start()
    return controller


def request(
    cls: schema.AdmissionClass,
    *,
    floor: int = 0,
    cap: int = 1_000_000,
    prompt: int = 1_000,
    max_output: int = 1_000,
    rid: str = "r",
) -> AdmissionRequest:
    limit = schema.LimitRecord(
        rpm=1000,
        tpm=10_000_000,
        max_context=32_000,
        max_output=4096,
        kv_seconds_cap=cap,
        reserved_kv=floor,
    )
    tenant = schema.TenantRecord(
        tenant_id=f"t-{cls}",
        name="t",
        plan=cls,
        admission_class=cls,
        suspended=False,
        limits={"m": limit},
    )
    return AdmissionRequest(
        request_id=rid,
        tenant=tenant,
        limit=limit,
        version=VERSION,
        prompt_tokens_est=prompt,
        max_output=max_output,
        is_retry=False,
    )


@pytest.mark.parametrize(
    ("p95", "age", "tpot"),
    [
        (0.07, 1.0, 0.07),
        (0.01, 1.0, 0.05),
        (0.9, 1.0, 0.20),
        (0.07, 90.0, 0.10),
        (None, 0, 0.10),
    ],
)
async def test_kv_estimate_uses_r1_measured_tpot(
    setup: tuple[AdmissionController, StubRegistry], p95: float | None, age: float, tpot: float
) -> None:
    controller, registry = setup
    registry.p95 = (p95, age)
    q = controller.quota_request(request("standard", prompt=2_000, max_output=500))
    assert q.est_kv_milli == to_milli(kv_gib_seconds(2_000, 500, KV, tpot))
    assert q.est_tokens == 2_500
    assert q.expected_ms == math.ceil(500 * tpot * 1000)


async def test_reserved_floor_goes_to_the_pool_with_priority_0_and_above_floor_is_standard(
    setup: tuple[AdmissionController, StubRegistry],
) -> None:
    controller, registry = setup
    registry.occupy(pool_1=0.50, shared_1=0.10, shared_2=0.10)
    est = to_milli(kv_gib_seconds(1_000, 1_000, KV, 0.10)) / 1000  # stale TPOT: 2 x target
    floor = math.floor(est)  # the first request is under the floor, the second is not
    assert 0 < floor < est
    first = await controller.admit(request("reserved", floor=floor, rid="a"))
    assert first.replica.replica_id == "pool-1" and first.priority == 0
    assert first.effective_class == "reserved" and first.admission_class == "reserved"
    second = await controller.admit(request("reserved", floor=floor, rid="b"))
    assert second.replica.pool == "shared" and second.priority == 1
    assert second.effective_class == "standard"
    # a hot pool: floor traffic tries another replica, not a thrashing one (docs/design.md R2)
    for t in (first, second):
        await controller.settle(t, prompt_tokens=1000, completion_tokens=10, outcome="stop")
    registry.occupy(pool_1=0.95, shared_1=0.90, shared_2=0.91)
    third = await controller.admit(request("reserved", floor=floor, rid="c"))
    assert third.replica.replica_id == "shared-1" and third.priority == 0
    await controller.settle(third, prompt_tokens=1000, completion_tokens=10, outcome="stop")
    registry.occupy(shared_1=0.93, shared_2=0.99)
    with pytest.raises(ApiError) as exc:
        await controller.admit(request("reserved", floor=floor, rid="d"))
    assert exc.value.status == 503 and "capacity incident" in exc.value.message


async def test_standard_and_free_never_enter_the_reserved_pool(
    setup: tuple[AdmissionController, StubRegistry], aredis: aioredis.Redis
) -> None:
    controller, registry = setup
    registry.occupy(pool_1=0.0, shared_1=0.86, shared_2=0.90)
    with pytest.raises(ApiError) as exc:
        await controller.admit(request("standard", rid="s"))
    assert exc.value.status == 503 and exc.value.code == "capacity"
    assert "x-ratelimit-remaining-requests" in exc.value.headers
    assert 5_000 <= int(exc.value.headers["retry-after-ms"]) <= 10_001
    # the refused request gave its quota back: nothing in flight, the request refunded
    ledger = bytes_map(await aredis.hgetall(f"{tenant_tag('t-standard', 'm')}:l"))
    # ("#r…" fields: the tenant's retry-budget window, which counts admissions as the
    # fleet's does)
    assert {k: v for k, v in ledger.items() if not k.startswith(b"#r")} == {b"#": b"0"}
    bucket = await aredis.hget(f"{tenant_tag('t-standard', 'm')}:b", "rl")
    assert bucket is not None and float(bucket) == pytest.approx(1000, abs=1)


async def test_best_effort_ceiling_and_floor(
    setup: tuple[AdmissionController, StubRegistry],
) -> None:
    controller, registry = setup
    registry.occupy(pool_1=0.0, shared_1=0.55, shared_2=0.70)
    under = await controller.admit(request("best_effort", rid="u"))
    assert under.replica.replica_id == "shared-1" and under.priority == 2
    registry.occupy(shared_1=0.65, shared_2=0.70)
    floored = await controller.admit(request("best_effort", rid="f"))  # the floor's one
    assert floored.replica.pool == "shared" and floored.priority == 2
    with pytest.raises(ApiError) as exc:
        await controller.admit(request("best_effort", rid="g"))
    assert exc.value.status == 503
    standard = await controller.admit(request("standard", rid="s"))
    assert standard.priority == 1


async def test_settle_is_idempotent_and_refunds_a_failure_entirely(
    setup: tuple[AdmissionController, StubRegistry], aredis: aioredis.Redis
) -> None:
    controller, registry = setup
    registry.occupy(shared_1=0.1, shared_2=0.1)
    ticket = await controller.admit(request("standard", rid="x", prompt=100, max_output=900))
    assert ticket.headers["x-ratelimit-remaining-tokens"] == str(10_000_000 - 1_000)
    await controller.settle(ticket, prompt_tokens=100, completion_tokens=0, outcome="error")
    await controller.settle(ticket, prompt_tokens=100, completion_tokens=0, outcome="error")
    bucket = bytes_list(await aredis.hmget(f"{tenant_tag('t-standard', 'm')}:b", "rl", "tl"))
    assert float(bucket[0]) == pytest.approx(1000, abs=1)  # the request came back
    assert float(bucket[1]) == pytest.approx(10_000_000, abs=200)  # and every token
    assert await aredis.hget(f"{tenant_tag('t-standard', 'm')}:l", "#") == b"0"


async def test_early_route_from_the_last_answer_kept_when_the_answer_agrees(
    setup: tuple[AdmissionController, StubRegistry],
) -> None:
    controller, registry = setup
    registry.occupy(pool_1=0.0, shared_1=0.10, shared_2=0.20)
    req = request("standard", rid="a")
    assert controller.early_route(req) is None  # no answer seen yet for the tenant
    first = await controller.admit(req)
    assert not first.early
    early = controller.early_route(request("standard", rid="b"))
    assert early is not None and early.priority == 1 and early.replica.pool == "shared"
    second = await controller.admit(request("standard", rid="b"), early)
    assert second.early and second.replica is early.replica and second.priority == 1
    assert controller.metrics.early.labels("kept")._value.get() == 1
    # A retry never goes early (the retry budget may shed it).
    assert controller.early_route(replace(request("standard", rid="c"), is_retry=True)) is None
    for t in (first, second):
        await controller.settle(t, prompt_tokens=1000, completion_tokens=10, outcome="stop")


async def test_early_route_rerouted_when_another_process_moved_the_reserved_floor(
    setup: tuple[AdmissionController, StubRegistry], redis_url: str, aredis: aioredis.Redis
) -> None:
    """The route was chosen as floor (reserved) traffic from this process's last answer;
    meanwhile another gateway process took the tenant past its floor, so the answer says
    standard: the early route is released and the request routed again, never sent into
    the reserved pool above its floor."""
    controller, registry = setup
    other = await _second_controller(redis_url, aredis, registry)
    try:
        registry.occupy(pool_1=0.30, shared_1=0.10, shared_2=0.10)
        est = to_milli(kv_gib_seconds(1_000, 1_000, KV, 0.10)) / 1000
        floor = math.floor(2 * est)  # under it with one request in flight, not with two
        first = await controller.admit(request("reserved", floor=floor, rid="a"))
        assert first.effective_class == "reserved"
        early = controller.early_route(request("reserved", floor=floor, rid="b"))
        assert early is not None and early.cls == "reserved" and early.replica.pool == "reserved"
        taken = await other.admit(request("reserved", floor=floor, rid="o"))  # unseen here
        second = await controller.admit(request("reserved", floor=floor, rid="b"), early)
        assert not second.early and second.effective_class == "standard"
        assert second.replica.pool == "shared" and second.priority == 1
        assert controller.metrics.early.labels("rerouted")._value.get() == 1
        await other.settle(taken, prompt_tokens=1000, completion_tokens=10, outcome="stop")
        for t in (first, second):
            await controller.settle(t, prompt_tokens=1000, completion_tokens=10, outcome="stop")
    finally:
        await other.stop()


async def test_early_route_refused_by_the_answer_releases_the_replica(
    setup: tuple[AdmissionController, StubRegistry], redis_url: str, aredis: aioredis.Redis
) -> None:
    controller, registry = setup
    other = await _second_controller(redis_url, aredis, registry)
    try:
        registry.occupy(shared_1=0.10, shared_2=0.10)
        small = dict(prompt=100, max_output=100)
        first = await controller.admit(_with_rpm(request("standard", rid="a", **small), 8))
        early = controller.early_route(_with_rpm(request("standard", rid="b", **small), 8))
        assert early is not None
        taken = [
            await other.admit(_with_rpm(request("standard", rid=f"o{i}", **small), 8))
            for i in range(7)
        ]
        with pytest.raises(ApiError) as exc:
            await controller.admit(_with_rpm(request("standard", rid="b", **small), 8), early)
        assert exc.value.status == 429
        assert controller.metrics.early.labels("cancelled")._value.get() == 1
        # the router no longer counts the withdrawn request on its replica
        assert "b" not in controller._router._prefilling.get(early.replica.replica_id, {})
        # and after a refusal the tenant waits for answers again
        assert controller.early_route(_with_rpm(request("standard", rid="c", **small), 8)) is None
        for t in [first, *taken]:
            owner = controller if t is first else other
            await owner.settle(t, prompt_tokens=100, completion_tokens=10, outcome="stop")
    finally:
        await other.stop()


def _with_rpm(req: AdmissionRequest, rpm: int) -> AdmissionRequest:
    limit = replace(req.limit, rpm=rpm)
    tenant = replace(req.tenant, tenant_id=f"{req.tenant.tenant_id}-rpm{rpm}")
    return replace(req, limit=limit, tenant=tenant)


async def _second_controller(
    redis_url: str, aredis: aioredis.Redis, registry: StubRegistry
) -> AdmissionController:
    """Another gateway process's admission: the same Redis, its own in-process state."""
    return await started_controller(redis_url, aredis, registry, AdmissionConfig())
