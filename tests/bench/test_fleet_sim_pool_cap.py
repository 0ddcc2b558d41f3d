"""The reserved pool's own --long-prefill-token-threshold in the fleet simulation
(``FleetConfig.pool_long_prefill_tokens``): only the pool's replicas take it, and what it
changes on a replica is the share of a step a long prefill leaves to a prompt beside it."""

from __future__ import annotations

import pytest

from bench import fleet_sim
from bench.fleet_sim import FleetConfig, FleetSim, Scale, isolation_experiments
from emulator.engine import Engine
from emulator.profiles import get_profile
from emulator.replica_flags import platform_engine_config


def _thresholds(cfg: FleetConfig) -> list[int]:
    sim = FleetSim(cfg, get_profile(fleet_sim.PROFILE))
    return [r.engine.long_prefill_token_threshold for r in sim.replicas]


def test_pool_cap_goes_to_the_pool_replicas_only() -> None:
    cfg = FleetConfig(replicas=6, reserved_replicas=2, long_prefill_tokens=5242,
                      pool_long_prefill_tokens=1024)  # fmt: skip
    assert _thresholds(cfg) == [1024, 1024, 5242, 5242, 5242, 5242]
    # unset: the pool runs the shared replicas' threshold; without a pool nothing changes
    assert _thresholds(fleet_sim.replace(cfg, pool_long_prefill_tokens=0)) == [5242] * 6
    assert _thresholds(fleet_sim.replace(cfg, reserved_replicas=0)) == [5242] * 6


def _short_ttft_beside_a_long_prefill(threshold: int) -> float:
    """A 40,000-token prompt prefilling, a 4,000-token one arriving just after it on the
    same replica (an ``Engine`` with the platform's flags): the short one's TTFT."""
    eng = Engine(
        get_profile(fleet_sim.PROFILE),
        platform_engine_config(enable_prefix_caching=False, long_prefill_token_threshold=threshold),
    )
    eng.add_request("long", list(range(1, 40_001)), 4, arrival_time=0.0)
    eng.step()
    short = eng.add_request("short", list(range(7, 4_007)), 4, arrival_time=eng.now)
    while short.ttft is None:
        assert eng.step().duration > 0
    return short.ttft


def test_a_lower_threshold_leaves_more_of_each_step_to_the_prompt_beside_a_long_prefill() -> None:
    """What a lower pool cap buys: with 5,242 the long prefill takes 5,242 of the 8,192-token
    step budget and the short prompt gets the rest (two steps); with 2,048 the short prompt
    fits in the first step it is in."""
    ttft = {c: _short_ttft_beside_a_long_prefill(c) for c in (5242, 2048)}
    assert ttft[2048] < ttft[5242]


def test_pool_caps_add_one_arm_per_pool_and_cap() -> None:
    scale = fleet_sim.replace(Scale.quick(), long_prefill_tokens=5242)
    arms = isolation_experiments(scale, 1, 2, reserved_pools=(3,), pool_caps=(2048, 1024))
    capped = {k: v for k, v in arms.items() if "pool chunk cap" in k}
    assert sorted(capped) == [
        "new, reserved pool 3, pool chunk cap 1,024, 2 heavy tenants",
        "new, reserved pool 3, pool chunk cap 2,048, 2 heavy tenants",
    ]
    for cfg in capped.values():
        assert cfg.reserved_replicas == 3 and cfg.long_prefill_tokens == 5242
        assert cfg.isolation and cfg.pool_long_prefill_tokens in (2048, 1024)
    assert arms["new, reserved pool 3, 2 heavy tenants"].pool_long_prefill_tokens == 0


def test_pool_caps_need_a_pool() -> None:
    with pytest.raises(SystemExit):
        fleet_sim.main(["--isolation", "--quick", "--pool-caps", "2048"])


def test_skip_arm_leaving_no_arm_fails_before_the_sizing_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sizing probes take minutes: an invocation whose --skip-arm leaves no arm to run
    is refused before them, not after."""

    def sized(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sizing probes ran")

    monkeypatch.setattr(fleet_sim, "fleet_sizing", sized)
    with pytest.raises(SystemExit) as refused:
        fleet_sim.main(["--isolation", "--quick", "--size-range", "4,8", "--skip-arm", ""])
    assert refused.value.code == 2


def test_lone_prefill_bands_split_the_feasible_requests_exactly() -> None:
    """The bands of the pooled table partition the promise's requests: together they are
    ``reserved_slo(feasible_only=True)``, request for request and miss for miss."""
    from bench.fleet_sim import LONE_BANDS, pool_slo, reserved_band_slo, reserved_slo

    cfg = FleetConfig(replicas=2, rate_rps=12.0, duration_s=20.0, warmup_s=2.0, gateways=1,
                      drain_s=60.0, class_mix=(1.0, 0.0, 0.0))  # fmt: skip
    res = FleetSim(cfg, get_profile(fleet_sim.PROFILE)).run()
    feasible = reserved_slo(res, feasible_only=True)
    bands = pool_slo([reserved_band_slo(res, lo, hi) for lo, hi in LONE_BANDS])
    assert feasible.n > 100 and feasible.missed > 0  # two replicas overloaded: some misses
    assert (bands.n, bands.met, bands.ttft_missed, bands.tpot_missed) == (
        feasible.n, feasible.met, feasible.ttft_missed, feasible.tpot_missed,
    )  # fmt: skip
    assert reserved_band_slo(res, 0.0, 1.0) == feasible
