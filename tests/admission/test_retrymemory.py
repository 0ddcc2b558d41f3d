"""R6's identity of retries, the pure part: the memory of recent retryable failures is
bounded, aged, scoped to the tenant and its key, and one failure answers for one retry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.retrymemory import RequestPrint, RetryMemory, retryable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def p(tenant: str = "t-a", key: str = "k-1", body: bytes = b'{"model":"m"}') -> RequestPrint:
    return RequestPrint(tenant, key, body)


def test_the_same_body_after_a_failure_is_one_retry() -> None:
    mem = RetryMemory(100, 60.0, Clock())
    assert not mem.take(p())  # a first attempt
    mem.failed(p())
    assert mem.take(p())  # its retry takes the mark
    assert not mem.take(p())  # and only one: the next identical body is a first attempt
    mem.failed(p())
    mem.failed(p())  # two identical requests failed: two retries
    assert [mem.take(p()) for _ in range(3)] == [True, True, False]


def test_tenant_key_and_body_all_scope_the_mark() -> None:
    mem = RetryMemory(100, 60.0, Clock())
    mem.failed(p())
    assert not mem.take(p(tenant="t-b"))  # the same body from another tenant
    assert not mem.take(p(key="k-2"))  # or another key of the same tenant
    assert not mem.take(p(body=b'{"model":"m" }'))  # one byte more
    assert mem.take(p())


def test_a_mark_ages_out_after_the_ttl() -> None:
    clock = Clock()
    mem = RetryMemory(100, 60.0, clock)
    mem.failed(p())
    clock.now += 30.0
    mem.failed(p(body=b"other"))
    clock.now += 29.9
    assert mem.take(p())  # 59.9 s after its failure
    mem.failed(p())  # the retry failed too: a new mark, 60 s from now
    clock.now += 35.0
    assert not mem.take(p(body=b"other"))  # 64.9 s old: gone
    assert len(mem) == 1
    clock.now += 25.0
    assert not mem.take(p()) and len(mem) == 0


def test_a_tenant_key_without_marks_is_answered_without_hashing() -> None:
    mem = RetryMemory(100, 60.0, Clock())
    mem.failed(p(tenant="t-b"))
    fresh = p()
    assert not mem.take(fresh)
    assert fresh._digest is None  # no digest computed: the common case costs a dict lookup


def test_bounded_the_least_recently_failed_go_first() -> None:
    mem = RetryMemory(3, 60.0, Clock())
    for i in range(5):
        mem.failed(p(body=b"%d" % i))
    assert len(mem) == 3
    assert [mem.take(p(body=b"%d" % i)) for i in range(5)] == [False, False, True, True, True]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RetryMemory(0, 60.0)
    with pytest.raises(ValueError):
        RetryMemory(10, 0.0)


def test_retryable_statuses_are_the_sdks() -> None:
    assert [s for s in (200, 400, 401, 404, 408, 409, 422, 429, 499, 500, 503) if retryable(s)] == [
        408,
        409,
        429,
        499,
        500,
        503,
    ]


class Model:
    """The definition: per (tenant, key, body), the failures no retry took yet, alive while
    the latest of them is younger than the TTL (each failure refreshes the mark)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.marks: dict[tuple[str, str, bytes], tuple[float, int]] = {}  # -> (last, count)

    def _live(self, who: tuple[str, str, bytes], now: float) -> int:
        last, count = self.marks.get(who, (0.0, 0))
        return count if count and last + self.ttl > now else 0

    def fail(self, who: tuple[str, str, bytes], now: float) -> None:
        self.marks[who] = (now, self._live(who, now) + 1)

    def take(self, who: tuple[str, str, bytes], now: float) -> bool:
        n = self._live(who, now)
        if n:
            self.marks[who] = (self.marks[who][0], n - 1)
        return n > 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["fail", "take", "tick"]),
        st.sampled_from(["t-a", "t-b", "t-c"]),
        st.sampled_from(["k-1", "k-2"]),
        st.integers(0, 5),  # body
        st.floats(0.0, 40.0),  # seconds to advance on "tick"
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, cap=st.integers(1, 12))
def test_against_the_model_bounded_and_never_more_retries_than_failures(
    ops: list[tuple[str, str, str, int, float]], cap: int
) -> None:
    """Under any interleaving and any bound: never more than ``cap`` entries, a retry only
    for a live failure of the same tenant, key and body (eviction only forgets), and with
    room for everything exactly the model's answers."""
    clock = Clock()
    mem = RetryMemory(cap, 60.0, clock)
    model = Model(60.0)
    evicted = False
    for op, tenant, key, body, dt in ops:
        req = p(tenant, key, b"%d" % body)
        who = (tenant, key, req.body)
        if op == "tick":
            clock.now += dt
        elif op == "fail":
            before = len(mem)
            mem.failed(req)
            model.fail(who, clock.now)
            evicted = evicted or (before == cap and len(mem) == cap)
        else:
            got = mem.take(req)
            expected = model.take(who, clock.now)
            assert got <= expected, (op, who)  # a retry only for a live failure
            if not evicted:
                assert got == expected, (op, who)
        assert len(mem) <= cap
    # Scoped: nothing is recognised for a tenant that never failed.
    assert not mem.take(p("t-never", "k-1", b"0"))
