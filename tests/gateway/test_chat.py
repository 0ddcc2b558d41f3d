"""The gateway end to end over loopback: a `python -m gateway` process, emulated replicas,
real Redis and the embedded Kafka-compatible broker; the official ``openai`` client."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from contracts import schema
from emulator.testing import SpawnedEmulator, spawn_emulator
from gateway.admission.idempotency import IdempotencyStore
from tests.gateway.conftest import (
    FAMILY,
    PROFILE,
    VERSION,
    GatewayProcess,
    ReadModelSeeder,
    Tenant,
    UsageLog,
    metric_sum,
    replica_healthy,
    replica_metric,
    set_faults,
)
from tests.support import as_bytes, wait_until

pytestmark = pytest.mark.kafka

SLOW = "llama-8b-slow"
SLOW_VERSION = "llama-8b-slow-2026-05"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something, please."}]


def client_for(gw: GatewayProcess, tenant: Tenant, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gw.base_url + "/v1", api_key=tenant.secret, max_retries=0, timeout=30, **kwargs
    )


@pytest.fixture(scope="module")
def slow_replica(seeder: ReadModelSeeder, gateway: GatewayProcess) -> Iterator[SpawnedEmulator]:
    """Real-time speed: a 400-token generation takes seconds, long enough to act mid-stream."""
    with spawn_emulator(PROFILE, SLOW_VERSION, 1.0) as emu:
        seeder.set_replicas([("slow-1", emu.base_url)], version=SLOW_VERSION, family=SLOW)
        wait_until(lambda: replica_healthy(gateway, "slow-1"), 10, what="slow replica scraped")
        yield emu


def sse_lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


# -- the openai client, unchanged -----------------------------------------------------------


def test_openai_client_json_and_streaming(
    gateway: GatewayProcess, seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    tenant = seeder.tenant()
    client = client_for(gateway, tenant)

    # Each request runs to max_tokens (ignore_eos): the emulator draws a natural end that now
    # and then falls below a small max_tokens, and this test counts the tokens.
    full = {"ignore_eos": True}
    raw = client.chat.completions.with_raw_response.create(
        model=FAMILY, messages=HI, max_tokens=16, extra_body=full
    )
    completion = raw.parse()
    request_id = raw.headers["x-request-id"]
    assert len(request_id) == 32 and completion.id == f"chatcmpl-{request_id}"
    assert completion.object == "chat.completion" and completion.model == VERSION
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (13, 16)

    chunks = list(
        client.chat.completions.create(
            model=VERSION,
            messages=HI,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=full,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 8
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8

    # Without include_usage the upstream usage chunk is not passed on.
    plain = list(
        client.chat.completions.create(
            model=FAMILY, messages=HI, max_tokens=5, stream=True, extra_body=full
        )
    )
    assert all(c.choices and c.usage is None for c in plain)
    assert plain[-1].choices[0].finish_reason == "length"

    events = usage_log.events(tenant.tenant_id, 3)
    assert len(events) == 3
    by_tokens = {e["completion_tokens"]: e for e in events}
    assert set(by_tokens) == {16, 8, 5}
    first = by_tokens[16]
    assert first["request_id"] == request_id and first["model"] == FAMILY
    assert first["model_version"] == VERSION and first["replica_id"] == "r1"
    assert first["api_key_id"] == tenant.key_id and first["prompt_tokens"] == 13
    assert first["finish_reason"] == "length" and first["status"] == 200
    assert first["schema_version"] == 1 and first["is_retry"] is False
    assert first["started_at"].endswith("+00:00") and first["ttft_ms"] > 0
    assert by_tokens[8]["model"] == VERSION  # a pinned version is billed as asked
    # The key's last use reaches the control plane's hash, batched off the hot path.
    stamp = wait_until(
        lambda: as_bytes(seeder.client.hget(schema.KEY_LAST_USED_HASH, tenant.key_id)),
        5,
        what="last-used stamp",
    )
    assert abs(int(stamp) - time.time()) < 60


def test_request_id_accepted_when_well_formed(
    gateway: GatewayProcess, seeder: ReadModelSeeder
) -> None:
    tenant = seeder.tenant()
    headers = {"authorization": f"Bearer {tenant.secret}"}
    body = {"model": FAMILY, "messages": HI, "max_tokens": 2}
    ok = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json=body,
        headers={**headers, "x-request-id": "client-trace.42"},
        timeout=30,
    )
    assert ok.headers["x-request-id"] == "client-trace.42"
    bad = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json=body,
        headers={**headers, "x-request-id": "no spaces <allowed>"},
        timeout=30,
    )
    assert len(bad.headers["x-request-id"]) == 32
    missing = httpx.get(gateway.base_url + "/nope", timeout=5)
    assert missing.status_code == 404 and len(missing.headers["x-request-id"]) == 32


def test_errors_raise_the_right_openai_exceptions(
    gateway: GatewayProcess, seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    tenant = seeder.tenant(max_context=64, max_output=32)
    client = client_for(gateway, tenant)
    with pytest.raises(openai.AuthenticationError) as auth:
        openai.OpenAI(
            base_url=gateway.base_url + "/v1", api_key="fw-not-a-key", max_retries=0
        ).chat.completions.create(model=FAMILY, messages=HI)
    assert auth.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=HI)
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):  # a family this tenant has no limits for
        client.chat.completions.create(model=SLOW, messages=HI)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=FAMILY, messages=[{"role": "user", "content": "word " * 100}]
        )
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=FAMILY, messages=HI, max_tokens=33)
    assert (too_many.value.code, too_many.value.param) == ("invalid_value", "max_tokens")
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(model=FAMILY, messages=HI, n=2)
    assert n.value.param == "n"
    limited = seeder.tenant(rpm=1)
    client_for(gateway, limited).chat.completions.create(model=FAMILY, messages=HI, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as rate:
        client_for(gateway, limited).chat.completions.create(model=FAMILY, messages=HI)
    assert rate.value.code == "rate_limit_exceeded" and "retry-after" in rate.value.response.headers
    with pytest.raises(openai.APIStatusError) as large:
        client.chat.completions.create(
            model=FAMILY, messages=[{"role": "user", "content": "x" * (1 << 20)}]
        )
    assert large.value.status_code == 413
    reader = seeder.tenant(scopes=("models:read",))
    with pytest.raises(openai.PermissionDeniedError) as scope:
        client_for(gateway, reader).chat.completions.create(model=FAMILY, messages=HI)
    assert scope.value.code == "insufficient_scope"
    suspended = seeder.tenant(suspended=True)
    with pytest.raises(openai.PermissionDeniedError):
        client_for(gateway, suspended).chat.completions.create(model=FAMILY, messages=HI)
    expired = seeder.tenant(expires_at=int(time.time()) - 1)
    with pytest.raises(openai.AuthenticationError):
        client_for(gateway, expired).chat.completions.create(model=FAMILY, messages=HI)
    # Refusals are counted, never billed.
    usage_log.settle(1.0)
    assert tenant.tenant_id not in usage_log.by_tenant
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=5).text
    assert f'requests_total{{model="-",status="404",tenant="{tenant.tenant_id}"}}' in metrics


def test_no_healthy_replica_is_a_jittered_503(
    gateway: GatewayProcess, seeder: ReadModelSeeder
) -> None:
    seeder.set_replicas([("dead-1", "http://127.0.0.1:9")], version="dead-2026", family="dead")
    tenant = seeder.tenant(families=("dead",))
    client = client_for(gateway, tenant)
    wait_until(
        lambda: (
            "dead-2026"
            in httpx.get(
                gateway.base_url + "/v1/models",
                headers={"authorization": f"Bearer {tenant.secret}"},
                timeout=5,
            ).text
        ),
        5,
        what="catalog reload",
    )
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="dead", messages=HI)
    assert info.value.status_code == 503 and info.value.code == "capacity"
    headers = info.value.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1000


def test_models_lists_only_what_the_key_may_use(
    gateway: GatewayProcess, seeder: ReadModelSeeder
) -> None:
    tenant = seeder.tenant()
    ids = [m.id for m in client_for(gateway, tenant).models.list()]
    assert ids == [FAMILY, VERSION]
    chat_only = seeder.tenant(scopes=("chat",))
    with pytest.raises(openai.PermissionDeniedError):
        client_for(gateway, chat_only).models.list()


def test_health_ready_and_metrics(gateway: GatewayProcess) -> None:
    assert httpx.get(gateway.base_url + "/healthz", timeout=5).json() == {"status": "ok"}
    ready = httpx.get(gateway.base_url + "/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["problems"] == []
    text = httpx.get(gateway.base_url + "/metrics", timeout=5).text
    for name in (
        "fairway_gateway_requests_total",
        "fairway_gateway_ttft_seconds_bucket",
        "fairway_gateway_tpot_seconds_bucket",
        "fairway_gateway_usage_spool_depth",
        "fairway_gateway_readmodel_cache_total",
        "fairway_gateway_replica_healthy",
    ):
        assert name in text, name


def test_streams_awaiting_first_token_are_counted_until_it_is_relayed(
    gateway: GatewayProcess, seeder: ReadModelSeeder, replica: SpawnedEmulator
) -> None:
    """The count that makes mid-stream relays give way to first tokens
    (gateway/upstream/exchange.py) covers exactly the streams before their first token, whatever
    their ending."""
    tenant = seeder.tenant()
    headers = {"authorization": f"Bearer {tenant.secret}"}
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": FAMILY, "messages": HI, "max_tokens": 5, "stream": True}

    def awaiting() -> float:
        return metric_sum(gateway.base_url, "fairway_gateway_streams_awaiting_first_token")

    def stream() -> list[str]:
        with httpx.stream("POST", url, headers=headers, json=body, timeout=30) as response:
            assert response.status_code == 200
            return list(sse_lines(response))

    wait_until(lambda: awaiting() == 0, 10, what="no stream awaiting its first token")
    try:
        set_faults(replica, extra_latency_ms=3000)  # the replica takes 3 s to start
        result: list[list[str]] = []
        patient = threading.Thread(target=lambda: result.append(stream()))
        patient.start()
        wait_until(lambda: awaiting() == 1, 5, interval=0.02, what="the stream counted")
        # A client that gives up before its first token is counted, then uncounted.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, headers=headers, json=body, timeout=httpx.Timeout(5, read=0.3))
        # (well before the first stream's first token, which would also make it 1)
        wait_until(lambda: awaiting() == 1, 1, interval=0.02, what="the leaver uncounted")
        patient.join(30)
        assert result and result[0][-1] == "[DONE]"
        assert any(orjson.loads(d)["choices"][0]["delta"].get("content") for d in result[0][:-1])
        wait_until(lambda: awaiting() == 0, 5, interval=0.02, what="the stream uncounted")
        # A stream the replica refuses before its first token (503) is uncounted too.
        set_faults(replica, extra_latency_ms=0, refuse_503=True)
        refused = httpx.post(url, headers=headers, json=body, timeout=30)
        assert refused.status_code == 503
        assert awaiting() == 0
    finally:
        set_faults(replica, extra_latency_ms=0, refuse_503=False)


# -- the configuration store under a burst of cold keys -------------------------------------


async def test_over_a_hundred_concurrent_cold_requests_all_authenticate(
    gateway: GatewayProcess, seeder: ReadModelSeeder
) -> None:
    """150 requests at once, each with a key the gateway has never seen (150 key reads and
    tenant reads in flight against the shared Redis pool of 100), then 150 at once with one
    new key (one read: concurrent misses share it). None may be refused for want of a
    connection (the pool blocks briefly instead)."""
    fresh = [seeder.tenant() for _ in range(150)]
    one_key = seeder.tenant()
    body = {"model": VERSION, "max_tokens": 1, "messages": HI}
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(base_url=gateway.base_url, limits=limits, timeout=60) as client:

        async def chat(tenant: Tenant) -> httpx.Response:
            headers = {"authorization": f"Bearer {tenant.secret}"}
            return await client.post("/v1/chat/completions", json=body, headers=headers)

        for wave in (fresh, [one_key] * 150):
            responses = await asyncio.gather(*(chat(t) for t in wave))
            refused = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
            assert not refused, refused


# -- revocation -----------------------------------------------------------------------------


def test_revoked_key_is_refused_within_one_second(
    gateway: GatewayProcess, seeder: ReadModelSeeder
) -> None:
    tenant = seeder.tenant()
    headers = {"authorization": f"Bearer {tenant.secret}"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=5) as client:
        wait_until(lambda: client.get("/v1/models").status_code == 200, 5, what="key live")
        assert client.get("/v1/models").status_code == 200  # cached now
        revoked_at = time.monotonic()
        seeder.revoke(tenant)
        wait_until(
            lambda: client.get("/v1/models").status_code == 401,
            1.0,
            interval=0.005,
            what="the revoked key refused",
        )
        elapsed = time.monotonic() - revoked_at
    assert elapsed < 1.0


# -- disconnect, crash, failures ------------------------------------------------------------


def test_client_disconnect_frees_replica_kv_and_bills_partial(
    gateway: GatewayProcess,
    seeder: ReadModelSeeder,
    slow_replica: SpawnedEmulator,
    usage_log: UsageLog,
) -> None:
    tenant = seeder.tenant(families=(SLOW,), max_output=2000)
    body = {"model": SLOW, "messages": HI, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    wait_until(
        lambda: (
            httpx.get(
                gateway.base_url + "/v1/models",
                timeout=5,
                headers={"authorization": f"Bearer {tenant.secret}"},
            ).status_code
            == 200
        ),
        5,
        what="key live",
    )
    probe = httpx.Client(timeout=5)  # a warm connection: polling must not skew the timing
    with (
        httpx.Client(base_url=gateway.base_url, timeout=30) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {tenant.secret}"},
        ) as response,
    ):
        assert response.status_code == 200
        lines = sse_lines(response)
        for _ in range(6):  # the role chunk and five tokens
            next(lines)
        assert replica_metric(slow_replica, "vllm:num_requests_running") == 1
        assert replica_metric(slow_replica, "vllm:kv_cache_usage_perc") > 0
        assert _idle(slow_replica, probe) is None
        closed_at = time.monotonic()
        response.close()  # the client goes away mid-stream
    state = wait_until(
        lambda: _idle(slow_replica, probe), 2.0, interval=0.001, what="replica aborted the request"
    )
    freed_after = time.monotonic() - closed_at
    probe.close()
    assert state["kv_cache_usage"] == 0.0
    print(f"replica freed the KV {freed_after * 1000:.1f} ms after the client left")
    assert freed_after < 0.1  # freed within 100 ms of the disconnect; measured 3-7 ms here
    event = usage_log.events(tenant.tenant_id, 1)[0]
    assert event["finish_reason"] == "cancelled" and event["status"] == 200
    assert 5 <= event["completion_tokens"] < 200
    assert event["prompt_tokens"] == 13


def _idle(emu: SpawnedEmulator, client: httpx.Client) -> dict[str, Any] | None:
    state: dict[str, Any] = client.get(emu.base_url + "/_emulator/state").json()
    return state if state["live_requests"] == 0 and state["num_running"] == 0 else None


def test_replica_crash_mid_stream_ends_with_error_and_done(
    gateway: GatewayProcess, seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    with spawn_emulator(PROFILE, "crashy-2026", 5.0, crash_after_tokens=20) as crashy:
        seeder.set_replicas([("crashy-1", crashy.base_url)], version="crashy-2026", family="crashy")
        tenant = seeder.tenant(families=("crashy",), max_output=500)
        headers = {"authorization": f"Bearer {tenant.secret}"}
        wait_until(
            lambda: (
                httpx.get(gateway.base_url + "/readyz", timeout=5).status_code == 200
                and "crashy-2026"
                in httpx.get(gateway.base_url + "/v1/models", headers=headers, timeout=5).text
            ),
            10,
            what="crashy replica in the catalog",
        )
        wait_until(lambda: replica_healthy(gateway, "crashy-1"), 10, what="crashy scraped")
        started = time.monotonic()
        with httpx.stream(
            "POST",
            gateway.base_url + "/v1/chat/completions",
            headers=headers,
            json={
                "model": "crashy",
                "messages": HI,
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            },
            timeout=30,
        ) as response:
            assert response.status_code == 200
            data = list(sse_lines(response))
        assert time.monotonic() - started < 10  # never hangs
        wait_until(lambda: crashy.returncode is not None, 10, what="crashed emulator exit")
    assert data[-1] == "[DONE]"
    error = orjson.loads(data[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_error"
    tokens = [orjson.loads(d) for d in data[:-2]]
    assert 1 <= sum(1 for t in tokens if t["choices"][0]["delta"].get("content")) <= 21
    event = usage_log.events(tenant.tenant_id, 1)[0]
    assert event["finish_reason"] == "error" and event["status"] == 200
    assert event["replica_id"] == "crashy-1" and event["completion_tokens"] >= 1


def test_replica_errors_before_and_after_first_token(
    gateway: GatewayProcess, seeder: ReadModelSeeder, replica: SpawnedEmulator, usage_log: UsageLog
) -> None:
    tenant = seeder.tenant()
    client = client_for(gateway, tenant)
    try:
        set_faults(replica, refuse_503=True)
        with pytest.raises(openai.InternalServerError) as busy:
            client.chat.completions.create(model=FAMILY, messages=HI, stream=True)
        assert busy.value.status_code == 503 and "retry-after" in busy.value.response.headers
        set_faults(replica, refuse_503=False, fail_after_tokens=3)
        # ignore_eos: a natural end drawn at 3 tokens or fewer would finish before the fault.
        with httpx.stream(
            "POST",
            gateway.base_url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {tenant.secret}"},
            json={
                "model": FAMILY,
                "messages": HI,
                "max_tokens": 50,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=30,
        ) as response:
            assert response.status_code == 200
            data = list(sse_lines(response))
        assert data[-1] == "[DONE]" and "error" in orjson.loads(data[-2])
        with pytest.raises(openai.APIStatusError) as failed:  # JSON: an honest status
            client.chat.completions.create(
                model=FAMILY, messages=HI, max_tokens=50, extra_body={"ignore_eos": True}
            )
        assert failed.value.status_code == 502
    finally:
        set_faults(replica, refuse_503=False, fail_after_tokens=None)
    events = usage_log.events(tenant.tenant_id, 3)
    assert sorted((e["status"], e["finish_reason"]) for e in events) == [
        (200, "error"),
        (502, "error"),
        (503, "error"),
    ]


# -- idempotency ----------------------------------------------------------------------------


def test_idempotent_replay_json_and_sse_without_second_charge(
    gateway: GatewayProcess, seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    tenant = seeder.tenant()
    url = gateway.base_url + "/v1/chat/completions"
    auth = {"authorization": f"Bearer {tenant.secret}"}
    body = orjson.dumps({"model": FAMILY, "messages": HI, "max_tokens": 12})
    first = httpx.post(url, content=body, headers={**auth, "idempotency-key": "json-1"}, timeout=30)
    again = httpx.post(url, content=body, headers={**auth, "idempotency-key": "json-1"}, timeout=30)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"

    stream_body = orjson.dumps(
        {
            "model": FAMILY,
            "messages": HI,
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # runs to max_tokens: the replay below counts 12 tokens
        }
    )
    with httpx.stream(
        "POST", url, content=stream_body, headers={**auth, "idempotency-key": "sse-1"}, timeout=30
    ) as response:
        original = b"".join(response.iter_raw())
    replay = httpx.post(
        url, content=stream_body, headers={**auth, "idempotency-key": "sse-1"}, timeout=30
    )
    assert replay.headers["content-type"].startswith("text/event-stream")
    assert replay.content == original and original.endswith(b"data: [DONE]\n\n")
    # The official client consumes the replayed stream like any other.
    client = client_for(gateway, tenant, default_headers={"idempotency-key": "sse-1"})
    chunks = list(
        client.chat.completions.create(
            model=FAMILY,
            messages=HI,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    with pytest.raises(openai.UnprocessableEntityError) as reused:
        client_for(
            gateway, tenant, default_headers={"idempotency-key": "json-1"}
        ).chat.completions.create(model=FAMILY, messages=HI, max_tokens=13)
    assert reused.value.code == "idempotency_key_reused"
    # The same key is scoped per tenant: another tenant's "json-1" is a fresh request.
    other = seeder.tenant()
    fresh = httpx.post(
        url,
        content=body,
        timeout=30,
        headers={"authorization": f"Bearer {other.secret}", "idempotency-key": "json-1"},
    )
    assert fresh.status_code == 200 and "idempotent-replayed" not in fresh.headers
    usage_log.events(tenant.tenant_id, 2)
    usage_log.settle(1.0)
    assert len(usage_log.by_tenant[tenant.tenant_id]) == 2  # one per generation, no more


def test_idempotency_conflict_while_in_flight_and_retry_after_failure(
    gateway: GatewayProcess, seeder: ReadModelSeeder, replica: SpawnedEmulator, usage_log: UsageLog
) -> None:
    tenant = seeder.tenant()
    url = gateway.base_url + "/v1/chat/completions"
    headers = {"authorization": f"Bearer {tenant.secret}", "idempotency-key": "slow-1"}
    body = {"model": FAMILY, "messages": HI, "max_tokens": 4}
    results: list[httpx.Response] = []
    try:
        set_faults(replica, extra_latency_ms=1500)
        thread = threading.Thread(
            target=lambda: results.append(httpx.post(url, json=body, headers=headers, timeout=30))
        )
        thread.start()
        # the first request holds the key (in flight) before the second arrives
        record = IdempotencyStore.redis_key(tenant.tenant_id, "slow-1")
        wait_until(
            lambda: seeder.client.hget(record, "state") == b"inflight", 10, what="the key held"
        )
        with pytest.raises(openai.ConflictError) as conflict:
            client_for(
                gateway, tenant, default_headers={"idempotency-key": "slow-1"}
            ).chat.completions.create(**body)  # type: ignore[call-overload]
        assert conflict.value.code == "idempotency_key_in_use"
        thread.join(30)
        set_faults(replica, extra_latency_ms=0, refuse_503=True)
        failed = httpx.post(
            url, json=body, timeout=30, headers={**headers, "idempotency-key": "fails-1"}
        )
        assert failed.status_code == 503
    finally:
        set_faults(replica, extra_latency_ms=0, refuse_503=False)
    assert results[0].status_code == 200
    retried = httpx.post(
        url, json=body, headers={**headers, "idempotency-key": "fails-1"}, timeout=30
    )
    assert retried.status_code == 200 and "idempotent-replayed" not in retried.headers
    events = usage_log.events(tenant.tenant_id, 3)
    assert sorted((e["status"], e["is_retry"]) for e in events) == [
        (200, False),
        (200, True),
        (503, False),
    ]


# -- graceful drain -------------------------------------------------------------------------


def test_sigterm_drains_in_flight_streams_then_exits(
    gateways: Callable[..., GatewayProcess],
    kafka_bootstrap: str,
    seeder: ReadModelSeeder,
    slow_replica: SpawnedEmulator,
    usage_log: UsageLog,
) -> None:
    gw = gateways(kafka_bootstrap, workers=2)
    tenant = seeder.tenant(families=(SLOW,), max_output=2000)
    data: list[str] = []
    try:
        with (
            httpx.Client(base_url=gw.base_url, timeout=30) as client,
            client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": SLOW,
                    "messages": HI,
                    "max_tokens": 150,
                    "ignore_eos": True,
                    "stream": True,
                },
                headers={"authorization": f"Bearer {tenant.secret}"},
            ) as response,
        ):
            lines = sse_lines(response)
            data.append(next(lines))
            gw.process.send_signal(signal.SIGTERM)
            # New connections are refused while the stream carries on.
            wait_until(lambda: _refused(gw), 10, what="listener closed")
            data.extend(lines)
        assert gw.process.wait(30) == 0
    finally:
        gw.terminate(5)
    assert data[-1] == "[DONE]"
    assert (
        sum(
            1
            for d in data[:-1]
            if orjson.loads(d)["choices"] and orjson.loads(d)["choices"][0]["delta"].get("content")
        )
        == 150
    )
    event = usage_log.events(tenant.tenant_id, 1)[0]
    assert event["finish_reason"] == "length" and event["completion_tokens"] == 150


def _refused(gw: GatewayProcess) -> bool:
    try:
        response = httpx.get(gw.base_url + "/readyz", timeout=1)
    except httpx.TransportError:
        return True
    return response.status_code == 503
