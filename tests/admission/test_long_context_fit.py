"""The whole-context budget (``AdmissionConfig.long_context_fit``,
``long_context.fit_budget``): an ask of ``need`` bytes is judged against the budget less
(designated - 1) x need, so that once admitted some designated replica's long-context floor
leaves room for it under the class ceiling (pigeonhole). Property-tested through
placement's own functions (``placement.long_floors``, ``fits_ceiling``, ``choose``), sharp
(one byte more and an adversarial spread leaves no replica with room), off by default, and
carried by the controller's ask (the admit script and the fleet simulation's ledger take
the budget from the ask, so they decide on the same number)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contracts import schema
from emulator.profiles import LLAMA_70B_TP4_H100
from gateway.admission import long_context, placement
from gateway.admission.classes import occupancy_ceiling
from gateway.admission.config import AdmissionConfig, EffectiveClass
from gateway.admission.placement import PlacementRequest
from gateway.admission.routing import ReplicaView

FIT = AdmissionConfig(long_context_fit=True)
PLACE = replace(FIT, long_prefill_placement=True)
CLASSES: tuple[EffectiveClass, ...] = ("standard", "best_effort")


def version(capacity_tokens: int, bytes_per_token: int = 1) -> schema.ModelVersionRecord:
    return schema.ModelVersionRecord(
        version="v",
        family="f",
        context_length=131_072,
        kv_bytes_per_token=bytes_per_token,
        tpot_target_ms=50,
        kv_capacity_tokens=capacity_tokens,
        prefill_tokens_per_s=10_000.0,
    )


def views(floors: list[float], cap: int, shared: int) -> list[ReplicaView]:
    """The shared replicas as the router sees them with nothing scraped: the designated
    ones (the first ``len(floors)``) carrying their long-context floors."""
    n = len(floors)
    return [
        ReplicaView(
            f"r{i}",
            "shared",
            0.0,
            0,
            cap,
            long_rank=i,
            long_designated=n,
            long_floor=floors[i] if i < n else 0.0,
        )  # fmt: skip
        for i in range(shared)
    ]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[int, int, EffectiveClass, int, list[int], int]:
    """Designated replicas, one replica's KV, the ask's class and size, the long-context KV
    recorded placed on each designated replica and the fleet's KV with no replica recorded
    (admitted, being sent)."""
    n = draw(st.integers(1, 24))
    cap = draw(st.integers(1_000, 10**12))
    cls = draw(st.sampled_from(CLASSES))
    need = draw(st.integers(0, cap))
    if draw(st.booleans()):
        placed = draw(st.lists(st.integers(0, cap), min_size=n, max_size=n))
        rest = draw(st.integers(0, cap * n))
    else:
        # near the bound: most replicas just short of room for the ask, a little unplaced
        short = max(0, math.ceil(cap * occupancy_ceiling(cls, FIT) - need))
        slack = st.integers(0, max(1, cap // 1000))
        placed = [max(0, short - draw(slack)) for _ in range(n)]
        rest = draw(slack)
    return n, cap, cls, need, placed, rest


@settings(max_examples=500, deadline=None)
@given(fleets())
@example((56, 565_248, "standard", 130_000, [int(0.85 * 565_248) - 129_999] * 56, 0))
def test_an_ask_the_whole_context_budget_admits_fits_a_designated_replica(
    fleet: tuple[int, int, EffectiveClass, int, list[int], int],
) -> None:
    """Whatever the spread of the long-context KV over the designated replicas (recorded
    where it runs, or unrecorded and packed by ``long_floors``), an ask the KV clause with
    the whole-context budget admits passes placement's ceiling check on some designated
    replica, and ``choose`` places it (by prefill slots or by KV)."""
    n, cap, cls, need, placed, rest = fleet
    shared = 4 * n  # long_context_replica_share 0.25: n designated
    budget, _ = long_context.long_context_budget(version(cap), shared, cls, FIT, need)
    total = sum(placed) + rest
    if total == 0 or total + need > budget:
        return  # refused by the KV clause (an empty budget runs anyone, alone: below)
    floors = placement.long_floors(total, placed, cap, FIT)
    req = PlacementRequest(cls, need, long_context=True)
    fleet_views = views(floors, cap, shared)
    fits = [v for v in fleet_views[:n] if placement.fits_ceiling(v, req, FIT)]
    assert fits, (floors, need / cap)
    for cfg in (FIT, PLACE):
        got = placement.choose(fleet_views, req, cfg, random.Random(0))
        assert got is not None and placement.designated(got)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1_000, 10**12), st.sampled_from(CLASSES), st.data())
def test_the_rule_is_sharp_for_asks_of_one_size(
    n: int, cap: int, cls: EffectiveClass, data: st.DataObject
) -> None:
    """With nothing smaller to go on than the ask's own size the bound cannot be loosened:
    within ``2n`` bytes past it, every designated replica can be just short of room for the
    ask (a byte over the least that refuses it, so that float rounding cannot decide)."""
    ceiling = cap * occupancy_ceiling(cls, FIT)
    need = data.draw(st.integers(1, max(1, math.floor(ceiling) - 1)))
    budget, _ = long_context.long_context_budget(version(cap), 4 * n, cls, FIT, need)
    # each replica holds a byte more than the least with which the ask does not fit it
    short = math.ceil(ceiling - need) + 1
    placed = [short] * n
    floors = placement.long_floors(sum(placed), placed, cap, FIT)
    req = PlacementRequest(cls, need, long_context=True)
    assert not any(placement.fits_ceiling(v, req, FIT) for v in views(floors, cap, n))
    # and the whole-context budget refuses that total
    assert sum(placed) + need > budget


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 2_000), st.integers(1, 10**12), st.sampled_from(CLASSES), st.integers(0, 10**12)
)
def test_off_by_default_the_budget_is_the_whole_pool(
    shared: int, cap: int, cls: EffectiveClass, need: int
) -> None:
    """The knob off (the default): the budget is the designated replicas' KV up to the
    ceiling whatever the ask's size; on, it is ``fit_budget`` of it, never more."""
    assert not AdmissionConfig().long_context_fit
    v = version(cap)
    pool = long_context.long_context_budget(v, shared, cls, AdmissionConfig())
    assert long_context.long_context_budget(v, shared, cls, AdmissionConfig(), need) == pool
    fit = long_context.long_context_budget(v, shared, cls, FIT, need)
    n = placement.long_context_replicas(shared, FIT)
    assert fit == (long_context.fit_budget(pool[0], need, n), pool[1])
    assert 0 <= fit[0] < max(1, pool[0])  # never more than the pool


def test_fit_budget_worked_example() -> None:
    """56 designated replicas of 565,248 tokens at the standard ceiling 0.85, a 128k context
    with its output (0.23 of a replica): the budget gives up 55 of them, leaving 0.62 of
    each replica on average where the pool counts 0.85."""
    cap, n = 565_248, 56
    need = round(0.23 * cap)
    pool = math.floor(n * cap * 0.85)
    fit = long_context.fit_budget(pool, need, n)
    assert fit == pool - 55 * need - 1
    assert math.isclose(fit / (n * cap), 0.85 - 0.23 * 55 / 56, abs_tol=1e-6)
    assert long_context.fit_budget(pool, need, 1) == pool - 1  # one replica: the pool
    assert long_context.fit_budget(10, 20, 3) == 0  # never below 0


def test_the_knob_from_env() -> None:
    assert AdmissionConfig.from_env({"GATEWAY_ADMISSION_LONG_CONTEXT_FIT": "1"}).long_context_fit


@pytest.mark.parametrize("fit", [False, True])
async def test_the_controllers_ask_carries_the_whole_context_budget(
    redis_url: str, aredis: aioredis.Redis, fit: bool
) -> None:
    """The controller's ask carries the budget its own size is judged against: the admit
    script (``lc_refusal``) and the fleet simulation's ledger (bench/sim.py) read the budget
    from it, so both decide the rule on the same number."""
    from tests.admission.test_controller import VERSION, StubRegistry, request, started_controller
    from tests.admission.test_long_context_budget import threshold_version

    cfg = AdmissionConfig(long_context_fit=fit)
    # 8 shared replicas: 2 designated
    shared_record = next(r for r in VERSION.replicas if r.pool != "reserved")
    records = tuple(replace(shared_record, replica_id=f"s{i}") for i in range(8))
    v = replace(threshold_version(LLAMA_70B_TP4_H100), replicas=records)
    controller = await started_controller(redis_url, aredis, StubRegistry(), cfg)
    try:
        req = replace(request("standard", prompt=128_000, rid="r1"), version=v)
        ask = controller.long_context_ask(req)
        assert ask is not None
        shared = sum(1 for r in v.replicas if r.pool != "reserved")
        pool, _ = long_context.long_context_budget(v, shared, "standard", AdmissionConfig())
        n = placement.long_context_replicas(shared, cfg)
        assert n == 2
        want = long_context.fit_budget(pool, ask.kv_bytes, n) if fit else pool
        assert ask.budget_bytes == want
    finally:
        await controller.stop()
