"""The load generator's client retries: the openai SDK's delay rule, checked case by case and
against the installed SDK's own functions, and retries through a loopback HTTP server."""

from __future__ import annotations

import asyncio
import email.utils
import random
from collections.abc import Iterator

import orjson
import pytest
from aiohttp import web

from bench.loadgen import (
    SDK_MAX_RETRIES,
    LoadGenerator,
    RawResult,
    Target,
    sdk_retry_after,
    sdk_retry_delay,
    sdk_should_retry,
    to_outcome,
)
from bench.stats import GroupStats, Outcome, RetryCounts
from bench.workload import PromptFactory, RequestSpec
from gateway.admission.long_context import REFUSAL_CLAUSE_HEADER

# -- the delay rule --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "250"}, 0.25),
        ({"Retry-After-Ms": "1500", "retry-after": "9"}, 1.5),  # milliseconds first
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "2.5"}, 2.5),  # the SDK allows fractions
        ({"retry-after-ms": "soon", "retry-after": "4"}, 4.0),  # unreadable ms: seconds next
        ({}, None),
        ({"retry-after": "later"}, None),
        ({"retry-after": "1e999"}, 121.0),  # overflow: just over the SDK's bound
    ],
)
def test_retry_after_is_read_as_the_sdk_reads_it(
    headers: dict[str, str], expected: float | None
) -> None:
    assert sdk_retry_after(headers) == expected


def test_retry_after_as_an_http_date_is_relative_to_now() -> None:
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert sdk_retry_after({"retry-after": date}, now=now) == 30.0


@pytest.mark.parametrize(
    ("retry_after", "retries_taken", "lo", "hi"),
    [
        (3.0, 0, 3.0, 3.0),  # the server's delay, honoured as it is
        (0.2, 1, 0.2, 0.2),
        (120.0, 0, 120.0, 120.0),  # the SDK's bound is inclusive
        (None, 0, 0.375, 0.5),  # absent: 0.5 s less up to 25 %
        (None, 1, 0.75, 1.0),  # then 1 s
        (None, 2, 1.5, 2.0),
        (None, 10, 6.0, 8.0),  # capped at 8 s
        (0.0, 0, 0.375, 0.5),  # not positive: backoff
        (-5.0, 1, 0.75, 1.0),
        (float("inf"), 0, 0.375, 0.5),  # not finite: backoff
        (500.0, 0, 0.375, 0.5),  # too large (and then not retried at all, below)
    ],
)
def test_retry_delay(retry_after: float | None, retries_taken: int, lo: float, hi: float) -> None:
    rng = random.Random(3)
    for _ in range(50):
        assert lo <= sdk_retry_delay(retry_after, retries_taken, rng) <= hi


@pytest.mark.parametrize(
    ("status", "retry_after", "should_retry", "expected"),
    [
        (503, 5.0, None, True),
        (429, 0.5, None, True),
        (500, None, None, True),
        (408, None, None, True),
        (409, None, None, True),
        (400, None, None, False),
        (401, None, None, False),
        (404, None, None, False),
        (503, 121.0, None, False),  # a wait past the SDK's 120 s is not retried
        (503, 121.0, "true", False),  # ... whatever x-should-retry says
        (503, 120.0, None, True),
        (400, None, "true", True),
        (503, None, "false", False),
        (503, float("inf"), None, True),  # a literal infinity is not "too large"
    ],
)
def test_which_responses_are_retried(
    status: int, retry_after: float | None, should_retry: str | None, expected: bool
) -> None:
    assert sdk_should_retry(status, retry_after, should_retry) is expected


@pytest.fixture
def global_random_state() -> Iterator[None]:
    state = random.getstate()
    yield
    random.setstate(state)


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after-ms": "250"},
        {"retry-after": "3"},
        {"retry-after": "7", "retry-after-ms": "6400"},
        {},
        {"retry-after": "0"},
        {"retry-after": "500"},
        {"retry-after": "1e999"},
        {"retry-after": "nonsense"},
        {"x-should-retry": "false"},
    ],
)
@pytest.mark.parametrize("status", [429, 503, 500, 400])
def test_the_rule_agrees_with_the_installed_sdk(
    headers: dict[str, str], status: int, global_random_state: None
) -> None:
    """The SDK's own ``_calculate_retry_timeout`` and ``_should_retry`` (openai/_base_client.py)
    on the same responses: the same decision and, with the same random draw, the same delay."""
    import httpx2
    from openai import OpenAI
    from openai._models import FinalRequestOptions

    client = OpenAI(api_key="test", base_url="http://127.0.0.1:9/v1")
    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    assert client.max_retries == SDK_MAX_RETRIES
    response = httpx2.Response(status, headers=headers)
    wait = sdk_retry_after(headers)
    assert sdk_should_retry(status, wait, headers.get("x-should-retry")) == client._should_retry(
        response
    )
    for retries_taken in range(SDK_MAX_RETRIES):
        random.seed(retries_taken)  # the SDK draws its jitter from the module's generator
        theirs = client._calculate_retry_timeout(
            SDK_MAX_RETRIES - retries_taken, options, httpx2.Headers(headers)
        )
        ours = sdk_retry_delay(wait, retries_taken, random.Random(retries_taken))
        assert ours == pytest.approx(theirs)


# -- through a loopback server -------------------------------------------------------------


class Server:
    """Answers each request's first ``refusals`` attempts with ``status`` and ``headers``,
    then streams two content chunks; keeps each attempt's arrival (loop clock), retry-count
    header and body."""

    def __init__(
        self, refusals: int, status: int = 503, headers: dict[str, str] | None = None
    ) -> None:
        self.refusals = refusals
        self.status = status
        self.headers = headers if headers is not None else {"retry-after-ms": "50"}
        self.body = '{"error": {}}'
        self.attempts: dict[str, list[tuple[float, str | None, bytes]]] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rid = request.headers["X-Request-Id"]
        seen = self.attempts.setdefault(rid, [])
        seen.append(
            (
                asyncio.get_running_loop().time(),
                request.headers.get("x-stainless-retry-count"),
                body,
            )
        )
        if len(seen) <= self.refusals:
            return web.Response(status=self.status, headers=self.headers, text=self.body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            chunk = {"choices": [{"delta": {"content": text}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _run(
    server: Server,
    specs: list[RequestSpec],
    *,
    retries: int,
    speed: float = 1.0,
    deadline_s: float = 20.0,
) -> tuple[list[RawResult], dict[str, tuple[float, float | None]]]:
    """The load generator against ``server``; also each request's absolute (loop-clock)
    first-attempt send time and first-token time, for comparing with the server's."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    target = Target(f"http://127.0.0.1:{port}/v1/chat/completions")
    gen = LoadGenerator(
        "m", lambda _s: target, PromptFactory(seed=1), speed=speed, client_retries=retries
    )
    absolute: dict[str, tuple[float, float | None]] = {}

    def done(r: RawResult) -> None:
        absolute[r.spec.request_id] = (r.t_sent, r.t_first)

    try:
        raws = await gen.run(specs, deadline_s=deadline_s, on_done=done)
    finally:
        await runner.cleanup()
    return raws, absolute


def _spec(rid: str, at_s: float = 0.0) -> RequestSpec:
    return RequestSpec(rid, "std-1", at_s, 20, 2, 1)


async def test_a_503_is_retried_and_ttft_runs_from_the_first_attempt() -> None:
    server = Server(refusals=1, headers={"retry-after": "1", "retry-after-ms": "80"})
    raws, absolute = await _run(server, [_spec("r1")], retries=2)
    (raw,) = raws
    assert raw.status == 200 and raw.error is None and raw.attempts == 2
    (first, n0, body0), (second, n1, body1) = server.attempts["r1"]
    assert (n0, n1) == ("0", "1") and body0 == body1  # the SDK's labels, the same request
    sent, first_token = absolute["r1"]
    assert first_token is not None
    # timed from the first attempt: sent before the server saw it, first token after the retry
    assert sent <= first < second <= first_token
    o = to_outcome(raw, "standard", speed=1.0)
    assert o.completed and o.attempts == 2 and not o.refused
    assert RetryCounts.of([o]) == RetryCounts(0, 1, 0, 0, 1)


async def test_retries_run_out_and_the_request_is_finally_refused() -> None:
    server = Server(refusals=10, headers={"retry-after-ms": "20"})
    raws, _ = await _run(server, [_spec("r1")], retries=2)
    (raw,) = raws
    assert raw.status == 503 and raw.attempts == 3 == len(server.attempts["r1"])
    o = to_outcome(raw, "standard", speed=1.0)
    assert o.refused and GroupStats.of("t", [o], 1.0).refused_503 == 1
    assert RetryCounts.of([o]) == RetryCounts(0, 0, 1, 0, 2)


@pytest.mark.parametrize(
    ("status", "headers"),
    [(400, {}), (503, {"retry-after": "500"}), (503, {"x-should-retry": "false"})],
)
async def test_responses_the_sdk_does_not_retry(status: int, headers: dict[str, str]) -> None:
    server = Server(refusals=1, status=status, headers=headers)
    raws, _ = await _run(server, [_spec("r1")], retries=2)
    assert raws[0].status == status and raws[0].attempts == 1 == len(server.attempts["r1"])


async def test_no_retries_sends_each_request_once_without_the_sdk_header() -> None:
    server = Server(refusals=1)
    raws, _ = await _run(server, [_spec("r1")], retries=0)
    assert raws[0].status == 503 and raws[0].attempts == 1
    assert [n for _, n, _ in server.attempts["r1"]] == [None]


@pytest.mark.parametrize(
    ("speed", "headers", "retries_taken", "lo", "hi"),
    [
        (1.5, {"retry-after-ms": "800"}, 0, 0.8, 0.8),  # the server's delay, slept as it is
        (3.0, {"retry-after": "2"}, 1, 2.0, 2.0),
        (1.5, {}, 0, 0.375 / 1.5, 0.5 / 1.5),  # the SDK's backoff is model time: ÷ speed
        (3.0, {}, 1, 0.75 / 3, 1.0 / 3),
        (1.5, {"retry-after": "80"}, 0, 80.0, 80.0),  # 120 model s: within the SDK's bound
        (1.5, {"retry-after": "81"}, 0, None, None),  # 121.5 model s: not retried
    ],
)
def test_retry_wait_on_the_wall_clock(
    speed: float, headers: dict[str, str], retries_taken: int, lo: float | None, hi: float | None
) -> None:
    gen = LoadGenerator("m", lambda _s: Target(""), PromptFactory(seed=1), speed=speed,
                        client_retries=2)  # fmt: skip
    wait = gen.retry_wait_s(503, headers, retries_taken)
    if lo is None or hi is None:
        assert wait is None
    else:
        assert wait is not None and lo - 1e-9 <= wait <= hi + 1e-9


async def test_a_retry_wait_does_not_hold_up_later_arrivals() -> None:
    """Open loop: request 2 is due 0.1 s in; request 1's retry waits 3 s. The server sees
    request 2 before request 1's retry."""
    server = Server(refusals=1, headers={"retry-after": "3"})
    raws, _ = await _run(server, [_spec("r1"), _spec("r2", at_s=0.1)], retries=1)
    assert all(r.status == 200 for r in raws)
    (r2_first, _, _) = server.attempts["r2"][0]
    assert server.attempts["r1"][0][0] < r2_first < server.attempts["r1"][1][0]


async def test_the_deadline_cuts_a_retry_wait_which_is_not_a_refusal() -> None:
    server = Server(refusals=1, headers={"retry-after": "60"})
    raws, _ = await _run(server, [_spec("r1")], retries=2, deadline_s=0.5)
    (raw,) = raws
    assert raw.retry_cut and raw.attempts == 1 and raw.cut_at is not None
    assert raw.error is not None and raw.error.startswith("cut off at the arm deadline")
    o = to_outcome(raw, "standard", speed=1.0)
    assert not o.refused and o.ttft_s is not None  # its wait so far, a TTFT lower bound
    g = GroupStats.of("t", [o], 1.0)
    assert (g.refused_503, g.failed) == (0, 1)
    assert RetryCounts.of([o]).cut_waiting == 1


def test_report_counts_retried_and_cut_requests_apart_from_refusals() -> None:
    """bench/nn_multi.py: a request served after retries is served (its TTFT in the p95s);
    one cut off while waiting to retry is neither served nor refused."""
    from bench.nn_multi import evaluate, refused_counts
    from bench.noisy_neighbour import ArmResult, NNConfig, tenants
    from bench.stats import Outcome

    served = [Outcome(f"s{i}", "std-1", "standard", 200, float(i), 0.5, 0.03, 10) for i in range(5)]
    retried = Outcome("r", "std-1", "standard", 200, 6.0, 4.0, 0.03, 10, attempts=3)
    refused = Outcome("x", "std-1", "standard", 503, 7.0, attempts=3)
    cut = Outcome("c", "std-1", "standard", 503, 8.0, 9.0, attempts=2, retry_cut=True)
    outs = [*served, retried, refused, cut]
    assert RetryCounts.of(outs) == RetryCounts(5, 1, 1, 1, 5)
    assert RetryCounts.of(outs).cell() == "5 / 1 / 1 (5 retries, 1 cut waiting)"
    assert (refused_counts(outs, "std-1").r503, GroupStats.of("t", outs, 1.0).failed) == (1, 1)
    cfg = NNConfig(noisy_tenants=1)
    quiet = ArmResult("quiet", served, {}, 0, 1, 10)
    lines, _ = evaluate(ArmResult("c", outs, {}, 0, 1, 10), quiet, cfg, tenants(cfg))
    row = next(line for line in lines if line.startswith("| std-1 |"))
    assert row.endswith("| 5 / 1 / 1 (5 retries, 1 cut waiting) | 5 / 0 / 0 (0 retries) |")


async def test_each_refusal_s_clause_and_wait_are_recorded() -> None:
    """The gateway's long-context 503 names its clause (``x-fairway-refusal-clause``): the
    load generator keeps it and the wait told for every refused attempt, in model seconds
    in the outcome; a refusal without the header records "-"."""
    server = Server(
        refusals=10, headers={"retry-after-ms": "20", REFUSAL_CLAUSE_HEADER: "yield_slot"}
    )
    raws, _ = await _run(server, [_spec("r1")], retries=2)
    (raw,) = raws
    assert raw.refusals == [("yield_slot", 0.02)] * 3
    o = to_outcome(raw, "standard", speed=2.0)
    assert o.refusals == [("yield_slot", 0.04)] * 3
    # a refusal without the header: its error code, else its status
    bare, _ = await _run(Server(refusals=1), [_spec("r2")], retries=2)
    assert bare[0].status == 200 and bare[0].refusals == [("503", 0.05)]
    coded = Server(refusals=1)
    coded.body = '{"error": {"code": "capacity"}}'
    raws, _ = await _run(coded, [_spec("r3")], retries=2)
    assert raws[0].refusals == [("capacity", 0.05)]


def test_the_report_breaks_finally_refused_long_prompts_down_by_clause() -> None:
    """``clause_row``: the non-noisy tenants' long prompts finally refused by the budget per
    seed, by the clause of their last refusal, the waits that told, and every long-context
    refusal of their long prompts (served in the end or not) by clause."""
    from bench.nn_multi import LONG_PROMPT_TOKENS, clause_row

    long = LONG_PROMPT_TOKENS
    err = '{"error": {"code": "long_context_capacity"}}'

    def out(
        rid: str, tenant: str, status: int, clauses: list[str], tokens: int = long,
        cls: str = "standard",
    ) -> Outcome:  # fmt: skip
        return Outcome(rid, tenant, cls, status, 0.0, prompt_tokens=tokens,
                       error=err if status == 503 else None, attempts=len(clauses) + 1,
                       refusals=[(c, 1.5) for c in clauses])  # fmt: skip

    seed7 = [
        out("a", "std-1", 503, ["yield_slot", "slots_full", "slots_full"]),
        out("b", "std-2", 200, ["slot_share"]),  # served after one refusal
        out("c", "noisy-1", 503, ["long_slots_full"] * 3),  # the flooder's: not counted
        out("d", "std-1", 503, ["capacity"] * 3, tokens=100),  # a short prompt: not counted
        out("f", "ent", 200, [], cls="reserved"),  # reserved: not on the budget
    ]
    # another refusal (no clause: its error code) is not one of the budget's
    seed8 = [out("e", "std-2", 503, ["capacity", "yield_slot", "yield_slot"])]
    row = clause_row("1 × c", [seed7, seed8], {"noisy-1"})
    assert row == (
        "| 1 × c | 1 / 1 | 2 of 3 | slots_full 1, yield_slot 1 | 1.5–1.5 | "
        "yield_slot 3, slots_full 2, slot_share 1 |"
    )
