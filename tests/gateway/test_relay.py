"""SSE tracking of a relayed stream: counting, assembling, errors. No I/O."""

from __future__ import annotations

import orjson
import pytest

from gateway.upstream.relay import CONTENT, END, ERROR, USAGE, StreamTracker

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


def _chunk(choices: list[dict[str, object]], obj: str = "chat.completion.chunk") -> bytes:
    return orjson.dumps(
        {"id": "x-1", "object": obj, "created": 1, "model": "v1", "choices": choices}
    )


def test_json_assembly_merges_tool_call_fragments_per_choice() -> None:
    """Two choices (n=2), the first with two parallel calls streamed in fragments, as a
    replica sends them: each call's id and name once, its arguments in pieces."""
    tracker = StreamTracker(assemble=True, started=0.0)
    call = [
        {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}
    ]
    events = [
        _chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
        _chunk([{"index": 0, "delta": {"tool_calls": call}}]),
        _chunk([{"index": 1, "delta": {"content": "plain"}}]),
        _chunk(
            [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
                }
            ]
        ),  # fmt: skip
        _chunk(
            [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 1, "id": "c1", "function": {"name": "g", "arguments": "{}"}}
                        ]
                    },
                }
            ]
        ),  # fmt: skip
        _chunk(
            [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                }
            ]
        ),  # fmt: skip
        _chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
        _chunk([{"index": 1, "delta": {"content": " text"}, "finish_reason": "length"}]),
        b"[DONE]",
    ]
    for event in events:
        tracker.observe(event, 1.0)
    assert tracker.first_token_at is not None  # a tool-call delta is a token
    body = tracker.completion("m", 5)
    first, second = body["choices"]
    assert first["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "plain text"}
    assert second["finish_reason"] == "length" and second["index"] == 1


def test_json_assembly_of_a_text_completion_with_logprobs() -> None:
    tracker = StreamTracker(assemble=True, started=0.0, kind="text")
    obj = "text_completion"
    for text, offset in (("a", 0), (" b", 1)):
        lp = {"tokens": [text], "token_logprobs": [-0.5], "top_logprobs": [{text: -0.5}],
              "text_offset": [offset]}  # fmt: skip
        tracker.observe(_chunk([{"index": 0, "text": text, "logprobs": lp}], obj), 1.0)
    tracker.observe(_chunk([{"index": 0, "text": "", "finish_reason": "length"}], obj), 1.0)
    tracker.observe(b"[DONE]", 1.0)
    body = tracker.completion("m", 3)
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["text"] == "a b" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["a", " b"]
    assert choice["logprobs"]["text_offset"] == [0, 1]
