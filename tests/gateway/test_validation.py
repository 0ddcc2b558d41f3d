"""Chat body parsing and the per-key context and output limits. No I/O."""

from __future__ import annotations

import orjson
import pytest

from contracts import schema
from gateway.endpoints.validation import apply_limits, parse_chat
from gateway.errors import BadRequest

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
        (orjson.dumps({**GOOD, "n": 9}), "n", "invalid_value"),
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
        (orjson.dumps({**GOOD, "logprobs": 1}), "logprobs", "invalid_type"),
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
