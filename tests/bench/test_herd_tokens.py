"""The herd's prompts are drawn from its seed: under cache-aware routing their token ids decide
the chain hashes and so the placement keys, so two seeds must be independent draws of them and
one seed must replay the same ones."""

from __future__ import annotations

from bench.herd import HerdConfig, arrivals, prompt_tokens
from gateway.admission.prefix import query_from_tokens

CFG = HerdConfig(duration_s=20.0)


def tokens_of(seed: int) -> list[range]:
    return [
        prompt_tokens(first, n) for _, n, first in arrivals(HerdConfig(seed=seed, duration_s=20.0))
    ]


def test_one_seed_replays_the_same_token_ids() -> None:
    assert arrivals(CFG) == arrivals(CFG)
    assert tokens_of(7) == tokens_of(7)


def test_two_seeds_give_different_token_ids_and_placement_keys() -> None:
    a, b = tokens_of(7), tokens_of(8)
    assert len(a) > 100 and len(b) > 100
    firsts_a, firsts_b = {t[0] for t in a}, {t[0] for t in b}
    assert not firsts_a & firsts_b  # no request of one seed starts like one of the other
    keys = [
        {query_from_tokens("t0", t, "0" * 64, 16).placement_key for t in run[:200]}
        for run in (a, b)
    ]
    assert not keys[0] & keys[1]


def test_within_a_seed_every_prompt_is_its_own_and_the_schedule_is_the_seeds() -> None:
    work = arrivals(CFG)
    assert len({first for _, _, first in work}) == len(work)  # no shared prefix in the herd
    # the token draw comes after the times and lengths: those are the seed's as before
    times = [t for t, _, _ in work]
    assert times == sorted(times) and all(n > 0 for _, n, _ in work)
