"""No request body makes the gateway answer 5xx: fuzzed in-process and over HTTP."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts import schema
from gateway.admission import tokens
from gateway.endpoints.chat import ChatCompletions
from gateway.endpoints.completions import Completions
from gateway.endpoints.validation import (
    COMPLETION_KNOWN,
    KNOWN,
    apply_limits,
    parse_chat,
    parse_completion,
)
from gateway.errors import ApiError
from tests.gateway.conftest import GatewayProcess, ReadModelSeeder

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(
                st.sampled_from(["user", "system", "assistant", "developer", "tool"]), json_values
            ),
            "content": st.one_of(
                st.text(max_size=60),
                json_values,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url"]), "text": json_values}
                    ),
                    max_size=3,
                ),
            ),
        },
        optional={
            "name": json_values,
            "tool_call_id": st.one_of(st.text(max_size=8), json_values),
            "tool_calls": st.one_of(
                json_values,
                st.lists(
                    st.fixed_dictionaries(
                        {"id": json_values, "function": json_values},
                        optional={"type": st.sampled_from(["function", "x"])},
                    ),
                    max_size=2,
                ),
            ),
        },
    ),
    max_size=4,
)
# Near-valid values of the new fields, so the fuzz reaches past their first type check.
schemas = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "string", "nope", 5])},
        optional={"properties": json_values, "required": json_values},
    ),
)
tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "retrieval"]),
        "function": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {"name": st.one_of(st.sampled_from(["f", "get_x", "a b", ""]), json_values)},
                optional={"parameters": schemas, "strict": json_values, "description": json_values},
            ),
        ),
    }
)
new_fields = st.fixed_dictionaries(
    {},
    optional={
        "tools": st.one_of(json_values, st.lists(tool, max_size=3)),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required", "x"]),
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": json_values}),
                }
            ),
            json_values,
        ),
        "parallel_tool_calls": json_values,
        "response_format": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                optional={
                    "json_schema": st.one_of(
                        json_values,
                        st.fixed_dictionaries(
                            {"name": json_values},
                            optional={"schema": schemas, "strict": json_values},
                        ),
                    )
                },
            ),
        ),
        "logprobs": json_values,
        "top_logprobs": st.one_of(st.integers(-2, 30), json_values),
        "n": st.one_of(st.integers(-1, 10), json_values),
        "logit_bias": st.one_of(
            json_values, st.dictionaries(st.text(max_size=6), json_values, max_size=3)
        ),
        "metadata": json_values,
        "service_tier": st.one_of(st.sampled_from(["auto", "default", "flex"]), json_values),
        "store": json_values,
    },
)
field_names = st.sampled_from(sorted(KNOWN) + ["cache_salt", "priority", "tools", "x"])
bodies = st.one_of(
    st.dictionaries(field_names, json_values, max_size=8).map(
        lambda d: {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], **d}
    ),
    st.fixed_dictionaries(
        {
            "model": st.one_of(st.just("llama-8b"), json_values),
            "messages": st.one_of(messages, json_values),
        },
        optional={
            k: json_values for k in ("max_tokens", "n", "stream", "stream_options", "temperature")
        },
    ),
    st.tuples(messages, new_fields).map(
        lambda mf: {
            "model": "llama-8b",
            "messages": mf[0] or [{"role": "user", "content": "x"}],
            **mf[1],
        }
    ),
)
completion_names = st.sampled_from(sorted(COMPLETION_KNOWN) + ["messages", "priority"])
completion_bodies = st.one_of(
    st.dictionaries(completion_names, json_values, max_size=8).map(
        lambda d: {"model": "llama-8b", "prompt": "hi", **d}
    ),
    st.fixed_dictionaries(
        {
            "model": st.just("llama-8b"),
            "prompt": st.one_of(
                st.text(max_size=40), st.lists(st.text(max_size=20), max_size=3), json_values
            ),
        },
        optional={
            "n": st.one_of(st.integers(-1, 10), json_values),
            "echo": json_values,
            "suffix": json_values,
            "logprobs": st.one_of(st.integers(-1, 8), json_values),
            "best_of": json_values,
            "max_tokens": json_values,
        },
    ),
)


def _encode(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # ints beyond 64 bits: send them as text JSON
        import json

        return json.dumps(body).encode()


LIMIT = schema.LimitRecord(
    rpm=1, tpm=1, max_context=2048, max_output=64, kv_seconds_cap=1, reserved_kv=0
)
VERSION = schema.ModelVersionRecord(
    version="v",
    family="f",
    context_length=4096,
    kv_bytes_per_token=1,
    tpot_target_ms=1,
    kv_capacity_tokens=1,
)
# The module's replica takes tools, and its version can do what the new fields ask.
REPLICA_OPTIONS = {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json"}
CAPABILITIES: dict[str, Any] = {
    "supports_tools": True,
    "supports_structured_output": True,
    "max_n": 4,
    "supports_logprobs": True,
    "max_top_logprobs": 5,
}
CAPABLE = dataclasses.replace(VERSION, **CAPABILITIES)


@given(st.one_of(bodies.map(_encode), st.binary(max_size=200)))
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_validation_raises_only_client_errors(raw: bytes) -> None:
    try:
        req = parse_chat(raw)
    except ApiError as exc:
        assert_client_error(exc)
        return
    prompt, _ = ChatCompletions.__new__(ChatCompletions).prompt_estimate(req, tokens.RULE)
    for version in (VERSION, CAPABLE):  # without and with the new fields' capabilities
        try:
            apply_limits(req, version, LIMIT, prompt)
        except ApiError as exc:
            assert_client_error(exc)


def assert_client_error(exc: ApiError) -> None:
    assert 400 <= exc.status < 500
    assert exc.param is None or isinstance(exc.param, str)


@given(st.one_of(completion_bodies.map(_encode), st.binary(max_size=100)))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_completion_validation_raises_only_client_errors(raw: bytes) -> None:
    endpoint = Completions.__new__(Completions)  # its estimate and limits need no pipeline
    try:
        req = parse_completion(raw)
        _, longest = endpoint.prompt_estimate(req, tokens.RULE)
        apply_limits(req, CAPABLE, LIMIT, longest)
    except ApiError as exc:
        assert_client_error(exc)


@pytest.fixture(scope="module")
def fuzz_client(gateway: GatewayProcess, seeder: ReadModelSeeder) -> Any:
    tenant = seeder.tenant(max_output=8)
    with httpx.Client(
        base_url=gateway.base_url, timeout=30, headers={"authorization": f"Bearer {tenant.secret}"}
    ) as client:
        yield client


@given(st.one_of(bodies.map(_encode), st.binary(max_size=100)))
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_http_never_answers_5xx(fuzz_client: httpx.Client, raw: bytes) -> None:
    assert_no_5xx(fuzz_client, "/v1/chat/completions", raw)


def assert_no_5xx(client: httpx.Client, path: str, raw: bytes) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


@given(st.one_of(completion_bodies.map(_encode), st.binary(max_size=100)))
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_http_completions_never_answer_5xx(fuzz_client: httpx.Client, raw: bytes) -> None:
    assert_no_5xx(fuzz_client, "/v1/completions", raw)
