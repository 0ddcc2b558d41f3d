"""vLLM's ``--long-prefill-token-threshold`` (a scheduler setting): one long prefill may not
take a step's whole chunk budget, so a short request admitted behind it still prefills."""

from __future__ import annotations

import pytest

from emulator.__main__ import main as emulator_main
from emulator.engine import Engine, EngineConfig, resolve_long_prefill_threshold
from emulator.profiles import get_profile

from .conftest import run_until_idle, small_engine


def prompt(index: int, length: int) -> list[int]:
    return [20_000 + index * 10_000 + t for t in range(length)]


def _short_first_token_step(threshold: int) -> tuple[int, list[int]]:
    """Steps until a 100-token request sent after an 8,000-token one gets its first token,
    and the per-step prefill tokens the long request took meanwhile."""
    engine = small_engine(
        kv_capacity_tokens=20_000,
        max_num_batched_tokens=1_024,
        long_prefill_token_threshold=threshold,
    )
    long = engine.add_request("long", prompt(0, 8_000), 4, ignore_eos=True)
    short = engine.add_request("short", prompt(1, 100), 4, ignore_eos=True)
    long_chunks: list[int] = []
    for step in range(1, 100):
        before = long.num_computed
        engine.step()
        if long.num_computed > before and long.num_computed <= long.prompt_len:
            long_chunks.append(long.num_computed - before)
        if short.num_output:
            return step, long_chunks
    raise AssertionError("short request never got a token")


def test_without_threshold_a_long_prefill_starves_the_short_one() -> None:
    step, chunks = _short_first_token_step(0)
    # vLLM's default (no cap): the long prompt takes every step's whole budget until done.
    assert chunks[0] == 1_024
    assert step >= 8


def test_threshold_leaves_budget_for_a_short_prefill_in_the_same_step() -> None:
    step, chunks = _short_first_token_step(512)
    assert step == 1  # both scheduled in the first step: 512 + 100 <= 1,024
    assert max(chunks) == 512
    engine = small_engine(long_prefill_token_threshold=512, max_num_batched_tokens=1_024)
    long = engine.add_request("long", prompt(2, 3_000), 3, ignore_eos=True)
    run_until_idle(engine)
    assert long.num_output == 3  # capped chunks still complete the prompt


def test_threshold_caps_running_chunks_and_decode_is_unaffected() -> None:
    engine = small_engine(
        kv_capacity_tokens=20_000, max_num_batched_tokens=1_024, long_prefill_token_threshold=300
    )
    a = engine.add_request("a", prompt(0, 2_000), 5, ignore_eos=True)
    b = engine.add_request("b", prompt(1, 2_000), 5, ignore_eos=True)
    result = engine.step()
    assert (a.num_computed, b.num_computed) == (300, 300)  # each capped, 424 of budget unused
    assert result.num_scheduled_tokens == 600
    run_until_idle(engine)
    assert a.num_output == b.num_output == 5


def test_default_follows_vllm() -> None:
    profile = get_profile("llama-8b-tp1-h100")
    assert Engine(profile).long_prefill_token_threshold == 0  # vLLM default: no cap
    two = Engine(profile, EngineConfig(max_num_partial_prefills=2))
    assert two.long_prefill_token_threshold == int(two.max_model_len * 0.04)
    explicit = EngineConfig(max_num_partial_prefills=2, long_prefill_token_threshold=700)
    assert resolve_long_prefill_threshold(explicit, 100_000) == 700
    for bad in (
        EngineConfig(long_prefill_token_threshold=-1),
        EngineConfig(max_num_partial_prefills=0),
        EngineConfig(max_num_partial_prefills=1, max_long_partial_prefills=2),
    ):
        with pytest.raises(ValueError):
            Engine(profile, bad)


def test_cli_rejects_a_negative_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    assert emulator_main(["--long-prefill-token-threshold", "-1"]) == 2
    assert "long_prefill_token_threshold" in capsys.readouterr().err
