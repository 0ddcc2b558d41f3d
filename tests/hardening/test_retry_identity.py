"""R6's identity of retries through real processes: the retry budget counts only what the
gateway can tell is a retry (gateway/admission/retrymemory.py). A client's
``x-stainless-retry-count`` on fresh requests counts nothing, so it cannot push the fleet's
second line onto other tenants; the openai SDK's own retry after a 503 (the same body) is
counted without the header; the same body from another tenant is not; a retry that reaches
the other gateway process is recognised by the shared mark when it says it is one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import httpx2
import openai
import pytest
import redis

from emulator.testing import SpawnedEmulator
from gateway.admission.quota import retry_key
from tests.admission.procs import GatewayProc, Seeder, Tenant, chat_body, metric
from tests.admission.test_gateway_admission import (  # noqa: F401 - the module's fixtures
    both,
    fast,
    gws,
    post,
    retries_in_window,
    rm,
    slow,
)
from tests.support import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def refusing(fast: SpawnedEmulator) -> Iterator[None]:  # noqa: F811
    """The fast replica answers 503 (overloaded) while the test holds this; the gateway
    admits, then relays an honest 503 (a retryable failure)."""
    faults(fast, refuse=True)
    try:
        yield
    finally:
        faults(fast, refuse=False)


def faults(emu: SpawnedEmulator, *, refuse: bool) -> None:
    httpx.post(
        emu.base_url + "/_emulator/faults", json={"refuse_503": refuse}, timeout=5
    ).raise_for_status()


def fresh_window(rdb: redis.Redis) -> None:
    rdb.delete(retry_key("fast-v1"))  # the fleet's minute starts empty: only this test's


def code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"]) if r.status_code != 200 else "ok"


def test_a_lying_header_on_fresh_requests_counts_nothing_and_sheds_no_one(
    rm: Seeder,  # noqa: F811
    gws: tuple[GatewayProc, GatewayProc],  # noqa: F811
    rdb: redis.Redis,
    fast: SpawnedEmulator,  # noqa: F811
) -> None:
    liar, small = rm.tenant("standard", both()), rm.tenant("standard", both())
    fresh_window(rdb)
    # 40 distinct first attempts, every one marked as the SDK's third retry.
    for i in range(40):
        r = post(gws[i % 2], liar, chat_body("fast", 3 + i, 1), **{"x-stainless-retry-count": "3"})
        assert r.status_code == 200, r.text
    assert retries_in_window(rdb, "fast-v1") == 0  # neither budget saw a retry
    text = httpx.get(gws[0].base_url + "/metrics", timeout=5).text
    assert metric(text, "fairway_gateway_retries_total", by="unconfirmed", header="claimed") >= 20
    # Had they counted, the fleet (40 of 40 admissions retries) would be past 20 % and a
    # small tenant's one genuine retry would be shed by the fleet's line. It is not.
    body = chat_body("fast", 2, 1)
    faults(fast, refuse=True)
    try:
        first = post(gws[0], small, body)
        assert first.status_code == 503 and code(first) != "retry_budget_exhausted"
    finally:
        faults(fast, refuse=False)
    again = post(gws[0], small, body)
    assert again.status_code == 200, again.text
    assert retries_in_window(rdb, "fast-v1") == 1  # and it was counted as the retry it is


def test_the_sdks_retry_after_a_503_is_counted_without_the_header(
    rm: Seeder,  # noqa: F811
    gws: tuple[GatewayProc, GatewayProc],  # noqa: F811
    rdb: redis.Redis,
    fast: SpawnedEmulator,  # noqa: F811
) -> None:
    t = rm.tenant("standard", both())
    fresh_window(rdb)
    seen: list[httpx2.Response] = []

    def strip(request: httpx2.Request) -> None:
        request.headers.pop("x-stainless-retry-count", None)  # the header proves nothing

    def after(response: httpx2.Response) -> None:
        seen.append(response)
        if response.status_code == 503:
            faults(fast, refuse=False)  # the replica recovers while the SDK waits

    http = openai.DefaultHttpxClient(
        event_hooks={"request": [strip], "response": [after]}, timeout=60
    )
    client = openai.OpenAI(
        base_url=gws[0].base_url + "/v1", api_key=t.secret, max_retries=1, http_client=http
    )
    faults(fast, refuse=True)
    try:
        completion = client.chat.completions.create(
            model="fast", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    finally:
        faults(fast, refuse=False)
        http.close()
    assert completion.choices[0].message is not None
    assert [r.status_code for r in seen] == [503, 200]
    assert "x-stainless-retry-count" not in seen[1].request.headers
    assert retries_in_window(rdb, "fast-v1") == 1  # the SDK's retry, by its body alone


def test_the_same_body_from_another_tenant_is_not_a_retry(
    rm: Seeder,  # noqa: F811
    gws: tuple[GatewayProc, GatewayProc],  # noqa: F811
    rdb: redis.Redis,
    refusing: None,
) -> None:
    a, b, c = (rm.tenant("standard", both()) for _ in range(3))
    fresh_window(rdb)
    body = chat_body("fast", 5, 1)
    assert post(gws[0], a, body).status_code == 503  # a's attempt fails
    shared_mark(rdb, a)
    retry_claim = {"x-stainless-retry-count": "1"}
    # Other tenants send the very same bytes, on the same process and on the other, even
    # claiming a retry: first attempts (the mark is a's).
    assert post(gws[0], b, body, **retry_claim).status_code == 503
    assert post(gws[1], c, body, **retry_claim).status_code == 503
    assert retries_in_window(rdb, "fast-v1") == 0
    # a's own retry is one (on the process that answered its failure, header or not).
    assert post(gws[0], a, body).status_code == 503
    assert retries_in_window(rdb, "fast-v1") == 1


def test_a_retry_on_the_other_process_is_recognised_by_the_shared_mark(
    rm: Seeder,  # noqa: F811
    gws: tuple[GatewayProc, GatewayProc],  # noqa: F811
    rdb: redis.Redis,
    refusing: None,
) -> None:
    t: Tenant = rm.tenant("standard", both())
    fresh_window(rdb)
    body = chat_body("fast", 6, 1)
    assert post(gws[0], t, body).status_code == 503
    shared_mark(rdb, t)  # written off the response path
    # The retry reaches the other process (a new connection after the SDK's keep-alive
    # expired) and says it is one: that process asks the shared mark the failure left.
    assert post(gws[1], t, body, **{"x-stainless-retry-count": "2"}).status_code == 503
    assert retries_in_window(rdb, "fast-v1") == 1
    text = httpx.get(gws[1].base_url + "/metrics", timeout=5).text
    assert metric(text, "fairway_gateway_retries_total", by="shared", header="claimed") >= 1
    # Without the header another process cannot tell: a first attempt (its quota applies).
    other = chat_body("fast", 7, 1)
    assert post(gws[0], t, other).status_code == 503
    shared_mark(rdb, t)
    assert post(gws[1], t, other).status_code == 503
    assert retries_in_window(rdb, "fast-v1") == 1


def shared_mark(rdb: redis.Redis, t: Tenant) -> None:
    wait_until(
        lambda: bool(rdb.keys(f"fw:rt:{{{t.tenant_id}}}:*")), 5, 0.02, "the shared retry mark"
    )
