"""The emulator-only per-tenant prefix-cache share (``--tenant-cache-share``): a tenant that
churns unique prompts recycles its own cached blocks instead of evicting other tenants'."""

from __future__ import annotations

import random

import pytest

from emulator.__main__ import build_parser
from emulator.engine import Engine, EngineConfig
from emulator.kv import BlockPool
from emulator.profiles import get_profile

SALT_QUIET = "q" * 64
SALT_CHURN = "c" * 64


def run(engine: Engine) -> None:
    for _ in range(100_000):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


def quiet_hit_after_churn(share: float) -> int:
    """Cached tokens of the quiet tenant's second request after the churner's flood."""
    engine = Engine(
        get_profile("llama-8b-tp1-h100"),
        EngineConfig(kv_capacity_tokens=16_384, tenant_cache_share=share),
    )
    prompt = list(range(1, 4_001))
    engine.add_request("quiet-1", prompt, 1, cache_salt=SALT_QUIET)
    run(engine)
    for i in range(12):  # 12 unique 3,000-token prompts: more than the whole cache
        base = 1_000_000 * (i + 1)
        engine.add_request(f"churn-{i}", range(base, base + 3_000), 1, cache_salt=SALT_CHURN)
        run(engine)
    engine.pool.check_invariants()
    second = engine.add_request("quiet-2", [*prompt, 7, 8, 9], 1, cache_salt=SALT_QUIET)
    run(engine)
    return second.num_cached_tokens


def test_without_a_share_the_churner_flushes_the_quiet_tenant() -> None:
    assert quiet_hit_after_churn(0.0) == 0


def test_with_a_share_the_quiet_tenants_prefix_survives() -> None:
    assert quiet_hit_after_churn(0.5) == 4_000


def test_pool_bookkeeping_holds_under_random_traffic() -> None:
    rng = random.Random(4)
    pool = BlockPool(200, tenant_cache_share=0.3)
    held: list[list[int]] = []
    next_hash = 1
    for _ in range(3_000):
        if held and (rng.random() < 0.5 or pool.num_free < 10):
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks[::-1])
        else:
            owner = rng.randrange(3)
            blocks = pool.allocate(rng.randint(1, 8), owner)
            for b in blocks:
                if rng.random() < 0.8:
                    pool.cache_block(b, next_hash, owner)
                    next_hash += 1
            held.append(blocks)
        pool.check_invariants()
        assert all(n <= pool.num_usable for n in pool.owned.values())
    for blocks in held:
        pool.release(blocks[::-1])
    assert pool.reset_prefix_cache()
    pool.check_invariants()
    assert not pool.owned


def test_flag_and_bounds() -> None:
    args = build_parser().parse_args(["--tenant-cache-share", "0.25"])
    assert args.tenant_cache_share == 0.25
    assert build_parser().parse_args([]).tenant_cache_share == 0.0
    with pytest.raises(ValueError, match="tenant_cache_share"):
        BlockPool(10, tenant_cache_share=1.5)
