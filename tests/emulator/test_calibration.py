"""The 70B profile reproduces the design's §2 arithmetic, measured from the Engine in model time."""

from __future__ import annotations

from emulator.engine import Engine
from emulator.profiles import get_profile

P70 = get_profile("llama-70b-tp4-h100")


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
    p8 = get_profile("llama-8b-tp1-h100")
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
