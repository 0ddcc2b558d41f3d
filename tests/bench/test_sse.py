"""The benchmarks' one reader of OpenAI-style SSE streams (bench.loadgen.SseStream)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from bench.loadgen import SseStream, content_deltas, stream_error


async def lines(*raw: bytes) -> AsyncIterator[bytes]:
    for line in raw:
        yield line


async def test_chunks_up_to_done_and_the_pieces_of_each() -> None:
    stream = SseStream(
        lines(
            b": keep-alive\n",
            b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n',
            b"\n",
            b'data: {"choices":[{"delta":{"content":" a"}},{"delta":{"content":" b"}}]}\n',
            b'data: {"choices":[],"usage":{"completion_tokens":2}}\n',
            b"data: [DONE]\n",
            b'data: {"choices":[{"delta":{"content":"after the end"}}]}\n',
        )
    )
    chunks = [chunk async for chunk in stream]
    assert stream.done and len(chunks) == 3
    assert [content_deltas(c) for c in chunks] == [[], [" a", " b"], []]
    assert chunks[2]["usage"] == {"completion_tokens": 2}
    assert all(stream_error(c) is None for c in chunks)


async def test_a_stream_cut_before_done_is_not_done_and_errors_are_read() -> None:
    stream = SseStream(
        lines(
            b'data: {"choices":[{"delta":{"content":" a"}}]}\n',
            b'data: {"error":{"message":"replica went away","code":502}}\n',
        )
    )
    chunks = [chunk async for chunk in stream]
    assert not stream.done
    assert [stream_error(c) for c in chunks] == [None, "replica went away"]
