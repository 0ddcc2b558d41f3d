"""The long-context hold (gateway/admission/hold.py) without a gateway: the decision, the
per-tenant and process caps, and the loop around admission with a scripted budget. The
told waits are a millisecond or two: every check is on outcomes and their order, not on
how long anything took. Through running gateways: test_gateway_long_context_hold.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.hold import (
    HELD_HEADER,
    HoldEnded,
    HoldPlaces,
    LongContextHold,
    LongContextRefusal,
    Outcome,
    hold_wait_ms,
)
from gateway.config import ConfigError, GatewayConfig
from gateway.errors import RateLimited, retry_after_headers
from gateway.lifecycle import Lifecycle


def refusal(wait_ms: int, clause: str = "slots_full") -> LongContextRefusal:
    return LongContextRefusal(
        "in use",
        wait_ms=wait_ms,
        headers={**retry_after_headers(wait_ms), "x-fairway-refusal-clause": clause},
    )


class Stats:
    def __init__(self) -> None:
        self.ended: list[tuple[Outcome, bool]] = []  # (outcome, held at all)
        self.held_now = 0

    def hold_ended(self, outcome: Outcome, held_s: float | None) -> None:
        self.ended.append((outcome, held_s is not None))

    def holding(self, delta: int) -> None:
        self.held_now += delta


class Budget:
    """A scripted budget: each ask answers the next of ``answers`` (a refusal to raise or
    a ticket to return); ``asks`` counts them."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.asks = 0

    async def ask(self) -> str:
        self.asks += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, str)
        return answer


def never() -> Callable[[], Awaitable[BaseException]]:
    async def wait() -> BaseException:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return wait


def at_once(exc: BaseException) -> Callable[[], Awaitable[BaseException]]:
    async def wait() -> BaseException:
        return exc

    return wait


def hold(
    bound_s: float = 60.0,
    per_tenant: int = 2,
    total: int = 8,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> tuple[LongContextHold, Stats]:
    stats = Stats()
    return LongContextHold(bound_s, HoldPlaces(per_tenant, total), stats, sleep), stats


# -- the decision ------------------------------------------------------------------------


def test_off_never_holds() -> None:
    assert hold_wait_ms(told_ms=2_000, held_ms=0, bound_ms=0, left_ms=900_000) is None
    assert not LongContextHold(0, HoldPlaces(1, 1)).enabled


def test_a_told_wait_within_the_bound_is_held_for_that_wait() -> None:
    assert hold_wait_ms(told_ms=2_000, held_ms=0, bound_ms=10_000, left_ms=900_000) == 2_000
    # the whole hold counts: after 7 s held, 3 s more still fits, 3.5 s does not
    assert hold_wait_ms(told_ms=3_000, held_ms=7_000, bound_ms=10_000, left_ms=900_000) == 3_000
    assert hold_wait_ms(told_ms=3_500, held_ms=7_000, bound_ms=10_000, left_ms=900_000) is None


def test_a_wait_past_the_bound_is_not_held_in_part() -> None:
    """Told 12 s with a 10 s bound: answered at once (the client comes back when the held
    ask would have), not held 10 s and then told 2 s more."""
    assert hold_wait_ms(told_ms=12_000, held_ms=0, bound_ms=10_000, left_ms=900_000) is None


def test_the_request_deadlines_bound_the_hold_too() -> None:
    assert hold_wait_ms(told_ms=2_000, held_ms=0, bound_ms=10_000, left_ms=1_500) is None
    assert hold_wait_ms(told_ms=1_000, held_ms=0, bound_ms=10_000, left_ms=1_500) == 1_000


def test_places_per_tenant_and_in_all() -> None:
    places = HoldPlaces(per_tenant=2, total=3)
    assert places.take("a") and places.take("a")
    assert not places.take("a")  # its own two are taken
    assert places.take("b")
    assert not places.take("c")  # the process's three are taken
    places.give_back("a")
    assert places.of("a") == 1 and places.held == 2
    assert places.take("c")
    for tenant in ("a", "b", "c"):
        places.give_back(tenant)
    assert places.held == 0 and places.of("a") == 0


# -- the loop ----------------------------------------------------------------------------


async def test_held_until_admitted_each_ask_after_its_told_wait() -> None:
    """Each ask again comes after the wait the refusal before it told, as its client's
    retry would: the wait its 503 would have carried (its ``retry-after-ms``), for which
    the budget's ledger recorded the tenant waiting and due back."""
    waits: list[float] = []
    asked_after: list[int] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    h, stats = hold(sleep=sleep)
    budget = Budget(refusal(2), refusal(3), "ticket")
    ask = budget.ask

    async def logged() -> str:
        asked_after.append(len(waits))
        return await ask()

    got, _ = await h.run(refusal(1), logged, tenant="a", left_s=900, ended=never())
    assert got == "ticket" and budget.asks == 3
    assert waits == [0.001, 0.002, 0.003] and asked_after == [1, 2, 3]
    assert stats.ended == [("admitted", True)]
    assert stats.held_now == 0 and h.places.held == 0


async def test_answered_with_its_last_refusal_once_the_next_wait_passes_the_bound() -> None:
    h, stats = hold(bound_s=1.0)
    budget = Budget(refusal(5_000, "kv_full"))  # told 5 s: past the 1 s bound
    with pytest.raises(LongContextRefusal) as raised:
        await h.run(refusal(1), budget.ask, tenant="a", left_s=900, ended=never())
    answer = raised.value
    assert budget.asks == 1
    assert answer.headers["retry-after-ms"] == "5000"  # the last refusal's wait, in full
    assert answer.headers["x-fairway-refusal-clause"] == "kv_full"
    assert HELD_HEADER in answer.headers and "connection" not in answer.headers
    assert stats.ended == [("refused", True)] and h.places.held == 0


async def test_a_first_wait_past_the_bound_is_answered_as_before() -> None:
    h, stats = hold(bound_s=1.0)
    first = refusal(5_000)
    budget = Budget()
    with pytest.raises(LongContextRefusal) as raised:
        await h.run(first, budget.ask, tenant="a", left_s=900, ended=never())
    assert raised.value is first and HELD_HEADER not in first.headers
    assert budget.asks == 0 and stats.ended == [("past_bound", False)]


async def test_the_tenants_cap_turns_the_surplus_into_refusals() -> None:
    h, stats = hold(per_tenant=1)
    gate = asyncio.Event()

    async def ask_after_gate() -> str:
        await gate.wait()
        return "ticket"

    first = asyncio.create_task(
        h.run(refusal(1), ask_after_gate, tenant="a", left_s=900, ended=never())
    )
    await asyncio.sleep(0)  # the first took its place
    assert h.places.of("a") == 1
    surplus = refusal(1)
    with pytest.raises(LongContextRefusal) as raised:
        await h.run(surplus, Budget().ask, tenant="a", left_s=900, ended=never())
    assert raised.value is surplus
    # another tenant still has its place
    other, _ = await h.run(refusal(1), Budget("t-b").ask, tenant="b", left_s=900, ended=never())
    assert other == "t-b"
    gate.set()
    assert (await first)[0] == "ticket"
    assert [o for o, _ in stats.ended] == ["over_cap", "admitted", "admitted"]
    assert h.places.held == 0


async def test_the_process_cap() -> None:
    h, stats = hold(per_tenant=5, total=1)
    h.places.take("x")
    with pytest.raises(LongContextRefusal):
        await h.run(refusal(1), Budget().ask, tenant="a", left_s=900, ended=never())
    assert stats.ended == [("over_cap", False)]


class Gone(Exception):
    pass


async def test_the_client_going_away_ends_the_hold_without_asking_again() -> None:
    h, stats = hold()
    budget = Budget()
    with pytest.raises(Gone):
        await h.run(refusal(60_000 - 1), budget.ask, tenant="a", left_s=900, ended=at_once(Gone()))
    assert budget.asks == 0
    assert stats.ended == [("client_gone", True)] and stats.held_now == 0
    assert h.places.held == 0


async def test_the_drain_answers_the_refusal_and_closes_the_connection() -> None:
    h, stats = hold()
    budget = Budget()
    with pytest.raises(LongContextRefusal) as raised:
        await h.run(refusal(30_000), budget.ask, tenant="a", left_s=900, ended=at_once(HoldEnded()))
    answer = raised.value
    assert budget.asks == 0
    assert answer.headers["connection"] == "close" and HELD_HEADER in answer.headers
    # what is left of the told wait: the client comes back when the ledger expects it
    assert 0 < int(answer.headers["retry-after-ms"]) <= 30_000
    assert stats.ended == [("draining", True)] and h.places.held == 0


async def test_a_cancelled_hold_gives_its_place_back() -> None:
    h, stats = hold()
    task = asyncio.create_task(
        h.run(refusal(60_000 - 1), Budget().ask, tenant="a", left_s=900, ended=never())
    )
    await asyncio.sleep(0)
    assert h.places.of("a") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.places.held == 0 and stats.held_now == 0


async def test_another_refusal_on_a_later_ask_is_answered_with_the_held_time() -> None:
    h, stats = hold()
    quota = RateLimited("slow down", code="rate_limit_exceeded", headers={})
    with pytest.raises(RateLimited) as raised:
        await h.run(refusal(1), Budget(quota).ask, tenant="a", left_s=900, ended=never())
    assert raised.value is quota and HELD_HEADER in quota.headers
    assert stats.ended == [("other", True)]


# -- configuration and the drain signal ------------------------------------------------


def test_the_knob_is_off_by_default_and_validated() -> None:
    cfg = AdmissionConfig()
    assert cfg.long_context_hold_s == 0
    with pytest.raises(ValueError, match="long_context_hold_s"):
        AdmissionConfig(long_context_hold_s=-1)
    with pytest.raises(ValueError, match="long_context_hold_per_tenant"):
        AdmissionConfig(long_context_hold_per_tenant=0)
    on = GatewayConfig.from_env({"GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S": "20"})
    assert on.admission.long_context_hold_s == 20


def test_the_hold_must_end_before_the_requests_maximum_duration() -> None:
    with pytest.raises(ConfigError, match="GATEWAY_MAX_STREAM_S"):
        GatewayConfig.from_env(
            {"GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S": "30", "GATEWAY_MAX_STREAM_S": "30"}
        )


async def test_drain_begun_returns_once_the_drain_begins() -> None:
    life = Lifecycle()
    waiter = asyncio.create_task(life.drain_begun())
    await asyncio.sleep(0)
    assert not waiter.done()
    life.draining = True
    await waiter
    await life.drain_begun()  # at once while draining
