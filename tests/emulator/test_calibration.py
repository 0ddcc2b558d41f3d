"""The design profiles reproduce docs/design.md §2's arithmetic, measured from the Engine in model
time; the realistic default profiles keep its decode numbers and price prefill at a realised
fraction of peak FLOPs plus attention."""

from __future__ import annotations

import pytest

from emulator.engine import Engine
from emulator.profiles import get_profile

P70 = get_profile("llama-70b-tp4-h100-design")
REAL70 = get_profile("llama-70b-tp4-h100")


def distinct_prompt(index: int, length: int) -> list[int]:
    base = 5000 + index * length
    return list(range(base, base + length))


def test_profile_numbers_match_the_design() -> None:
    assert P70.kv_bytes_per_token == 320 * 1024
    assert P70.kv_capacity_tokens == 565_248  # 172.5 GiB / 320 KiB
    assert P70.num_gpu_blocks == 35_328
    assert P70.block_size == 16
    assert P70.effective_bandwidth == 0.40 * 4 * 3.35e12
    assert (P70.max_num_batched_tokens, P70.max_num_seqs) == (8192, 1024)
    assert P70.tpot_target_ms == 50
    p8 = get_profile("llama-8b-tp1-h100-design")
    assert p8.prefill_tokens_per_s == pytest.approx(60_000)
    assert p8.kv_capacity_tokens == 54 * 1024**3 // (128 * 1024)


def test_prefill_runs_at_28k_tokens_per_second() -> None:
    engine = Engine(P70)
    req = engine.add_request("p", distinct_prompt(0, 4096), 1, ignore_eos=True)
    result = engine.step()
    assert result.num_scheduled_tokens == 4096
    assert 0.140 < result.duration < 0.150  # design: 4,096 tokens in ~146 ms
    assert req.ttft is not None and 0.140 < req.ttft < 0.150


def test_lone_stream_decodes_near_26_ms_per_token() -> None:
    engine = Engine(P70)
    req = engine.add_request("solo", distinct_prompt(0, 500), 200, ignore_eos=True)
    while engine.has_work():
        engine.step()
    assert req.num_output == 200
    assert req.tpot is not None and 0.0255 < req.tpot < 0.0270


def test_seventy_streams_of_1100_context_give_the_design_throughput() -> None:
    engine = Engine(P70)
    for i in range(70):
        engine.add_request(f"r{i}", distinct_prompt(i, 1000), 200, ignore_eos=True)
    decode_time = 0.0
    decode_tokens = 0
    step_times = []
    while engine.has_work():
        result = engine.step()
        if result.num_scheduled_tokens == 70 and result.num_scheduled_seqs == 70:
            decode_time += result.duration
            decode_tokens += len(result.emitted)
            step_times.append(result.duration)
    # Contexts grow 1,000 -> 1,200 during decode: mean ~1,100 tokens.
    per_token = decode_time / len(step_times)
    throughput = decode_tokens / decode_time
    assert 0.030 < per_token < 0.0317  # design: ~31 ms per token
    assert 2_200 < throughput < 2_330  # design: ~2,259 output tok/s per replica


def test_full_cache_decode_step_passes_60_ms() -> None:
    engine = Engine(P70)
    # 560 x 1,000 prompt tokens = 99 % of the 565,248-token budget; decode fills the rest.
    for i in range(560):
        engine.add_request(f"f{i}", distinct_prompt(i, 1000), 2000, ignore_eos=True)
    full_steps = []
    for _ in range(400):
        result = engine.step()
        pure_decode = result.num_scheduled_tokens == result.num_scheduled_seqs
        if pure_decode and engine.kv_usage() > 0.99:
            full_steps.append(result.duration)
        if len(full_steps) >= 20:
            break
    assert len(full_steps) >= 20, "the cache never filled"
    assert min(full_steps) > 0.060  # design: past 60 ms, over the 50 ms TPOT target
    assert min(full_steps) * 1000 > P70.tpot_target_ms


# -- the realistic default ------------------------------------------------------------------


def test_design_prefill_rate_is_all_of_peak_and_the_default_is_not() -> None:
    # The design's 28,000 tok/s x 141.2 GFLOP/token is 99.9 % of 4 x 989 TFLOP/s.
    assert P70.prefill_mfu == pytest.approx(0.999, abs=0.001)
    assert get_profile("llama-8b-tp1-h100-design").prefill_mfu == pytest.approx(0.974, abs=0.001)
    assert 0.5 <= REAL70.prefill_mfu <= 0.65
    assert REAL70.flops_per_token == pytest.approx(141.2e9)
    assert REAL70.attn_flops_per_token_ctx == 4 * 80 * 64 * 128
    assert REAL70.peak_flops == 4 * 989e12
    # Decode is the design's: same weights, KV and realised bandwidth.
    for ctx in (0, 77_000, 565_248):
        assert REAL70.decode_step_seconds(ctx) == P70.decode_step_seconds(ctx)


def test_default_prefill_of_4096_tokens_costs_about_twice_the_design() -> None:
    engine = Engine(REAL70)
    req = engine.add_request("p", distinct_prompt(0, 4096), 1, ignore_eos=True)
    engine.step()
    assert req.ttft is not None
    # 4,096 x 141.2 GFLOP + 2.62 MFLOP x 4,096^2 / 2 at 50 % of 3,956 TFLOP/s = 303 ms.
    assert 0.29 < req.ttft < 0.32


def test_default_128k_prefill_takes_well_over_ten_seconds() -> None:
    engine = Engine(REAL70)
    req = engine.add_request("long", distinct_prompt(0, 128_000), 1, ignore_eos=True)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert steps == 16  # 8,192-token chunks
    assert req.ttft is not None
    # Matmuls 18.1 PFLOP + attention 21.5 PFLOP (more than the matmuls at this length).
    assert 19.0 < req.ttft < 21.0
    assert req.ttft > 4 * 128_000 / 28_000  # the design's 4.6 s, four times over


def test_default_decode_keeps_the_design_calibration() -> None:
    engine = Engine(REAL70)
    req = engine.add_request("solo", distinct_prompt(0, 500), 200, ignore_eos=True)
    while engine.has_work():
        engine.step()
    assert req.tpot is not None and 0.0255 < req.tpot < 0.0270
