"""Tools, structured output, logprobs, n, /v1/completions and /v1/models/{id}, through the
official openai client against an emulated replica started as the platform starts them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from pydantic import BaseModel, Field

from emulator.testing import EmulatorHandle, running_emulator
from emulator.tokenizer import Tokenizer
from tests.support import same_tool_call

from .conftest import MODEL, words

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["city", "unit", "days", "where"],
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
# Found once by trying prompts: under tool_choice "auto" this one asks for the tool (the
# choice is a deterministic function of the request, see emulator.choices.decide_plan).
ASKS_FOR_TOOL = "What is the weather in Paris this week?"


@pytest.fixture
async def oai() -> AsyncIterator[tuple[openai.AsyncOpenAI, EmulatorHandle]]:
    async with running_emulator(
        model=MODEL,
        speed=50,
        max_model_len=8192,
        enable_prompt_tokens_details=True,
        enable_auto_tool_choice=True,
        tool_call_parser="llama3_json",  # as the catalog's Llama 3 versions have it
    ) as emu:
        client = openai.AsyncOpenAI(
            base_url=emu.base_url + "/v1", api_key="unused", max_retries=0, timeout=30
        )
        async with client:
            yield client, emu


def _tool_text(name: str, arguments: str) -> str:
    """The Llama 3 JSON tool-call text the model generated (what completion tokens count)."""
    return '{"name": ' + json.dumps(name) + ', "parameters": ' + arguments + "}"


async def test_tool_round_trip(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, emu = oai
    messages: list[Any] = [{"role": "user", "content": ASKS_FOR_TOOL}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMS)
    assert first.usage is not None
    assert first.usage.completion_tokens == Tokenizer().count_text(
        _tool_text("get_weather", call.function.arguments)
    )
    # Tool definitions are part of the prompt.
    bare = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"ignore_eos": True}
    )
    assert bare.usage is not None
    assert first.usage.prompt_tokens > bare.usage.prompt_tokens + 40

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert emu.engine.pool.num_used == 0


async def test_streamed_tool_call_accumulates_like_the_json_one(
    oai: tuple[openai.AsyncOpenAI, EmulatorHandle],
) -> None:
    client, _ = oai
    messages: list[Any] = [{"role": "user", "content": ASKS_FOR_TOOL}]
    plain = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    async with client.chat.completions.stream(
        model=MODEL, messages=messages, tools=TOOLS, stream_options={"include_usage": True}
    ) as stream:
        names_seen = 0
        async for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                for delta_call in event.chunk.choices[0].delta.tool_calls or []:
                    if delta_call.function is not None and delta_call.function.name:
                        names_seen += 1
        final = await stream.get_final_completion()
    assert names_seen == 1  # the name is sent once, then argument fragments
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    same_tool_call(streamed.message, plain.choices[0].message)
    assert final.usage is not None and plain.usage is not None
    assert final.usage.completion_tokens == plain.usage.completion_tokens


async def test_required_and_named_tool_choice(
    oai: tuple[openai.AsyncOpenAI, EmulatorHandle],
) -> None:
    client, _ = oai
    tools = [*TOOLS, {"type": "function", "function": {"name": "now"}}]
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    required = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="required"
    )
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls
    named = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "now"}},
    )
    calls = named.choices[0].message.tool_calls
    assert calls is not None
    functions = [c for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]
    assert functions == calls and [c.function.name for c in functions] == ["now"]
    assert json.loads(functions[0].function.arguments) == {}
    assert named.choices[0].finish_reason == "stop"  # vLLM's finish for a named choice
    none = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=5
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Reading(BaseModel):
    hour: int = Field(ge=0, le=23)
    value: float


class Forecast(BaseModel):
    city: str
    unit: Unit
    readings: list[Reading]
    alert: str | None


async def test_parse_with_a_pydantic_model(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, _ = oai
    result = await client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "forecast for Oslo"}],
        response_format=Forecast,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, Forecast)
    assert all(0 <= r.hour <= 23 for r in parsed.readings)
    assert result.usage is not None
    assert result.usage.completion_tokens == Tokenizer().count_text(choice.message.content or "")


async def test_json_object_mode_and_truncation(
    oai: tuple[openai.AsyncOpenAI, EmulatorHandle],
) -> None:
    client, _ = oai
    messages: list[Any] = [{"role": "user", "content": "give me json"}]
    result = await client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(result.choices[0].message.content or ""), dict)
    cut = await client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}, max_tokens=2
    )
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage is not None and cut.usage.completion_tokens == 2
    assert (result.choices[0].message.content or "").startswith(
        cut.choices[0].message.content or ""
    )


async def test_logprobs_streamed_and_not(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, _ = oai
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 8,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    result = await client.chat.completions.create(**request)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 8
    text = ""
    for entry in logprobs.content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        text += entry.token
    assert text == result.choices[0].message.content
    stream = await client.chat.completions.create(**request, stream=True)
    streamed = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in logprobs.content
    ]


async def test_n_choices_with_summed_usage(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, emu = oai
    messages: list[Any] = [{"role": "user", "content": words(200)}]
    result = await client.chat.completions.create(
        model=MODEL, messages=messages, n=3, max_tokens=40, seed=3
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    counts = [len((c.message.content or "").split()) for c in result.choices]
    assert len({c.message.content for c in result.choices}) == 3  # each its own sequence
    assert result.usage is not None
    assert result.usage.prompt_tokens == 207  # counted once
    assert result.usage.completion_tokens == sum(counts)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        n=3,
        max_tokens=40,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in result.choices]
    assert set(finishes) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == result.usage.completion_tokens
    assert emu.engine.pool.num_used == 0


async def test_legacy_completions(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, _ = oai
    result = await client.completions.create(
        model=MODEL,
        prompt=["once upon a time", "in a galaxy"],
        n=2,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text.startswith("once upon a time")
    assert result.choices[2].text.startswith("in a galaxy")
    for choice in result.choices:
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert len(choice.logprobs.tokens) == 16  # vLLM's default max_tokens here
        assert choice.logprobs.top_logprobs is not None
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert result.usage is not None
    # BOS + pieces ("galaxy" is two 4-byte pieces), once per prompt whatever n
    assert result.usage.prompt_tokens == (1 + 4) + (1 + 4)
    assert result.usage.completion_tokens == 4 * 16
    stream = await client.completions.create(
        model=MODEL,
        prompt="once upon a time",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = ""
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
        usage = chunk.usage or usage
    assert len(text.split()) == 5
    assert usage is not None and usage.completion_tokens == 5
    ids = await client.completions.create(
        model=MODEL, prompt=[[128000, 5000, 6000]], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ids.usage is not None and ids.usage.prompt_tokens == 3


async def test_models_retrieve(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, emu = oai
    model = await client.models.retrieve(MODEL)
    assert model.id == MODEL and model.owned_by == "vllm"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("no-such-model")
    assert missing.value.param == "model"


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        (
            {"tools": [{"function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),  # fmt: skip
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stop": [1, 2]}, "stop"),
        ({"user": 5}, "user"),
        ({"temperature": -1}, "temperature"),
    ],
)
async def test_bad_values_are_400_with_param(
    oai: tuple[openai.AsyncOpenAI, EmulatorHandle], request_body: dict[str, Any], param: str
) -> None:
    client, emu = oai
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body=request_body
        )
    assert bad.value.param == param
    assert emu.engine.num_running == 0 and emu.engine.num_waiting == 0


async def test_bad_completion_values(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, _ = oai
    bad_values: tuple[tuple[str | list[list[int]], dict[str, object], str], ...] = (
        ("x", {"suffix": "end"}, "suffix"),
        ("x", {"logprobs": 21}, "logprobs"),
        ([[1, 999_999]], {}, "prompt.0"),
    )
    for prompt, extra, param in bad_values:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt=prompt, extra_body=extra)
        assert bad.value.param == param


async def test_auto_tool_choice_needs_the_replica_flags() -> None:
    async with running_emulator(model=MODEL, speed=50) as emu:
        client = openai.AsyncOpenAI(base_url=emu.base_url + "/v1", api_key="x", max_retries=0)
        async with client:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS
                )
            assert bad.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(
                bad.value.message
            )
            forced = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                tools=TOOLS,
                tool_choice="required",
            )
            assert forced.choices[0].message.tool_calls
