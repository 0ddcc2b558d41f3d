"""``fleet_sim.placement_refusal``: why placement refused a long context the budget had
admitted — the measurement behind bench/results/fleet_sim_isolation_place2.md (the router's
long-context floor, packed in order, refused them once long contexts were spread)."""

from __future__ import annotations

import random

from bench.fleet_sim import (
    CEILING_REFUSAL,
    FLOOR_REFUSAL,
    UNSCRAPED_REFUSAL,
    placement_refusal,
)
from gateway.admission.config import AdmissionConfig
from gateway.admission.placement import PlacementRequest, choose
from gateway.admission.routing import ReplicaView

CAP = 1_000_000
ADM = AdmissionConfig()
REQ = PlacementRequest("standard", CAP // 5, long_context=True)


def _view(i: int, occupancy: float, floor: float, designated: int = 2) -> ReplicaView:
    return ReplicaView(
        f"r{i}", "shared", occupancy, 0, CAP, long_rank=i, long_designated=designated,
        long_floor=floor,
    )  # fmt: skip


def test_a_floor_over_a_replica_with_room_is_the_floors_refusal() -> None:
    # the first replica is empty but its floor says full; the second is really full
    views = [_view(0, 0.0, 0.85), _view(1, 0.80, 0.0)]
    assert choose(views, REQ, ADM, random.Random(0)) is None
    x = placement_refusal(views, REQ, ADM, fleet_bytes=int(0.85 * CAP), at=1.0)
    assert (x.designated, x.fit, x.fit_without_floor) == (2, 0, 1)
    assert x.cause == FLOOR_REFUSAL
    assert abs(x.floor_sum - 0.85) < 1e-9 and abs(x.load_sum - 0.80) < 1e-9
    assert abs(x.fleet_replicas - 1.0) < 1e-9
    # the room each designated replica had left under the ceiling, with its floor
    assert abs(x.need - 0.2) < 1e-9
    assert abs(x.largest_room - 0.05) < 1e-9 and abs(x.room_sum - 0.05) < 1e-9


def test_full_replicas_are_the_ceilings_refusal_and_none_scraped_its_own() -> None:
    views = [_view(0, 0.80, 0.85), _view(1, 0.80, 0.0), _view(2, 0.0, 0.0)]  # r2 not designated
    x = placement_refusal(views, REQ, ADM, fleet_bytes=0, at=1.0)
    assert (x.designated, x.fit_without_floor) == (2, 0)
    assert x.cause == CEILING_REFUSAL
    assert placement_refusal([], REQ, ADM, fleet_bytes=0, at=0.0).cause == UNSCRAPED_REFUSAL
