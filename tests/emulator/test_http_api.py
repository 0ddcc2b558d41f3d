"""vLLM's HTTP API shapes over real loopback HTTP (endpoints, request fields, JSON and SSE
responses, errors)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from emulator.testing import EmulatorHandle, running_emulator

from .conftest import MODEL, chat, parse_sse, words


async def post_stream(client: httpx.AsyncClient, body: dict[str, Any], **kw: Any) -> list[Any]:
    response = await client.post("/v1/chat/completions", json=body, **kw)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    return parse_sse(response.content)


async def test_stream_with_usage_has_vllm_shapes(client: httpx.AsyncClient) -> None:
    body = chat(
        words(40),
        max_tokens=7,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = await post_stream(client, body, headers={"X-Request-Id": "abc-123"})
    assert events[-1] == "[DONE]"
    first, *content, last, usage_chunk, _done = events
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert first["prompt_token_ids"] is None
    ids = {e["id"] for e in events[:-1]}
    created = {e["created"] for e in events[:-1]}
    assert ids == {"chatcmpl-abc-123"} and len(created) == 1
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events[:-1])
    for chunk in content:
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] is None and isinstance(choice["delta"]["content"], str)
        assert "system_fingerprint" not in chunk
    (final,) = last["choices"]
    assert final["finish_reason"] == "length" and final["stop_reason"] is None
    assert "system_fingerprint" not in last  # it moves to the usage chunk
    assert usage_chunk["choices"] == []
    assert usage_chunk["system_fingerprint"].startswith("vllm-0.33.0-")
    assert usage_chunk["usage"] == {
        "prompt_tokens": 40 + 4 + 3,
        "total_tokens": 47 + 7,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(content) + 1 == 7  # one data event per token


async def test_stream_without_usage_ends_with_fingerprint(client: httpx.AsyncClient) -> None:
    events = await post_stream(client, chat("hi", max_tokens=3, ignore_eos=True, stream=True))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])  # no usage chunk
    assert events[-2]["system_fingerprint"].startswith("vllm-")
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_continuous_usage_stats(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat("hi there", max_tokens=3, ignore_eos=True, stream=True, stream_options=options)
    events = await post_stream(client, body)
    counts = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert counts == [0, 1, 2, 3]  # vLLM's role chunk carries the prompt's count too
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {e["usage"]["prompt_tokens"] for e in events[:-1]} == {
        events[-2]["usage"]["prompt_tokens"]
    }


async def test_continuous_usage_stats_per_choice(client: httpx.AsyncClient) -> None:
    """n > 1: each choice's role chunk carries the prompt count and 0 generated, each later
    chunk its own choice's running count; the final usage chunk sums the choices."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat("hi there", n=2, max_tokens=3, ignore_eos=True, stream=True, stream_options=options)
    *chunks, final, done = await post_stream(client, body)
    assert done == "[DONE]" and final["choices"] == []
    counts: dict[int, list[int]] = {}
    for event in chunks:
        (choice,) = event["choices"]
        assert event["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"]
        counts.setdefault(choice["index"], []).append(event["usage"]["completion_tokens"])
    assert counts == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert final["usage"]["completion_tokens"] == 6


async def test_non_streaming_response_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json=chat(words(30), max_completion_tokens=5, max_tokens=99, ignore_eos=True),
        headers={"X-Request-Id": "r-1"},
    )
    assert response.status_code == 200
    data = response.json()
    assert data["id"] == "chatcmpl-r-1" and data["object"] == "chat.completion"
    for key in ("service_tier", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params"):
        assert key in data and data[key] is None
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    message = choice["message"]
    assert message["role"] == "assistant" and message["refusal"] is None
    assert "tool_calls" not in message
    assert len(message["content"].split()) == 5  # max_completion_tokens wins over max_tokens
    usage = data["usage"]
    assert usage["prompt_tokens"] == 37 and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == 42 and usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_same_seed_same_text(client: httpx.AsyncClient) -> None:
    body = chat("tell me a story", max_tokens=40, seed=1234)
    first, second = await asyncio.gather(
        client.post("/v1/chat/completions", json=body),
        client.post("/v1/chat/completions", json=body),
    )
    text = first.json()["choices"][0]["message"]["content"]
    assert text and text == second.json()["choices"][0]["message"]["content"]


async def test_cached_tokens_reported_on_repeat(client: httpx.AsyncClient) -> None:
    body = chat(words(200), max_tokens=2, cache_salt="tenant-1", stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    await post_stream(client, body)
    events = await post_stream(client, body)
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 207 tokens
    other_salt = dict(body, cache_salt="tenant-2")
    events = await post_stream(client, other_salt)
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


async def test_context_overflow_is_a_400() -> None:
    async with (
        running_emulator(model=MODEL, max_model_len=256) as emu,
        httpx.AsyncClient(base_url=emu.base_url) as client,
    ):
        response = await client.post("/v1/chat/completions", json=chat(words(300)))
        error = await error_of(response, 400)
        assert error["param"] == "input_tokens" and error["type"] == "BadRequestError"
        assert "maximum context length is 256 tokens" in error["message"]
        assert "307 input tokens" in error["message"]
        response = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=257))
        assert (await error_of(response, 400))["param"] == "max_tokens"
        # prompt + max_tokens over the limit is clamped, not rejected (vLLM 0.33)
        response = await client.post(
            "/v1/chat/completions", json=chat(words(200), max_tokens=200, ignore_eos=True)
        )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 256 - 207


@pytest.mark.parametrize(
    "salt", ["", "x" * 129, "a@b", "a/b", "a\\b", "a\x00b", 12, ["s"]], ids=repr
)
async def test_bad_cache_salt_is_a_400(client: httpx.AsyncClient, salt: object) -> None:
    response = await client.post("/v1/chat/completions", json=chat("hi", cache_salt=salt))
    error = await error_of(response, 400)
    assert error["param"] == "cache_salt"


async def test_good_cache_salt_lengths_pass(client: httpx.AsyncClient) -> None:
    for salt in ("a", "x" * 128, "tenant:42|v1"):
        response = await client.post(
            "/v1/chat/completions", json=chat("hi", max_tokens=1, cache_salt=salt)
        )
        assert response.status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat("hi", stream_options={"include_usage": True}), "stream_options"),
        (chat("hi", stream=False, stream_options={"include_usage": True}), "stream_options"),
        ({"model": MODEL}, "messages"),
        (chat("hi", max_tokens=0), "max_tokens"),
        (chat("hi", max_tokens="many"), "max_tokens"),
        (chat("hi", stream="yes"), "stream"),
        ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"model": MODEL, "messages": []}, "messages"),
        (chat("hi", n=0), "n"),
        (chat("hi", max_tokens=2, min_tokens=3), "min_tokens"),
        (chat("hi", min_tokens=-1), "min_tokens"),
    ],
)
async def test_validation_errors_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await client.post("/v1/chat/completions", json=body)
    error = await error_of(response, 400)
    assert error["param"] == param


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=dict(chat("hi"), model="nope"))
    error = await error_of(response, 404)
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    response = await client.post("/v1/chat/completions", json=dict(chat("hi", max_tokens=1)))
    assert response.status_code == 200
    no_model = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert (await client.post("/v1/chat/completions", json=no_model)).status_code == 200


async def test_bad_json_and_content_type(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    await error_of(response, 400)
    response = await client.post(
        "/v1/chat/completions", content=b"[1,2]", headers={"content-type": "application/json"}
    )
    await error_of(response, 400)
    response = await client.post(
        "/v1/chat/completions", content=b'{"messages":[]}', headers={"content-type": "text/plain"}
    )
    await error_of(response, 400)


async def test_routes(client: httpx.AsyncClient, emu: EmulatorHandle) -> None:
    health = await client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert (await client.get("/version")).json() == {"version": "0.33.0"}
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["owned_by"] == "vllm" and card["object"] == "model"
    assert card["max_model_len"] == emu.engine.max_model_len == 131_072
    assert card["root"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert (await client.get("/nope")).json() == {"detail": "Not Found"}
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_tokenize_matches_the_template_rules(client: httpx.AsyncClient) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},  # You(1) are(1) helpful.(2)
        {"role": "user", "content": [{"type": "text", "text": "naïve café"}]},  # 6B->2, 5B->2
    ]
    response = await client.post("/tokenize", json={"model": MODEL, "messages": messages})
    data = response.json()
    assert data["count"] == (4 + 4) + (4 + 4) + 3 == len(data["tokens"])
    assert data["max_model_len"] == 131_072 and data["token_strs"] is None
    completion = await client.post("/v1/chat/completions", json={"messages": messages,
                                                                 "max_tokens": 1})  # fmt: skip
    assert completion.json()["usage"]["prompt_tokens"] == data["count"]
    raw = await client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert raw.json()["count"] == 1 + 2 + 2
    assert raw.json()["token_strs"] == ["<|begin_of_text|>", "hell", "o", "worl", "d"]
    bad = await client.post("/tokenize", json={"model": MODEL})
    assert bad.status_code == 400


async def test_priority_header_overrides_body(
    client: httpx.AsyncClient, emu: EmulatorHandle
) -> None:
    body = chat("hi", max_tokens=2000, ignore_eos=True, stream=True, priority=3)
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Vllm-Priority": "-7"}
    ) as response:
        async for _ in response.aiter_bytes():
            break
        (req,) = emu.engine.requests.values()
        assert req.priority == -7
    body["priority"] = 3
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Vllm-Priority": "high"}
    ) as response:
        async for _ in response.aiter_bytes():
            break
        assert [r.priority for r in emu.engine.requests.values()] == [3]


async def test_extra_latency_and_503_faults(client: httpx.AsyncClient, emu: EmulatorHandle) -> None:
    emu.faults.extra_latency_ms = 300
    start = time.monotonic()
    response = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=1))
    assert response.status_code == 200 and time.monotonic() - start >= 0.3
    emu.faults.extra_latency_ms = 0
    emu.faults.refuse_503 = True
    response = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=1))
    error = await error_of(response, 503)
    assert error["type"] == "Service Unavailable"
    assert emu.engine.stats.prefix_cache_queries == 8  # only the first "hi" (8 tokens) ran
