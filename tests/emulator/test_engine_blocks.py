"""Property-based block accounting: random workloads never corrupt the KV pool.

Invariants after every operation: used blocks within [0, capacity]; every block's refcount
equals the number of live requests holding it; the free queue holds exactly the unreferenced
blocks; a running request holds exactly ceil(computed / block_size) blocks, a waiting one none.
After everything completes, errors or is aborted, every block is free again.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from emulator.engine import RUNNING, WAITING, Engine

from .conftest import small_engine

BLOCK = 16
CAPACITY_BLOCKS = 40


class BlockAccounting(RuleBasedStateMachine):
    engine: Engine

    @initialize(
        policy=st.sampled_from(["priority", "fcfs"]),
        budget=st.sampled_from([16, 48, 512]),
        max_seqs=st.integers(min_value=1, max_value=8),
    )
    def setup(self, policy: str, budget: int, max_seqs: int) -> None:
        self.engine = small_engine(
            scheduling_policy=policy,
            kv_capacity_tokens=CAPACITY_BLOCKS * BLOCK,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
        )
        self.counter = 0
        self.finished_ids: set[str] = set()

    @rule(
        # A small alphabet and shared stems make prefix-cache hits (and shared blocks) common.
        stem=st.sampled_from([(), tuple(range(20)), tuple(range(40)), tuple(range(100, 133))]),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=150),
        max_tokens=st.integers(min_value=1, max_value=120),
        priority=st.integers(min_value=0, max_value=3),
        salt=st.sampled_from([None, "tenant-a", "tenant-b"]),
        ignore_eos=st.booleans(),
    )
    def add(
        self,
        stem: tuple[int, ...],
        tail: list[int],
        max_tokens: int,
        priority: int,
        salt: str | None,
        ignore_eos: bool,
    ) -> None:
        prompt = list(stem) + tail
        if len(prompt) >= self.engine.max_model_len:
            prompt = prompt[: self.engine.max_model_len - 1]
        self.counter += 1
        self.engine.add_request(
            f"r{self.counter}",
            prompt,
            max_tokens,
            priority=priority,
            cache_salt=salt,
            ignore_eos=ignore_eos,
            seed=self.counter,
        )

    @rule(steps=st.integers(min_value=1, max_value=30))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            if not self.engine.has_work():
                break
            result = self.engine.step()
            for req in result.finished:
                assert req.num_output == req.target_len
                assert not req.blocks

    @precondition(lambda self: bool(self.engine.requests))
    @rule(pick=st.integers(min_value=0), reason=st.sampled_from(["abort", "error"]))
    def abort(self, pick: int, reason: str) -> None:
        ids = sorted(self.engine.requests)
        req = self.engine.abort(ids[pick % len(ids)], reason)
        assert req is not None and req.finish_reason == reason and not req.blocks

    @invariant()
    def pool_is_consistent(self) -> None:
        engine = self.engine
        pool = engine.pool
        pool.check_invariants()
        assert 0 <= pool.num_used <= pool.num_usable == CAPACITY_BLOCKS - 1
        assert 0.0 <= engine.kv_usage() <= 1.0
        holders: Counter[int] = Counter()
        for req in engine.requests.values():
            holders.update(req.blocks)
            if req.status == RUNNING:
                assert len(req.blocks) == -(-req.num_computed // BLOCK)
            else:
                assert req.status == WAITING and not req.blocks and req.num_computed == 0
        for block in range(1, pool.num_gpu_blocks):
            assert pool.ref_cnt[block] == holders[block]
        assert pool.num_used == len(holders)
        assert engine.num_running + engine.num_waiting == len(engine.requests)

    def teardown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        # Half the time finish everything naturally, otherwise abort the rest: either way the
        # pool must come back empty.
        if self.counter % 2:
            for _ in range(50_000):
                if not engine.has_work():
                    break
                engine.step()
        for request_id in list(engine.requests):
            engine.abort(request_id)
        assert not engine.requests and not engine.has_work()
        assert engine.pool.num_used == 0
        assert engine.kv_usage() == 0.0
        engine.pool.check_invariants()


BlockAccounting.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockAccounting = BlockAccounting.TestCase
