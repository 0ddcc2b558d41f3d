"""Scheduler behaviour as vLLM's V1 scheduler has it (emulator/README.md), driven through the
Engine in model time."""

from __future__ import annotations

import statistics

import pytest

from emulator.engine import RUNNING, WAITING, Request

from .conftest import run_until_idle, small_engine


def prompt(index: int, length: int) -> list[int]:
    return [10_000 + index * 1_000 + t for t in range(length)]


def test_overcommit_preempts_and_everything_still_completes() -> None:
    engine = small_engine(kv_capacity_tokens=64 * 16)  # 63 usable blocks
    reqs = [engine.add_request(f"r{i}", prompt(i, 100), 300, ignore_eos=True) for i in range(6)]
    run_until_idle(engine)
    assert engine.stats.num_preemptions > 0
    assert engine.stats.recomputed_tokens > 0
    assert all(r.finish_reason == "length" and r.num_output == 300 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == engine.stats.num_preemptions
    assert engine.pool.num_used == 0


def test_priority_policy_preempts_the_largest_priority_value() -> None:
    engine = small_engine(kv_capacity_tokens=17 * 16, scheduling_policy="priority")
    low = engine.add_request("important", prompt(0, 64), 200, priority=0, ignore_eos=True)
    high = engine.add_request("cheap", prompt(1, 64), 200, priority=5, ignore_eos=True)
    preempted: list[Request] = []
    while engine.has_work() and not preempted:
        preempted = engine.step().preempted
    assert preempted == [high]
    assert low.num_preemptions == 0


def test_fcfs_policy_preempts_the_last_running_request() -> None:
    engine = small_engine(kv_capacity_tokens=17 * 16, scheduling_policy="fcfs")
    first = engine.add_request("first", prompt(0, 64), 200, priority=9, ignore_eos=True)
    last = engine.add_request("last", prompt(1, 64), 200, priority=0, ignore_eos=True)
    preempted: list[Request] = []
    while engine.has_work() and not preempted:
        preempted = engine.step().preempted
    assert preempted == [last]  # priority is ignored under fcfs
    assert first.num_preemptions == 0


def test_no_admissions_in_a_step_that_preempted() -> None:
    engine = small_engine(kv_capacity_tokens=20 * 16, max_num_batched_tokens=2048)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(i, 40), 150, ignore_eos=True)
    seen_preemption = False
    while engine.has_work():
        before = {r.request_id for r in engine.running}
        result = engine.step()
        if result.preempted:
            seen_preemption = True
            after = {r.request_id for r in engine.running}
            assert after <= before
    assert seen_preemption


def test_admission_needs_the_whole_prompt_to_fit() -> None:
    engine = small_engine(kv_capacity_tokens=41 * 16, max_num_batched_tokens=64)
    engine.add_request("resident", prompt(0, 320), 500, ignore_eos=True)  # 20 blocks
    for _ in range(6):
        engine.step()
    big = engine.add_request("big", prompt(1, 400), 10, ignore_eos=True)  # needs 25 blocks
    free_before = engine.pool.num_free
    assert 0 < free_before < 25  # a 64-token chunk would fit, the whole prompt would not
    for _ in range(10):
        engine.step()
        assert big.status == WAITING and not big.blocks


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = small_engine(max_num_batched_tokens=8192)
    req = engine.add_request("long", prompt(0, 20_000), 5, ignore_eos=True)
    chunks = []
    while req.num_output == 0:
        result = engine.step()
        chunks.append(result.num_scheduled_tokens)
    assert chunks == [8192, 8192, 20_000 - 2 * 8192]
    decoder = engine.add_request("short", prompt(1, 10), 5, ignore_eos=True)
    result = engine.step()  # decode of "long" shares the budget with the newcomer's prefill
    assert result.num_scheduled_tokens == 1 + 10 and decoder.num_output == 1


def test_max_num_seqs_caps_the_running_set() -> None:
    engine = small_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", prompt(i, 20), 20, ignore_eos=True)
    while engine.has_work():
        engine.step()
        assert engine.num_running <= 2


def test_priority_policy_admits_lower_values_first() -> None:
    engine = small_engine(max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("late-but-urgent-0", prompt(0, 20), 3, priority=5, ignore_eos=True)
    urgent = engine.add_request("urgent", prompt(1, 20), 3, priority=-1, ignore_eos=True)
    engine.step()
    assert engine.running == [urgent]


def test_preempted_request_recomputes_with_prefix_cache_help() -> None:
    engine = small_engine(kv_capacity_tokens=40 * 16, scheduling_policy="fcfs")
    keeper = engine.add_request("keeper", prompt(0, 200), 300, ignore_eos=True)
    victim = engine.add_request("victim", prompt(1, 150), 300, ignore_eos=True)
    while victim.num_preemptions == 0:
        engine.step()
    assert victim.status == WAITING and victim.num_computed == 0 and not victim.blocks
    # Its freed blocks keep their hashes: the prompt and the output so far are still cached.
    lost_tokens = victim.max_computed
    cached = engine.pool.lookup(victim.block_hashes, len(victim.block_hashes))
    assert len(cached) * 16 > victim.prompt_len
    cached_at_first_admission = victim.num_cached_tokens
    hits_before = engine.stats.prefix_cache_hits
    run_until_idle(engine)
    assert keeper.num_output == victim.num_output == 300
    assert engine.stats.recomputed_tokens < lost_tokens  # cache hits spared part of the redo
    # Re-admission is not a new prefix-cache query, and num_cached_tokens keeps its first value.
    assert engine.stats.prefix_cache_hits == hits_before
    assert victim.num_cached_tokens == cached_at_first_admission


def test_abort_frees_blocks_immediately() -> None:
    engine = small_engine()
    req = engine.add_request("a", prompt(0, 500), 100, ignore_eos=True)
    engine.step()
    assert req.status == RUNNING and engine.pool.num_used == 32
    assert engine.abort("a") is req
    assert engine.pool.num_used == 0 and req.finish_reason == "abort"
    assert engine.abort("a") is None
    assert engine.stats.request_success["abort"] == 1


def test_outputs_are_deterministic_per_seed_and_request() -> None:
    def run(engine_seed: int, request_seed: int | None) -> list[int]:
        engine = small_engine(seed=engine_seed)
        req = engine.add_request("x", prompt(0, 50), 2000, seed=request_seed)
        run_until_idle(engine)
        return req.output_token_ids

    assert run(1, None) == run(1, None)
    assert run(1, None) != run(2, None)
    assert run(1, 42) == run(2, 42)  # a seeded request does not depend on the replica's seed
    assert run(1, 42) != run(1, 43)


def test_natural_output_length_fits_the_design_distribution() -> None:
    engine = small_engine(seed=3)
    lengths = [
        engine.add_request(f"r{i}", prompt(i % 50, 30), 100_000).target_len for i in range(4000)
    ]
    quantiles = statistics.quantiles(lengths, n=20)
    assert 270 <= statistics.median(lengths) <= 330  # p50 300
    assert 1_050 <= quantiles[18] <= 1_350  # p95 1,200


def test_max_tokens_caps_and_ignore_eos_runs_to_it() -> None:
    engine = small_engine()
    capped = engine.add_request("capped", prompt(0, 20), 1, seed=1)
    forced = engine.add_request("forced", prompt(1, 20), 700, ignore_eos=True)
    run_until_idle(engine)
    assert capped.num_output == 1 and capped.finish_reason in ("length", "stop")
    assert forced.num_output == 700 and forced.finish_reason == "length"


def test_add_request_validates() -> None:
    engine = small_engine(max_model_len=100)
    with pytest.raises(ValueError):
        engine.add_request("empty", [], 10)
    with pytest.raises(ValueError):
        engine.add_request("too-long", prompt(0, 100), 10)
    req = engine.add_request("clamped", prompt(0, 90), 1000, ignore_eos=True)
    assert req.max_tokens == 10
    with pytest.raises(ValueError):
        engine.add_request("clamped", prompt(0, 5), 10)
