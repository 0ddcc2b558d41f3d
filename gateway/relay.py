"""Reading the replica's SSE stream: split events, classify chunks, count, assemble.

The upstream always streams (the gateway asks for ``stream: true`` and
``stream_options.include_usage``). Streaming clients get the chunks relayed as they come;
JSON clients get one ``chat.completion`` assembled here. Classification of the common
content chunk is done on bytes, without parsing its JSON: only the first chunk, finish
chunks, the usage chunk and error events are parsed (JSON clients parse every chunk, since
their content is needed).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"[DONE]"
SSE_DONE = b"data: [DONE]\n\n"

# Chunk kinds returned by ``StreamTracker.observe``.
CONTENT = 0
USAGE = 1
ERROR = 2
END = 3
OTHER = 4


class SSEEvents:
    """Incremental SSE parsing: feed network reads, get the ``data:`` payloads of the
    events they complete (one list per read, so a read's events go out in one send).

    A plain class rather than an async generator: the relay calls ``feed`` once per
    upstream read, and every async-generator layer costs a frame resume per read.
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            self._buffer = buffer
            return []
        *events, self._buffer = buffer.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                out.append(event[6:])  # vLLM's shape: one data line per event
                continue
            out.extend(
                line[6:] if line[5:6] == b" " else line[5:]
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            )
        return out

    def close(self) -> list[bytes]:
        """The payloads of an unterminated last event at the end of the body."""
        buffer, self._buffer = self._buffer, b""
        if not buffer.strip():
            return []
        return [
            line[6:] if line[5:6] == b" " else line[5:]
            for line in buffer.split(b"\n")
            if line.startswith(b"data:")
        ]


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of an SSE body, batched per network read."""
    events = SSEEvents()
    async for chunk in chunks:
        batch = events.feed(chunk)
        if batch:
            yield batch
    for payload in events.close():
        yield [payload]


@dataclass(slots=True)
class StreamTracker:
    """Everything the terminal handler and the JSON assembly need from a stream."""

    assemble: bool = False  # keep the content (JSON clients)
    started: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0  # content chunks seen: one token each at vLLM's default stream interval
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    chunk_id: str | None = None
    created: int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    parts: list[str] = field(default_factory=list)

    def observe(self, data: bytes, now: float) -> int:
        if data == DONE:
            self.done = True
            return END
        if self.first_chunk_at is None:
            self.first_chunk_at = now
            return self._parse(data, now)
        if data.startswith(b'{"error"'):
            return self._parse(data, now)
        if self.assemble or b'"finish_reason":"' in data or b'"usage":{' in data:
            return self._parse(data, now)
        if b'"content":"' in data and b'"content":""' not in data:
            self._token(now)
        return CONTENT

    def _token(self, now: float) -> None:
        self.tokens += 1
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now

    def _parse(self, data: bytes, now: float) -> int:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return OTHER
        if not isinstance(obj, dict):
            return OTHER
        if "error" in obj:
            error = obj["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
            return ERROR
        if self.chunk_id is None:
            self.chunk_id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
        if obj.get("system_fingerprint"):
            self.system_fingerprint = obj["system_fingerprint"]
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if usage and not choices:
            self.usage = usage
            return USAGE
        for choice in choices:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self._token(now)
                if self.assemble:
                    self.parts.append(content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return CONTENT

    # -- results -----------------------------------------------------------------------
    @property
    def completion_tokens(self) -> int:
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return self.tokens

    def prompt_tokens(self, estimate: int) -> int:
        """Exact from upstream usage; the estimate once prefill is known to have run."""
        if self.usage is not None and isinstance(self.usage.get("prompt_tokens"), int):
            return int(self.usage["prompt_tokens"])
        return estimate if self.first_chunk_at is not None and self.tokens else 0

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return int(cached) if isinstance(cached, int) else 0

    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return round((self.first_token_at - self.started) * 1000.0, 3)

    def tpot_ms(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        return round((self.last_token_at - self.first_token_at) * 1000.0 / (self.tokens - 1), 3)

    def completion(self, request_model: str, prompt_estimate: int) -> dict[str, Any]:
        """The OpenAI ``chat.completion`` object for a JSON client."""
        usage = dict(self.usage) if self.usage else {}
        prompt = self.prompt_tokens(prompt_estimate)
        usage.setdefault("prompt_tokens", prompt)
        usage.setdefault("completion_tokens", self.completion_tokens)
        usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
        return {
            "id": self.chunk_id,
            "object": "chat.completion",
            "created": self.created if self.created is not None else int(time.time()),
            "model": self.model or request_model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(self.parts)},
                    "logprobs": None,
                    "finish_reason": self.finish_reason or "stop",
                }
            ],
            "usage": usage,
            "system_fingerprint": self.system_fingerprint,
        }
