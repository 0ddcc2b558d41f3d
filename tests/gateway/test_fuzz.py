"""No request body makes the gateway answer 5xx: fuzzed in-process and over HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import schema
from gateway.errors import ApiError
from gateway.validation import KNOWN, apply_limits, parse_chat
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
        optional={"name": json_values},
    ),
    max_size=4,
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


@given(st.one_of(bodies.map(_encode), st.binary(max_size=200)))
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_validation_raises_only_client_errors(raw: bytes) -> None:
    try:
        req = parse_chat(raw)
        from gateway import tokens

        apply_limits(req, VERSION, LIMIT, tokens.prompt_tokens(req.message_texts))
    except ApiError as exc:
        assert 400 <= exc.status < 500
        assert exc.param is None or isinstance(exc.param, str)


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
    response = fuzz_client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
