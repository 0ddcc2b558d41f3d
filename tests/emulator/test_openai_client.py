"""The official openai client works against the emulator unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from emulator.testing import EmulatorHandle, running_emulator

from .conftest import MODEL, words


@pytest.fixture
async def oai() -> AsyncIterator[tuple[openai.AsyncOpenAI, EmulatorHandle]]:
    async with running_emulator(
        model=MODEL, speed=20, max_model_len=4096, enable_prompt_tokens_details=True
    ) as emu:
        client = openai.AsyncOpenAI(base_url=emu.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=30)  # fmt: skip
        async with client:
            yield client, emu


async def test_streaming_with_usage(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, _ = oai
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": words(300)}]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "cache_salt": "t1"},
    )
    pieces = []
    usage = None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == 307
    assert len("".join(pieces).split()) == 12
    again = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1,
        extra_body={"cache_salt": "t1"},
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 304


async def test_non_streaming_and_models(oai: tuple[openai.AsyncOpenAI, EmulatorHandle]) -> None:
    client, _ = oai
    result = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_completion_tokens=6,
        extra_headers={"X-Request-Id": "oai-1"},
        extra_body={"ignore_eos": True},
    )
    assert result.id == "chatcmpl-oai-1"
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 6
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_errors_raise_the_right_exceptions(
    oai: tuple[openai.AsyncOpenAI, EmulatorHandle],
) -> None:
    client, emu = oai
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="missing", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError) as overflow:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(5000)}]
        )
    assert "maximum context length" in overflow.value.message
    emu.faults.refuse_503 = True
    with pytest.raises(openai.InternalServerError) as unavailable:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert unavailable.value.status_code == 503
