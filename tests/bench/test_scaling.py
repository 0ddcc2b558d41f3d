"""The coarse-grained replica keeps the ratios the noisy-neighbour argument rests on."""

from __future__ import annotations

import pytest

from bench.noisy_neighbour import NNConfig, coarse_profile, tenants, to_coarse
from bench.workload import LogNormal
from contracts.formulas import kv_gib_seconds
from emulator.engine import Engine, EngineConfig
from emulator.profiles import LLAMA_70B_TP4_H100 as REAL

K = 8


def test_kv_bytes_and_occupancy_of_a_128k_prompt_unchanged() -> None:
    c = coarse_profile(REAL, K, 1024)
    assert c.kv_capacity_bytes == pytest.approx(REAL.kv_capacity_bytes, rel=1e-3)
    real_share = 128_000 / REAL.kv_capacity_tokens
    coarse_share = to_coarse(128_000, K) / c.kv_capacity_tokens
    assert coarse_share == pytest.approx(real_share, rel=1e-3)
    assert real_share == pytest.approx(0.23, abs=0.01)  # the design's "23 % of a replica"
    assert c.block_size * K == REAL.block_size
    assert c.max_model_len * K == REAL.max_model_len


def test_step_time_per_real_token_unchanged() -> None:
    c = coarse_profile(REAL, K, 1024)
    for ctx_real in (0, 77_000, 500_000):
        # One emulated decode step = K real decode steps at the same context.
        assert c.decode_step_seconds(ctx_real // K) == pytest.approx(
            K * REAL.decode_step_seconds(ctx_real), rel=1e-9
        )
    # Prefill: the same real tokens per second of compute, attention included (a 128k
    # prompt is 16k emulated tokens at 8x the FLOPs each and 64x per context pair).
    assert c.prefill_tokens_per_s * K == pytest.approx(REAL.prefill_tokens_per_s, rel=1e-12)
    for real_tokens in (4_096, 32_000, 128_000):
        assert c.prefill_seconds(real_tokens // K) == pytest.approx(
            REAL.prefill_seconds(real_tokens), rel=1e-3
        )
    assert REAL.prefill_seconds(128_000) > 10.0


def test_engine_tpot_per_real_token_matches_the_real_profile() -> None:
    """Same batch on both engines: emulated inter-token time / K == real TPOT."""
    c = coarse_profile(REAL, K, 1024)
    tpots = {}
    for name, prof, k in (("real", REAL, 1), ("coarse", c, K)):
        eng = Engine(prof, EngineConfig(enable_prefix_caching=False))
        for i in range(40):
            eng.add_request(f"r{i}", [4096 + i] * (1_600 // k), 400 // k, ignore_eos=True)
        while eng.has_work():
            eng.step()
        tpots[name] = eng.stats.tpot.sum / eng.stats.tpot.count
    assert tpots["coarse"] / K == pytest.approx(tpots["real"], rel=0.1)


def test_gateway_kv_seconds_estimate_is_invariant() -> None:
    real = kv_gib_seconds(6_000, 1_200, 320 * 1024, 0.05)
    coarse = kv_gib_seconds(6_000 // K, 1_200 // K, 320 * 1024 * K, 0.05 * K)
    assert coarse == pytest.approx(real)


def test_scenario_tenants_match_the_brief() -> None:
    specs = tenants(NNConfig())
    plans = [t.plan for t in specs]
    assert plans.count("standard") == 5 and plans.count("enterprise") == 1
    assert plans.count("free") == 1
    noisy = [t for t in specs if t.noisy]
    assert len(noisy) == 1 and noisy[0].prompt.mean() == 128_000
    # The 128k prompt and its largest output fit the model's context.
    output = noisy[0].output
    assert isinstance(output, LogNormal) and 128_000 + output.hi <= REAL.max_model_len
