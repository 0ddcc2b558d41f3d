"""Pure units of the gateway: config, errors, token estimate, validation, metrics parsing,
TPOT p95, SSE tracking. No I/O."""

from __future__ import annotations

import math
import time
from collections import deque

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.tokenizer import Tokenizer
from gateway import schema, tokens
from gateway.config import DEV_CACHE_SALT_KEY, DEV_KEY_PEPPER, ConfigError, GatewayConfig
from gateway.errors import BadRequest, capacity_unavailable, jittered_retry_after
from gateway.http import pick_headers, sdk_retry
from gateway.metrics import GatewayMetrics
from gateway.relay import CONTENT, END, ERROR, USAGE, StreamTracker
from gateway.replicas import ReplicaRegistry, ReplicaState, histogram_quantile, parse_metrics
from gateway.upstream import UpstreamClient
from gateway.validation import apply_limits, parse_chat

# -- config -------------------------------------------------------------------------------


def test_dev_defaults_match_the_control_plane() -> None:
    from fairway import env

    assert env.DEV_KEY_PEPPER == DEV_KEY_PEPPER
    assert env.DEV_CACHE_SALT_KEY == DEV_CACHE_SALT_KEY


def test_production_refuses_missing_or_dev_secrets() -> None:
    with pytest.raises(ConfigError, match="FAIRWAY_KEY_PEPPER"):
        GatewayConfig.from_env({"FAIRWAY_ENV": "production", "FAIRWAY_CACHE_SALT_KEY": "x"})
    with pytest.raises(ConfigError, match="development"):
        GatewayConfig.from_env(
            {
                "FAIRWAY_ENV": "production",
                "FAIRWAY_KEY_PEPPER": DEV_KEY_PEPPER,
                "FAIRWAY_CACHE_SALT_KEY": "y",
            }
        )
    config = GatewayConfig.from_env(
        {"FAIRWAY_ENV": "production", "FAIRWAY_KEY_PEPPER": "p", "FAIRWAY_CACHE_SALT_KEY": "s"}
    )
    assert config.key_pepper == b"p" and config.production


def test_config_parses_timeouts_and_rejects_garbage() -> None:
    config = GatewayConfig.from_env(
        {"GATEWAY_UPSTREAM_READ_TIMEOUT_S": "7.5", "KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    )
    assert config.upstream.read == 7.5 and config.kafka_bootstrap == "127.0.0.1:1"
    assert config.key_pepper == DEV_KEY_PEPPER.encode()
    with pytest.raises(ConfigError):
        GatewayConfig.from_env({"GATEWAY_MAX_BODY_BYTES": "lots"})
    with pytest.raises(ConfigError):
        GatewayConfig.from_env({"GATEWAY_DRAIN_DEADLINE_S": "-1"})


# -- errors -------------------------------------------------------------------------------


def test_error_body_is_openai_shaped() -> None:
    error = BadRequest("nope", param="messages", code="invalid_type")
    assert orjson.loads(error.body()) == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_type",
        }
    }
    assert error.status == 400


def test_retry_after_is_jittered_within_bounds() -> None:
    seen = set()
    for _ in range(200):
        headers = jittered_retry_after(5.0, 5.0)
        ms = int(headers["retry-after-ms"])
        assert 5000 <= ms <= 10000
        seen.add(ms)
    assert len(seen) > 50  # no two clients told the same instant (R6)
    error = capacity_unavailable("busy")
    assert error.status == 503 and error.code == "capacity" and "retry-after" in error.headers


# -- token estimate -------------------------------------------------------------------------

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=200)


@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), texts), min_size=1, max_size=6
    )
)
@settings(max_examples=200, deadline=None)
def test_estimate_equals_the_emulator_tokenizer(messages: list[tuple[str, str]]) -> None:
    rendered = [{"role": role, "content": text} for role, text in messages]
    exact = len(Tokenizer().apply_chat_template(rendered))
    assert tokens.prompt_tokens(text for _, text in messages) == exact


def test_estimate_with_text_parts_equals_the_emulator() -> None:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "héllo wörld"},
                        {"type": "text", "text": "again and again"},
                    ],
                }
            ],
        }
    )
    req = parse_chat(body)
    exact = len(Tokenizer().apply_chat_template(orjson.loads(body)["messages"]))
    assert tokens.prompt_tokens(req.message_texts) == exact


# -- validation -----------------------------------------------------------------------------

GOOD = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"", None, "invalid_json"),
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b'{"messages": []}', "model", "missing_required_parameter"),
        (b'{"model": 5, "messages": []}', "model", "invalid_type"),
        (b'{"model": "m"}', "messages", "missing_required_parameter"),
        (b'{"model": "m", "messages": []}', "messages", "empty_array"),
        (b'{"model": "m", "messages": "hi"}', "messages", "invalid_type"),
        (
            b'{"model": "m", "messages": [{"content": "x"}]}',
            "messages[0].role",
            "missing_required_parameter",
        ),
        (
            b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}',
            "messages[0].role",
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": 3}]}',
            "messages[0].content",
            "invalid_type",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user"}]}',
            "messages[0].content",
            "missing_required_parameter",
        ),
        (orjson.dumps({**GOOD, "n": 2}), "n", "unsupported_value"),
        (orjson.dumps({**GOOD, "n": 0}), "n", "invalid_value"),
        (orjson.dumps({**GOOD, "n": "1"}), "n", "invalid_type"),
        (orjson.dumps({**GOOD, "max_tokens": 0}), "max_tokens", "invalid_value"),
        (orjson.dumps({**GOOD, "max_tokens": 1.5}), "max_tokens", "invalid_type"),
        (
            orjson.dumps({**GOOD, "max_completion_tokens": True}),
            "max_completion_tokens",
            "invalid_type",
        ),
        (orjson.dumps({**GOOD, "temperature": 3}), "temperature", "invalid_value"),
        (orjson.dumps({**GOOD, "top_p": "high"}), "top_p", "invalid_type"),
        (orjson.dumps({**GOOD, "stream": "yes"}), "stream", "invalid_type"),
        (
            orjson.dumps({**GOOD, "stream_options": {"include_usage": True}}),
            "stream_options",
            "invalid_value",
        ),
        (
            orjson.dumps({**GOOD, "stream": True, "stream_options": {"x": 1}}),
            "stream_options",
            "unknown_parameter",
        ),
        (orjson.dumps({**GOOD, "stop": ["a"] * 5}), "stop", "invalid_type"),
        (orjson.dumps({**GOOD, "cache_salt": "mine"}), "cache_salt", "unknown_parameter"),
        (orjson.dumps({**GOOD, "priority": -100}), "priority", "unknown_parameter"),
        (orjson.dumps({**GOOD, "logprobs": True}), "logprobs", "unsupported_parameter"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
            b'"seed": 18446744073709551616}',
            "seed",
            "invalid_type",
        ),
    ],
)
def test_parse_rejects_with_param_and_code(body: bytes, param: str | None, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_chat(body)
    assert (info.value.param, info.value.code) == (param, code)
    assert info.value.type == "invalid_request_error"


def test_parse_accepts_openai_client_bodies() -> None:
    req = parse_chat(
        orjson.dumps(
            {
                **GOOD,
                "stream": True,
                "stream_options": {"include_usage": True},
                "n": 1,
                "max_tokens": 10,
                "max_completion_tokens": 20,
                "temperature": 0.5,
                "top_p": 1,
                "seed": 7,
                "stop": "x",
                "user": "u1",
                "metadata": {"a": "b"},
                "store": False,
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "assistant", "content": None},
                    {"role": "user", "content": "hi", "name": "bob"},
                ],
            }
        )
    )
    assert req.stream and req.include_usage
    assert (req.max_tokens, req.max_tokens_param) == (20, "max_completion_tokens")
    assert req.sampling == {"temperature": 0.5, "top_p": 1, "seed": 7, "stop": ["x"]}
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[2] == {"role": "user", "content": "hi", "name": "bob"}


VERSION = schema.ModelVersionRecord(
    version="v1",
    family="f",
    context_length=4096,
    kv_bytes_per_token=1,
    tpot_target_ms=50,
    kv_capacity_tokens=1000,
)
LIMIT = schema.LimitRecord(
    rpm=1, tpm=1, max_context=1000, max_output=100, kv_seconds_cap=1, reserved_kv=0
)


def test_limits_context_and_max_output() -> None:
    req = parse_chat(orjson.dumps(GOOD))
    assert apply_limits(req, VERSION, LIMIT, prompt_tokens=50) == 100
    assert apply_limits(req, VERSION, LIMIT, prompt_tokens=950) == 50  # room left in context
    with pytest.raises(BadRequest) as info:
        apply_limits(req, VERSION, LIMIT, prompt_tokens=1000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    over = parse_chat(orjson.dumps({**GOOD, "max_tokens": 101}))
    with pytest.raises(BadRequest) as info:
        apply_limits(over, VERSION, LIMIT, prompt_tokens=5)
    assert (info.value.param, info.value.code) == ("max_tokens", "invalid_value")
    fits = parse_chat(orjson.dumps({**GOOD, "max_tokens": 100}))
    with pytest.raises(BadRequest) as info:
        apply_limits(fits, VERSION, LIMIT, prompt_tokens=901)
    assert info.value.code == "context_length_exceeded"


# -- upstream body --------------------------------------------------------------------------


def test_upstream_body_always_streams_with_usage_salt_and_priority() -> None:
    client = UpstreamClient(GatewayConfig())
    req = parse_chat(orjson.dumps({**GOOD, "temperature": 0.2}))
    body = orjson.loads(
        client.build_body(req, VERSION, max_tokens=9, priority=2, tenant_id="tenant-a")
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "v1" and body["max_tokens"] == 9 and body["priority"] == 2
    assert body["temperature"] == 0.2
    salt = body["cache_salt"]
    assert 0 < len(salt) <= 128 and not set(salt) & set("/@\\\0")
    assert salt == client.cache_salt("tenant-a") != client.cache_salt("tenant-b")
    # Keyed: the salt is not a plain hash of the tenant id anyone could compute.
    other = UpstreamClient(GatewayConfig(cache_salt_key=b"another key"))
    assert other.cache_salt("tenant-a") != salt


# -- replica metrics ------------------------------------------------------------------------

METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="m"} 90.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
"""


def test_parse_metrics_picks_the_four_series() -> None:
    scrape = parse_metrics(METRICS)
    assert (scrape.kv_usage, scrape.running, scrape.waiting) == (0.25, 3, 1)
    assert scrape.itl_bounds == (0.01, 0.05, 0.1, math.inf)
    assert scrape.itl_counts == (10.0, 90.0, 100.0, 100.0)


def test_parse_metrics_of_the_real_emulator_exposition() -> None:
    from emulator.driver import EngineDriver
    from emulator.engine import Engine
    from emulator.metrics import MetricsRenderer
    from emulator.profiles import get_profile

    engine = Engine(get_profile("llama-8b-tp1-h100"))
    text = MetricsRenderer(engine, "m", EngineDriver(engine, 1.0)).render().decode()
    scrape = parse_metrics(text)
    assert scrape.kv_usage == 0.0 and scrape.running == 0
    assert scrape.itl_bounds and math.isinf(scrape.itl_bounds[-1])


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    bounds = (0.01, 0.05, 0.1, math.inf)
    assert histogram_quantile(0.5, bounds, (10, 90, 100, 100)) == pytest.approx(0.01 + 0.04 * 0.5)
    assert histogram_quantile(0.95, bounds, (10, 90, 100, 100)) == pytest.approx(0.075)
    assert histogram_quantile(0.99, bounds, (0, 0, 0, 5)) == 0.1  # only +Inf: top finite bound
    assert histogram_quantile(0.95, bounds, (0, 0, 0, 0)) is None


def test_tpot_p95_uses_the_window_delta_across_replicas() -> None:
    registry = ReplicaRegistry(GatewayConfig(), GatewayMetrics())
    record = schema.ReplicaRecord("a", "http://127.0.0.1:1", "shared")
    version = schema.ModelVersionRecord(
        version="v1",
        family="f",
        context_length=1,
        kv_bytes_per_token=1,
        tpot_target_ms=50,
        kv_capacity_tokens=1,
        replicas=(record, schema.ReplicaRecord("b", "http://x", "shared")),
    )
    registry.sync(schema.Catalog(families={"f": "v1"}, versions={"v1": version}))
    assert registry.tpot_p95("v1") == (None, math.inf)
    now = time.monotonic()
    bounds = (0.02, 0.04, 0.08, math.inf)
    a: ReplicaState = registry.state("a")  # type: ignore[assignment]
    b: ReplicaState = registry.state("b")  # type: ignore[assignment]
    a.itl_bounds = b.itl_bounds = bounds
    # Old history (fast tokens) outside the 30 s window must not count.
    a.itl_ring = deque(
        [
            (now - 50, (1000, 1000, 1000, 1000)),
            (now - 31, (1000, 1000, 1000, 1000)),
            (now - 0.2, (1000, 1100, 1100, 1100)),
        ]
    )
    # b restarted inside the window: counters went down, its newest counts are the delta.
    b.itl_ring = deque([(now - 20, (500, 500, 500, 500)), (now - 0.1, (0, 0, 100, 100))])
    p95, age = registry.tpot_p95("v1")
    # Window: a +100 in (0.02, 0.04], b 100 in (0.04, 0.08]; p95 is in b's bucket.
    assert p95 == pytest.approx(0.04 + 0.04 * (190 - 100) / 100)
    assert 0.0 <= age < 1.0


# -- SSE tracking ---------------------------------------------------------------------------

ROLE = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'  # noqa: E501
TOKEN = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" kelo"},"logprobs":null,"finish_reason":null}]}'  # noqa: E501
FINAL = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" ba"},"logprobs":null,"finish_reason":"length"}]}'  # noqa: E501
USAGE_CHUNK = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":11,"total_tokens":14,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}'  # noqa: E501


@pytest.mark.parametrize("assemble", [False, True])
def test_tracker_counts_and_assembles(assemble: bool) -> None:
    tracker = StreamTracker(assemble=assemble, started=0.0)
    kinds = [
        tracker.observe(data, float(i + 1))
        for i, data in enumerate([ROLE, TOKEN, TOKEN, FINAL, USAGE_CHUNK, b"[DONE]"])
    ]
    assert kinds == [CONTENT, CONTENT, CONTENT, CONTENT, USAGE, END]
    assert tracker.tokens == 3 and tracker.completion_tokens == 3
    assert tracker.prompt_tokens(99) == 11 and tracker.cached_tokens == 8
    assert tracker.finish_reason == "length" and tracker.done
    assert tracker.ttft_ms() == 2000.0 and tracker.tpot_ms() == 1000.0
    if assemble:
        completion = tracker.completion("llama", 99)
        assert completion["choices"][0]["message"]["content"] == " kelo kelo ba"
        assert completion["usage"]["total_tokens"] == 14 and completion["id"] == "chatcmpl-1"


def test_tracker_without_usage_bills_counted_tokens_and_sees_errors() -> None:
    tracker = StreamTracker(started=0.0)
    for data in (ROLE, TOKEN, TOKEN):
        tracker.observe(data, 1.0)
    assert tracker.completion_tokens == 2 and tracker.prompt_tokens(42) == 42
    assert tracker.observe(b'{"error":{"message":"boom","code":500}}', 2.0) == ERROR
    assert tracker.error == {"message": "boom", "code": 500}
    assert StreamTracker().prompt_tokens(42) == 0  # never prefilled: no prompt billed


def test_sdk_retry_count_marks_retries() -> None:
    assert pick_headers({"headers": [(b"x-stainless-retry-count", b"2")]}).retry_count == b"2"
    assert [sdk_retry(v) for v in (b"1", b"12", b"0", None, b"", b"-1", b"1.5", b"x")] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
    ]
