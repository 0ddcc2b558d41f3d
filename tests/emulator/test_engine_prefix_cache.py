"""Prefix caching: chained block hashes, salt isolation, block-aligned hits, LRU eviction."""

from __future__ import annotations

import pytest

from emulator.engine import Engine

from .conftest import run_until_idle, small_engine


def serve(engine: Engine, request_id: str, tokens: list[int], salt: str | None = None) -> int:
    req = engine.add_request(request_id, tokens, 4, cache_salt=salt, ignore_eos=True)
    run_until_idle(engine)
    return req.num_cached_tokens


SYSTEM = list(range(1000, 1000 + 200))  # a 200-token shared prefix (12.5 blocks)


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (203, 192),  # block-aligned: 12 full blocks of the shared prompt
        (208, 192),  # 13 full blocks, but the hit is capped at prompt_len - 1 = 207
        (209, 208),
    ],
)
def test_hits_are_block_aligned_and_capped(length: int, expected: int) -> None:
    engine = small_engine()
    prompt = list(range(1000, 1000 + length))
    assert serve(engine, "first", prompt) == 0
    assert serve(engine, "again", prompt) == expected


def test_only_the_shared_prefix_hits() -> None:
    engine = small_engine()
    serve(engine, "a", SYSTEM + [1, 2, 3])
    assert serve(engine, "b", SYSTEM + [7, 8, 9, 10]) == 192
    assert serve(engine, "c", [5] + SYSTEM) == 0  # chained from the first block: no hit


def test_hits_only_within_the_same_salt() -> None:
    engine = small_engine()
    serve(engine, "a1", SYSTEM + [1], salt="tenant-a")
    assert serve(engine, "b1", SYSTEM + [1], salt="tenant-b") == 0
    assert serve(engine, "none", SYSTEM + [1], salt=None) == 0
    assert serve(engine, "a2", SYSTEM + [2], salt="tenant-a") == 192
    assert serve(engine, "b2", SYSTEM + [2], salt="tenant-b") == 192
    stats = engine.stats
    assert stats.prefix_cache_hits == 2 * 192
    assert stats.prefix_cache_queries == 5 * 201


def test_unreferenced_cached_blocks_count_as_free_and_evict_lru() -> None:
    engine = small_engine(kv_capacity_tokens=30 * 16)  # 29 usable blocks
    serve(engine, "old", SYSTEM + [1])
    assert engine.pool.num_used == 0 and engine.kv_usage() == 0.0  # cached but free
    assert len(engine.pool.cached) >= 12
    serve(engine, "other", list(range(50_000, 50_000 + 400)))  # 25 blocks: evicts most
    assert serve(engine, "old-again", SYSTEM + [1]) < 192


def test_shared_blocks_are_referenced_once_per_holder() -> None:
    engine = small_engine()
    a = engine.add_request("a", SYSTEM + [1], 50, ignore_eos=True)
    engine.step()
    b = engine.add_request("b", SYSTEM + [2], 50, ignore_eos=True)
    engine.step()
    shared = set(a.blocks) & set(b.blocks)
    assert len(shared) == 12
    assert all(engine.pool.ref_cnt[block] == 2 for block in shared)
    engine.abort("a")
    assert all(engine.pool.ref_cnt[block] == 1 for block in shared)
    run_until_idle(engine)
    assert engine.pool.num_used == 0
