"""Continuous usage on bytes (``StreamTracker.take_usage``): the per-chunk ``usage`` vLLM adds
under ``stream_options.continuous_usage_stats`` is found by a byte search, kept, and cut out,
leaving the chunk the replica sends without the option. No I/O."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.protocol import ChunkTemplates, usage_dict
from gateway.upstream.relay import (
    CONTENT,
    SOURCE_CONTINUOUS,
    SOURCE_ESTIMATE,
    SOURCE_FINAL,
    SOURCE_NONE,
    USAGE,
    StreamTracker,
)

# Text that looks like the key being searched for, raw and as JSON would hold it.
DECOYS = [
    ',"usage":{"prompt_tokens":1}',
    '"usage":{',
    '},"usage":{"prompt_tokens":9,"total_tokens":9,"completion_tokens":0}}',
    '\\",\\"usage\\":{',
    "usage",
    "[],",
    "{{{}}}}",
]
text = st.one_of(
    st.text(max_size=60),
    st.sampled_from(DECOYS),
    st.lists(st.sampled_from(DECOYS + ["x", " ", "\\", '"', "é", "漢", "🙂"])).map("".join),
)


def _usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    return usage_dict(prompt, completion, cached)  # vLLM's UsageInfo field order


def _vllm_chunk(choice: dict[str, Any], usage: dict[str, Any] | None, **after: Any) -> bytes:
    """vLLM's field order (``ChatCompletionStreamResponse``): ``usage`` right after
    ``choices``, then only the id lists and transfer parameters, null here."""
    body: dict[str, Any] = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    body.update(after)
    return orjson.dumps(body)


@given(
    content=text,
    arguments=text,
    token=text,
    index=st.integers(0, 11),
    prompt=st.integers(0, 10**6),
    completion=st.integers(0, 10**5),
    cached=st.one_of(st.none(), st.integers(0, 10**6)),
    after=st.sampled_from(
        [{}, {"kv_transfer_params": None}, {"prompt_token_ids": None, "prompt_text": None}]
    ),
)
@settings(max_examples=400, deadline=None)
def test_stripping_leaves_the_chunk_without_usage_for_any_content(
    content: str,
    arguments: str,
    token: str,
    index: int,
    prompt: int,
    completion: int,
    cached: int | None,
    after: dict[str, Any],
) -> None:
    choice = {
        "index": index,
        "delta": {
            "content": content,
            "tool_calls": [{"index": 0, "function": {"name": "usage", "arguments": arguments}}],
        },
        "logprobs": {"content": [{"token": token, "logprob": -0.5, "bytes": [1, 2]}]},
        "finish_reason": None,
    }
    usage = _usage(prompt, completion, cached)
    plain = _vllm_chunk(choice, None, **after)
    tracker = StreamTracker(indexed=True, n=3)
    assert tracker.take_usage(_vllm_chunk(choice, usage, **after)) == plain
    assert tracker.take_usage(plain) == plain  # nothing to take: the same bytes
    assert list(tracker.live) == [index]
    assert orjson.loads(tracker.live[index]) == usage
    assert tracker.live_counts() == (prompt, completion, cached or 0)


def test_the_emulators_chunks_lose_exactly_their_usage() -> None:
    templates = ChunkTemplates("chatcmpl-1", 7, "m", "vllm-fp", include_usage=True)
    usage = orjson.dumps(_usage(40, 3))
    piece = orjson.dumps(',"usage":{"prompt_tokens":1}')
    pairs = [
        (templates.role_with_usage(orjson.dumps(_usage(40, 0))), templates.role),
        (templates.token(piece, usage), templates.token(piece)),
        (templates.final(piece, "length", usage), templates.final(piece, "length")),
    ]
    tracker = StreamTracker()
    for with_usage, without in pairs:
        # the relay sees the data line's payload (gateway.upstream.relay.SSEEvents)
        assert tracker.take_usage(with_usage[6:-2]) == without[6:-2]
    assert tracker.live_counts() == (40, 3, 0)


def test_the_final_usage_chunk_is_left_to_the_usual_path() -> None:
    final = (
        b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":11,"total_tokens":14,"completion_tokens":3,'
        b'"prompt_tokens_details":{"cached_tokens":8}},"system_fingerprint":"fp"}'
    )
    tracker = StreamTracker()
    assert tracker.take_usage(final) == final and not tracker.live
    assert tracker.observe(final, 1.0) == USAGE
    assert tracker.prompt_tokens(99) == 11 and tracker.cached_tokens == 8
    assert tracker.usage_source == SOURCE_FINAL


def test_a_nested_usage_object_is_cut_whole() -> None:
    choice = {"index": 0, "delta": {"content": "hi"}, "finish_reason": None}
    usage = _usage(10, 2, cached=4)
    usage["completion_tokens_details"] = {"reasoning_tokens": 1}
    tracker = StreamTracker()
    stripped = tracker.take_usage(_vllm_chunk(choice, usage, kv_transfer_params=None))
    assert stripped == _vllm_chunk(choice, None, kv_transfer_params=None)
    assert tracker.live_counts() == (10, 2, 4)


@pytest.mark.parametrize(
    "broken",
    [
        b'{"choices":[{"index":0}],"usage":{"prompt_tokens":1',  # no closing brace
        b'{"choices":[{"index":0}],"usage":{"a":{"b":1}',  # nested, unbalanced
    ],
)
def test_a_truncated_usage_object_is_left_alone(broken: bytes) -> None:
    tracker = StreamTracker()
    assert tracker.take_usage(broken) == broken and not tracker.live


def test_counts_come_from_the_last_usage_of_each_choice_and_prompt() -> None:
    """A completions request with two prompts and n=2: choices 0-1 are prompt 0's, 2-3
    prompt 1's; the prompt counts once per prompt, the completion sums every choice."""
    tracker = StreamTracker(kind="text", n=2, indexed=True)
    for index, prompt, completion in [(0, 7, 1), (1, 7, 1), (0, 7, 2), (2, 5, 1), (3, 5, 3)]:
        chunk = _vllm_chunk({"index": index, "text": "a"}, _usage(prompt, completion))
        data = tracker.take_usage(chunk)
        assert tracker.observe(data, 1.0) == CONTENT
    assert tracker.live_counts() == (12, 7, 0)
    assert tracker.prompt_tokens(999) == 12 and tracker.completion_tokens == 7
    assert tracker.usage_source == SOURCE_CONTINUOUS


def test_the_exact_prompt_is_known_from_the_role_chunk() -> None:
    """vLLM's role chunk carries the prompt count (no token yet): a client that leaves
    right after it is billed the exact prompt, not the estimate, and no completion."""
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    tracker = StreamTracker()
    data = tracker.take_usage(_vllm_chunk(role, _usage(31, 0), prompt_token_ids=None))
    tracker.observe(data, 1.0)
    assert tracker.prompt_tokens(120) == 31 and tracker.completion_tokens == 0
    assert tracker.usage_source == SOURCE_CONTINUOUS


def test_without_continuous_usage_the_estimate_rules_stay() -> None:
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    token = {"index": 0, "delta": {"content": "x"}, "finish_reason": None}
    tracker = StreamTracker()
    assert tracker.usage_source == SOURCE_NONE and tracker.prompt_tokens(120) == 0
    for choice in (role, token):
        tracker.observe(_vllm_chunk(choice, None), 1.0)
    assert tracker.prompt_tokens(120) == 120 and tracker.completion_tokens == 1
    assert tracker.usage_source == SOURCE_ESTIMATE
