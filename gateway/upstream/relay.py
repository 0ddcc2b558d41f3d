"""Reading the replica's SSE stream: split events, classify chunks, count, assemble.

The upstream always streams (the gateway asks for ``stream: true`` and
``stream_options.include_usage``). Streaming clients get the chunks relayed as they come;
JSON clients get one ``chat.completion`` assembled here. Classification of the common
content chunk is done on bytes, without parsing its JSON: only the first chunk, finish
chunks, the usage chunk and error events are parsed (JSON clients parse every chunk, since
their content is needed).

Continuous usage (``stream_options.continuous_usage_stats``, asked for streaming clients):
vLLM then adds the request's running ``usage`` to every chunk, role chunk included, so the
exact prompt count is known from the first chunk and the completion count from every chunk
after it, and a stream cut off before its final usage chunk (the client left, the replica
broke) is billed what the replica reported rather than the gateway's estimate.
``StreamTracker.take_usage`` finds that object without parsing the chunk: pydantic
serialises the fields in declaration order, ``usage`` right after ``choices`` and before
only null or id-list fields (vLLM's ``prompt_token_ids``, ``kv_transfer_params``; the
emulator's layout is the same), so the last ``,"usage":{`` of the chunk is it. No string
can fool the search: inside a JSON string every ``"`` is escaped, so ``,"usage":{`` occurs
only as an object key. The object holds numbers and number-only objects
(``prompt_tokens_details``), so its end is the brace that balances its first. The chunk
goes on without it, byte for byte what the replica sends without the option; the raw
object is kept (the last one per choice) and parsed only when counts are needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.serving.h1 import ReplicaBroken

DONE = b"[DONE]"
SSE_DONE = b"data: [DONE]\n\n"

# Chunk kinds returned by ``StreamTracker.observe``.
CONTENT = 0
USAGE = 1
ERROR = 2
END = 3
OTHER = 4


# Continuous usage: the key that opens a chunk's usage object, and what precedes the
# final usage chunk's (``"choices":[]``), which is relayed as before, not stripped.
_LIVE_USAGE = b',"usage":{'
_USAGE_OBJECT = len(_LIVE_USAGE) - 1
_OPEN_LIST, _CLOSE_LIST = ord("["), ord("]")
_CHOICE_INDEX = b'"choices":[{"index":'

# Where the billed counts came from (``StreamTracker.usage_source``).
SOURCE_FINAL = "final"  # the replica's usage chunk (or a JSON client's)
SOURCE_CONTINUOUS = "continuous"  # the replica's last per-chunk counts (cut-off stream)
SOURCE_ESTIMATE = "estimate"  # the gateway's prompt estimate and its own chunk count
SOURCE_NONE = "none"  # nothing was produced: nothing to bill

# The largest event a replica may send (a chunk is a few hundred bytes; a usage or error
# event a few KiB): past it the stream is failed rather than buffered without end.
MAX_EVENT_BYTES = 1 << 20


class EventTooLarge(ReplicaBroken):
    """An SSE event grew past ``MAX_EVENT_BYTES`` without its terminating blank line."""


class SSEEvents:
    """Incremental SSE parsing: feed network reads, get the ``data:`` payloads of the
    events they complete (one list per read, so a read's events go out in one send).

    A plain class rather than an async generator: the relay calls ``feed`` once per
    upstream read, and every async-generator layer costs a frame resume per read.

    An unfinished event is kept as a list of reads, joined only once a read can complete
    it (so a large event arriving in many reads costs linear, not quadratic, copying), and
    is bounded by ``max_event_bytes``.
    """

    __slots__ = ("_buffer", "_parts", "_pending", "_max")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = b""
        self._parts: list[bytes] = []
        self._pending = 0
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._buffer:
            last = (self._parts[-1] if self._parts else self._buffer)[-1:]
            if b"\n\n" not in chunk and b"\r" not in chunk and last not in (b"\n", b"\r"):
                # Cannot complete the pending event: keep the read, do not re-copy.
                self._parts.append(chunk)
                self._pending += len(chunk)
                self._check_size()
                return []
            if self._parts:
                chunk = b"".join(self._parts) + chunk
                self._parts = []
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            self._buffer = buffer
            self._pending = len(buffer)
            self._check_size()
            return []
        *events, self._buffer = buffer.split(b"\n\n")
        self._pending = len(self._buffer)
        self._check_size()
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

    def _check_size(self) -> None:
        if self._pending > self._max:
            self._buffer, self._parts, self._pending = b"", [], 0
            raise EventTooLarge(f"an SSE event from the replica exceeded {self._max} bytes")

    def close(self) -> list[bytes]:
        """The payloads of an unterminated last event at the end of the body."""
        if self._parts:
            self._buffer += b"".join(self._parts)
            self._parts = []
        buffer, self._buffer = self._buffer, b""
        if not buffer.strip():
            return []
        return [
            line[6:] if line[5:6] == b" " else line[5:]
            for line in buffer.split(b"\n")
            if line.startswith(b"data:")
        ]


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
    kind: str = "chat"  # "chat" (chat.completion.chunk) or "text" (text_completion)
    choices: dict[int, ChoiceParts] = field(default_factory=dict)  # JSON clients: by index
    # Continuous usage: the last raw ``usage`` object seen per choice index, and how many
    # choices each prompt has (``n``: choice ``i`` is prompt ``i // n``'s).
    live: dict[int, bytes] = field(default_factory=dict)
    n: int = 1
    indexed: bool = False  # more than one choice: read each chunk's choice index

    def take_usage(self, data: bytes) -> bytes:
        """The chunk without its continuous ``usage`` object, which is kept; the final
        usage chunk (``choices: []``) and a chunk without one come back unchanged."""
        start = data.rfind(_LIVE_USAGE)
        if start < 0:
            return data
        body = start + _USAGE_OBJECT  # the object's "{"
        end = data.find(b"}", body)
        if end < 0 or (data[start - 1] == _CLOSE_LIST and data[start - 2] == _OPEN_LIST):
            return data  # unterminated, or the final usage chunk's ("choices":[])
        if data.find(b"{", body + 1, end) >= 0:
            end = _object_end(data, body, end)  # a nested object (prompt_tokens_details)
            if end < 0:
                return data
        index = 0
        if self.indexed:
            at = data.find(_CHOICE_INDEX)
            if at >= 0:
                at += len(_CHOICE_INDEX)
                digits = at
                while data[digits : digits + 1].isdigit():
                    digits += 1
                index = int(data[at:digits] or b"0")
        self.live[index] = data[body : end + 1]
        return data[:start] + data[end + 1 :]

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
        if self.kind == "chat":
            if (b'"content":"' in data and b'"content":""' not in data) or (
                b'"tool_calls":[' in data
            ):
                self._token(now)
        elif b'"text":"' in data and b'"text":""' not in data:
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
            if self.kind == "chat":
                delta = choice.get("delta") or {}
                content = delta.get("content")
                calls = delta.get("tool_calls")
            else:
                content, calls = choice.get("text"), None
            if content or calls:
                self._token(now)
            if self.assemble:
                self._choice(choice.get("index", 0)).add(content, calls, choice)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if usage:
            self.usage = usage
        return CONTENT

    def _choice(self, index: object) -> ChoiceParts:
        key = index if isinstance(index, int) else 0
        parts = self.choices.get(key)
        if parts is None:
            parts = self.choices[key] = ChoiceParts()
        return parts

    # -- results -----------------------------------------------------------------------
    def live_counts(self) -> tuple[int, int, int] | None:
        """(prompt, completion, cached) from the continuous usage seen so far: completion
        summed over the choices, prompt (and cached) once per prompt that reported; None
        before any chunk carried one."""
        if not self.live:
            return None
        prompts: dict[int, tuple[int, int]] = {}
        completion = 0
        for index, raw in self.live.items():
            try:
                usage = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(usage, dict):
                continue
            count = usage.get("completion_tokens")
            if type(count) is int:
                completion += count
            prompt = usage.get("prompt_tokens")
            if type(prompt) is int:
                prompts.setdefault(index // max(1, self.n), (prompt, _cached(usage)))
        if not prompts:
            return None
        return (
            sum(p for p, _ in prompts.values()),
            completion,
            sum(c for _, c in prompts.values()),
        )

    def _final(self, name: str) -> int | None:
        value = self.usage.get(name) if self.usage is not None else None
        return value if type(value) is int else None

    @property
    def usage_source(self) -> str:
        if self._final("prompt_tokens") is not None:
            return SOURCE_FINAL
        if self.live_counts() is not None:
            return SOURCE_CONTINUOUS
        return SOURCE_ESTIMATE if self.first_chunk_at is not None and self.tokens else SOURCE_NONE

    @property
    def completion_tokens(self) -> int:
        final = self._final("completion_tokens")
        if final is not None:
            return final
        live = self.live_counts()
        return live[1] if live is not None else self.tokens

    def prompt_tokens(self, estimate: int) -> int:
        """Exact from upstream usage (the final chunk's, else the last continuous counts);
        without either, the estimate once prefill is known to have run. Rule 1 of the
        billing rule (metering/rules.py) is decided here: the consumer bills this as is."""
        final = self._final("prompt_tokens")
        if final is not None:
            return final
        live = self.live_counts()
        if live is not None:
            return live[0]
        return estimate if self.first_chunk_at is not None and self.tokens else 0

    @property
    def cached_tokens(self) -> int:
        if self.usage is not None:
            return _cached(self.usage)
        live = self.live_counts()
        return live[2] if live is not None else 0

    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return round((self.first_token_at - self.started) * 1000.0, 3)

    def tpot_ms(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        return round((self.last_token_at - self.first_token_at) * 1000.0 / (self.tokens - 1), 3)

    def completion(self, request_model: str, prompt_estimate: int) -> dict[str, Any]:
        """The OpenAI ``chat.completion`` (or ``text_completion``) object for a JSON client."""
        usage = dict(self.usage) if self.usage else {}
        prompt = self.prompt_tokens(prompt_estimate)
        usage.setdefault("prompt_tokens", prompt)
        usage.setdefault("completion_tokens", self.completion_tokens)
        usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
        chat = self.kind == "chat"
        choices = [
            parts.chat_choice(index) if chat else parts.text_choice(index)
            for index, parts in sorted((self.choices or {0: ChoiceParts()}).items())
        ]
        return {
            "id": self.chunk_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created if self.created is not None else int(time.time()),
            "model": self.model or request_model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": self.system_fingerprint,
        }


def _object_end(data: bytes, body: int, end: int) -> int:
    """Where the object opened at ``body`` closes, given its first ``}`` at ``end`` (the
    object holds no strings, so braces are structure); -1 if the chunk ends first."""
    opened = data.count(b"{", body, end)
    while opened > 1:  # one more closing brace for each one opened
        nxt = data.find(b"}", end + 1)
        if nxt < 0:
            return -1
        opened += data.count(b"{", end + 1, nxt) - 1
        end = nxt
    return end


def _cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(cached) if type(cached) is int else 0


@dataclass(slots=True)
class ChoiceParts:
    """One choice of a stream, assembled for a JSON client: its text, its tool calls
    (fragments merged by their index, as the SDK's stream accumulator does), its logprobs."""

    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    # chat: the ``logprobs.content`` entries; text: the four parallel lists
    token_logprobs: list[Any] | None = None
    text_logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None

    def add(self, content: object, calls: object, choice: dict[str, Any]) -> None:
        if isinstance(content, str) and content:
            self.text.append(content)
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    self._call_fragment(call)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if "content" in logprobs:
                entries = logprobs.get("content")
                if isinstance(entries, list):
                    self.token_logprobs = (self.token_logprobs or []) + entries
            else:
                merged = self.text_logprobs or {}
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    values = logprobs.get(name)
                    if isinstance(values, list):
                        merged.setdefault(name, []).extend(values)
                self.text_logprobs = merged
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def _call_fragment(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        index = index if isinstance(index, int) else 0
        slot = self.tool_calls.get(index)
        if slot is None:
            slot = self.tool_calls[index] = {
                "id": None,
                "type": "function",
                "function": {"name": "", "arguments": ""},
            }
        if isinstance(call.get("id"), str):
            slot["id"] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                slot["function"]["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                slot["function"]["arguments"] += function["arguments"]

    def chat_choice(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = [call for _, call in sorted(self.tool_calls.items())]
            if not self.text:
                message["content"] = None  # a tool-calling turn has no text (as vLLM says)
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": self.token_logprobs}
            if self.token_logprobs is not None
            else None,
            "finish_reason": self.finish_reason or "stop",
        }

    def text_choice(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "text": "".join(self.text),
            "logprobs": self.text_logprobs,
            "finish_reason": self.finish_reason or "stop",
            "stop_reason": self.stop_reason,
        }
