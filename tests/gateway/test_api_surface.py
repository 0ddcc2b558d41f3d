"""The OpenAI API surface through a running gateway, with the official ``openai`` client
unchanged: tools (a round trip, streamed and not), structured output (``parse`` with a
Pydantic model), logprobs, ``n``, legacy completions, ``models.retrieve``; a 400 naming the
parameter for every bad value of the new fields and for a capability the version lacks.

The replica is an emulator started as the platform starts a Llama 3 replica with tool
calling (``--enable-auto-tool-choice --tool-call-parser llama3_json``); the catalog's
version says what it can do. A second family (``plain``) is pushed without capabilities.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from emulator.testing import SpawnedEmulator
from tests.emulator.test_api_surface import Forecast
from tests.gateway.conftest import (
    FAMILY,
    VERSION,
    GatewayProcess,
    ReadModelSeeder,
    Tenant,
    UsageLog,
)
from tests.support import same_tool_call, wait_until

PLAIN = "plain-8b"
PLAIN_VERSION = "plain-8b-2026-05"
REPLICA_OPTIONS = {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json"}
CAPABILITIES = {
    "supports_tools": True,
    "tool_call_parser": "llama3_json",
    "supports_structured_output": True,
    "max_n": 4,
    "supports_logprobs": True,
    "max_top_logprobs": 5,
}
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER_PARAMS,
        },
    }
]
USER: list[Any] = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# The emulator's choice under tool_choice "auto" is a function of the request; with this
# seed it calls the tool (found by trying, see emulator.choices.decide_plan).
SEED = 1


@pytest.fixture(scope="module")
def tenant(gateway: GatewayProcess, seeder: ReadModelSeeder, replica: SpawnedEmulator) -> Tenant:
    """A tenant of both families; the second (no capabilities) is pushed while the gateway
    runs, as the control plane would."""
    seeder.set_replicas([("p1", replica.base_url)], version=PLAIN_VERSION, family=PLAIN)
    tenant = seeder.tenant(families=(FAMILY, PLAIN))
    models = gateway.base_url + "/v1/models/" + PLAIN
    auth = {"authorization": f"Bearer {tenant.secret}"}
    wait_until(lambda: httpx.get(models, headers=auth, timeout=5).status_code == 200, 10)
    return tenant


def sdk(gateway: GatewayProcess, tenant: Tenant) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=tenant.secret, max_retries=0, timeout=30
    )


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess, tenant: Tenant) -> Iterator[openai.OpenAI]:
    with sdk(gateway, tenant) as c:
        yield c


# -- tools ----------------------------------------------------------------------------------


def test_tool_round_trip(client: openai.OpenAI) -> None:
    messages = list(USER)
    first = client.chat.completions.create(model=FAMILY, messages=messages, tools=TOOLS, seed=SEED)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert first.usage is not None and first.usage.completion_tokens > 0
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(model=FAMILY, messages=messages, tools=TOOLS)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None and answer.message.content
    # The earlier turns (tool definitions, the call, the result) are all prompt.
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_round_trip_streamed_matches_the_json_one(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=FAMILY, messages=USER, tools=TOOLS, seed=SEED)
    with client.chat.completions.stream(
        model=FAMILY,
        messages=USER,
        tools=TOOLS,
        seed=SEED,
        stream_options={"include_usage": True},
    ) as stream:
        names = 0
        fragments = 0
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                for delta in event.chunk.choices[0].delta.tool_calls or []:
                    assert delta.index == 0
                    if delta.function is not None and delta.function.name:
                        names += 1
                    if delta.function is not None and delta.function.arguments:
                        fragments += 1
        final = stream.get_final_completion()
    assert names == 1 and fragments > 1  # the name once, the arguments in fragments
    got, want = final.choices[0], plain.choices[0]
    assert got.finish_reason == "tool_calls"
    g = same_tool_call(got.message, want.message)
    assert final.usage is not None and plain.usage is not None
    assert final.usage.completion_tokens == plain.usage.completion_tokens
    # ... and the client answers the call, streamed too.
    messages = [
        *USER,
        got.message.model_dump(exclude_none=True, exclude={"parsed"}),
        {"role": "tool", "tool_call_id": g.id, "content": "rain"},
    ]
    stream2 = client.chat.completions.create(
        model=FAMILY, messages=messages, tools=TOOLS, stream=True
    )
    text = ""
    finish = None
    for chunk in stream2:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text and finish in ("stop", "length")


def test_tool_choice_required_named_and_none(client: openai.OpenAI) -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "now"}}]
    hello: list[Any] = [{"role": "user", "content": "hello there"}]
    required = client.chat.completions.create(
        model=FAMILY, messages=hello, tools=tools, tool_choice="required"
    )
    assert required.choices[0].message.tool_calls
    named = client.chat.completions.create(
        model=FAMILY,
        messages=hello,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "now"}},
        parallel_tool_calls=False,
    )
    calls = named.choices[0].message.tool_calls
    assert calls is not None
    functions = [c for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]
    assert functions == calls and [c.function.name for c in functions] == ["now"]
    none = client.chat.completions.create(
        model=FAMILY, messages=hello, tools=tools, tool_choice="none", max_tokens=5
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


# -- structured output ----------------------------------------------------------------------


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    result = client.chat.completions.parse(
        model=FAMILY,
        messages=[{"role": "user", "content": "forecast for Oslo"}],
        response_format=Forecast,
    )
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Forecast)
    assert all(0 <= r.hour <= 23 for r in parsed.readings)
    obj = client.chat.completions.create(
        model=FAMILY,
        messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


# -- logprobs and n -------------------------------------------------------------------------


def test_logprobs_parse_into_the_sdk_types_streamed_and_not(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": FAMILY,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 6,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    result = client.chat.completions.create(**request)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 6
    for entry in logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
    assert "".join(e.token for e in logprobs.content) == result.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in logprobs.content
    ]


def test_n_three_choices_with_usage_summed(
    gateway: GatewayProcess, seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    own = seeder.tenant()
    messages: list[Any] = [{"role": "user", "content": "tell me a story about a lighthouse"}]
    with sdk(gateway, own) as c:
        result = c.chat.completions.create(
            model=FAMILY, messages=messages, n=3, max_tokens=12, seed=3
        )
        assert [ch.index for ch in result.choices] == [0, 1, 2]
        assert len({ch.message.content for ch in result.choices}) == 3
        counts = [len((ch.message.content or "").split()) for ch in result.choices]
        assert result.usage is not None and result.usage.completion_tokens == sum(counts)
        stream = c.chat.completions.create(
            model=FAMILY,
            messages=messages,
            n=3,
            max_tokens=12,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts = ["", "", ""]
        usage = None
        for chunk in stream:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
            usage = chunk.usage or usage
    assert texts == [ch.message.content for ch in result.choices]
    assert usage is not None and usage.completion_tokens == result.usage.completion_tokens
    events = usage_log.events(own.tenant_id, 2)
    assert [e["completion_tokens"] for e in events] == [sum(counts)] * 2
    assert [e["prompt_tokens"] for e in events] == [result.usage.prompt_tokens] * 2


# -- legacy completions and models ----------------------------------------------------------


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=FAMILY,
        prompt=["once upon a time", "in a galaxy"],
        n=2,
        max_tokens=4,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "text_completion"
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text.startswith("once upon a time")
    assert result.choices[2].text.startswith("in a galaxy")
    for choice in result.choices:
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    assert result.usage is not None and result.usage.completion_tokens == 4 * 4
    default = client.completions.create(
        model=FAMILY, prompt="hello", extra_body={"ignore_eos": True}
    )
    assert default.usage is not None and default.usage.completion_tokens == 16  # as OpenAI's
    text = ""
    usage = None
    for chunk in client.completions.create(
        model=FAMILY,
        prompt="once upon a time",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            text += choice.text
        usage = chunk.usage or usage
    assert len(text.split()) == 5
    assert usage is not None and usage.completion_tokens == 5 and usage.prompt_tokens == 5


def test_completions_share_the_idempotency_and_usage_path(
    gateway: GatewayProcess, seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    """``POST /v1/completions`` goes through the chat endpoint's pipeline: an
    ``Idempotency-Key`` replays the stored response (and refuses another body under it),
    and each generation is one usage event with the replica's counts."""
    tenant = seeder.tenant()
    url = gateway.base_url + "/v1/completions"
    headers = {"authorization": f"Bearer {tenant.secret}", "idempotency-key": "cmpl-1"}
    body = {"model": FAMILY, "prompt": ["once upon", "a time"], "max_tokens": 5}
    first = httpx.post(url, json=body, headers=headers, timeout=30)
    again = httpx.post(url, json=body, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200, first.text
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    reused = httpx.post(url, json={**body, "max_tokens": 6}, headers=headers, timeout=30)
    assert reused.status_code == 422
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    (event,) = usage_log.events(tenant.tenant_id, 1)
    usage_log.settle(1.0)
    assert len(usage_log.by_tenant[tenant.tenant_id]) == 1  # the replay generated nothing
    usage = first.json()["usage"]
    assert event["request_id"] == first.headers["x-request-id"]
    assert (event["prompt_tokens"], event["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_models_retrieve_and_404(
    client: openai.OpenAI, gateway: GatewayProcess, seeder: ReadModelSeeder
) -> None:
    family = client.models.retrieve(FAMILY)
    assert (family.id, family.object, family.owned_by) == (FAMILY, "model", "fairway")
    version = client.models.retrieve(VERSION)
    assert version.id == VERSION
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.param == "model" and missing.value.code == "model_not_found"
    # A model the tenant is not entitled to: the same 404, nothing said about it.
    outsider = seeder.tenant(families=(FAMILY,))
    with sdk(gateway, outsider) as c, pytest.raises(openai.NotFoundError) as hidden:
        c.models.retrieve(PLAIN)
    assert (hidden.value.code, hidden.value.param, hidden.value.type) == (
        missing.value.code,
        missing.value.param,
        missing.value.type,
    )


# -- bad values and missing capabilities ----------------------------------------------------

BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools[0].function.parameters",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),  # fmt: skip
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}},
        "response_format.json_schema.strict",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format.json_schema.schema",
    ),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),  # past the version's 5
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"n": 5}, "n"),  # past the version's 4
    ({"stop": [1, 2]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary: the replica says so
    ({"seed": 1.5}, "seed"),
    ({"user": 5}, "user"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"store": True}, "store"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages[0].tool_calls",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
        "messages[0].tool_calls[0].function.name",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                    ],
                }
            ]
        },
        "messages[0].content[1].type",
    ),
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # unknown fields: still refused
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_value_is_400_with_param(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=FAMILY, messages=body.pop("messages"), extra_body=body)
    assert bad.value.param == param, bad.value.body
    assert isinstance(bad.value.code, str) and bad.value.code


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n"),
    ],
)
def test_capability_the_version_lacks_is_400_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=PLAIN, messages=[{"role": "user", "content": "x"}], extra_body=extra
        )
    assert (bad.value.param, bad.value.code) == (param, "unsupported_by_model")
    assert PLAIN_VERSION in bad.value.message


def test_bad_completion_values(client: openai.OpenAI) -> None:
    bad_values: tuple[tuple[str | list[list[int]] | list[str], dict[str, object], str], ...] = (
        ("x", {"suffix": "end"}, "suffix"),
        ("x", {"logprobs": 6}, "logprobs"),
        ([[1, 2]], {}, "prompt[0]"),
        ([], {}, "prompt"),
        ("x", {"best_of": 3}, "best_of"),
        ("x", {"messages": []}, "messages"),
    )
    for prompt, extra, param in bad_values:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=FAMILY, prompt=prompt, extra_body=extra)
        assert bad.value.param == param, bad.value.body
    with pytest.raises(openai.BadRequestError) as lacking:
        client.completions.create(model=PLAIN, prompt="x", logprobs=1)
    assert (lacking.value.param, lacking.value.code) == ("logprobs", "unsupported_by_model")


def test_new_paths_use_openai_error_shapes(gateway: GatewayProcess, tenant: Tenant) -> None:
    auth = {"authorization": f"Bearer {tenant.secret}"}
    got = httpx.get(gateway.base_url + "/v1/completions", headers=auth, timeout=10)
    assert got.status_code == 405
    deleted = httpx.delete(gateway.base_url + "/v1/models/" + FAMILY, headers=auth, timeout=10)
    assert deleted.status_code == 405
    anonymous = httpx.get(gateway.base_url + "/v1/models/" + FAMILY, timeout=10)
    assert anonymous.status_code == 401
    for response in (got, deleted, anonymous):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
