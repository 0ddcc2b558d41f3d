"""Parse and validate a chat-completions body into a ``ChatRequest``.

Two stages: ``parse_chat`` needs only the bytes (malformed JSON, missing or wrongly typed
fields, unsupported values), ``apply_limits`` needs the tenant's limits for the resolved
model (context length, max_output). Every failure is a 400/413 ``ApiError`` with ``param``
and ``code``; no input may raise anything else (the fuzz test holds us to it).

Only validated fields are forwarded upstream. vLLM accepts and acts on extra fields
(``cache_salt``, ``priority``, ``kv_transfer_params``, ``vllm_xargs`` …) that must stay
under the gateway's control, so unknown parameters are refused rather than passed on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway import schema
from gateway.errors import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant"})
MAX_MESSAGES = 4096
MAX_MODEL_LEN = 256
MAX_STOP = 4
MAX_STOP_LEN = 512
MAX_USER_LEN = 512
INT64_MAX = (1 << 63) - 1

# Accepted and not forwarded: bookkeeping fields the official client may send.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
KNOWN = (
    frozenset(
        {
            "model",
            "messages",
            "stream",
            "stream_options",
            "n",
            "max_tokens",
            "max_completion_tokens",
            "seed",
            "stop",
            "ignore_eos",
            "logprobs",
            "top_logprobs",
            "response_format",
        }
    )
    | IGNORED
    | FLOAT_RANGES.keys()
)


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # normalised: role + flattened text content (+ name)
    message_texts: list[str]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    sampling: dict[str, Any] = field(default_factory=dict)  # validated, forwarded as is


def _bad(message: str, param: str | None, code: str = "invalid_type") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and type(value) is not bool and math.isfinite(value)


def parse_chat(body: bytes) -> ChatRequest:
    if not body:
        raise _bad("The request body is empty; expected a JSON object.", None, "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"The request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("The request body must be a JSON object.", None, "invalid_json")

    for name in data:
        if name not in KNOWN:
            raise _bad(
                f"Unrecognized request argument supplied: {name}", name[:64], "unknown_parameter"
            )

    model = data.get("model")
    if model is None:
        raise _bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_LEN:
        raise _bad("'model' must be a non-empty string.", "model")

    messages, texts = _parse_messages(data.get("messages"))
    req = ChatRequest(model=model, messages=messages, message_texts=texts)

    stream = data.get("stream")
    if stream is not None and type(stream) is not bool:
        raise _bad("'stream' must be a boolean.", "stream")
    req.stream = bool(stream)

    options = data.get("stream_options")
    if options is not None:
        if not req.stream:
            raise _bad(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
                "invalid_value",
            )
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object.", "stream_options")
        for name, value in options.items():
            if name != "include_usage":
                raise _bad(
                    f"Unrecognized stream option: {name}", "stream_options", "unknown_parameter"
                )
            if value is not None and type(value) is not bool:
                raise _bad(
                    "'stream_options.include_usage' must be a boolean.",
                    "stream_options.include_usage",
                )
            req.include_usage = bool(value)

    n = data.get("n")
    if n is not None:
        if not _is_int(n):
            raise _bad("'n' must be an integer.", "n")
        if n < 1:
            raise _bad(f"{n} is less than the minimum of 1 - 'n'", "n", "invalid_value")
        if n != 1:
            raise _bad("Only n=1 is supported.", "n", "unsupported_value")

    for param in ("max_tokens", "max_completion_tokens"):
        value = data.get(param)
        if value is None:
            continue
        if not _is_int(value):
            raise _bad(f"'{param}' must be an integer.", param)
        if value < 1:
            raise _bad(f"{value} is less than the minimum of 1 - '{param}'", param, "invalid_value")
        # max_completion_tokens wins when both are set (as in vLLM and OpenAI).
        if req.max_tokens is None or param == "max_completion_tokens":
            req.max_tokens, req.max_tokens_param = value, param

    for param, (low, high) in FLOAT_RANGES.items():
        value = data.get(param)
        if value is None:
            continue
        if not _is_number(value):
            raise _bad(f"'{param}' must be a number.", param)
        if not low <= value <= high:
            raise _bad(f"'{param}' must be between {low:g} and {high:g}.", param, "invalid_value")
        req.sampling[param] = value

    seed = data.get("seed")
    if seed is not None:
        if not _is_int(seed) or not -INT64_MAX - 1 <= seed <= INT64_MAX:
            raise _bad("'seed' must be a 64-bit integer.", "seed")
        req.sampling["seed"] = seed

    stop = data.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in stops)
        ):
            raise _bad(
                f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings.",
                "stop",
            )
        if stops:
            req.sampling["stop"] = stops

    ignore_eos = data.get("ignore_eos")
    if ignore_eos is not None:
        if type(ignore_eos) is not bool:
            raise _bad("'ignore_eos' must be a boolean.", "ignore_eos")
        req.sampling["ignore_eos"] = ignore_eos

    logprobs = data.get("logprobs")
    if logprobs is not None and type(logprobs) is not bool:
        raise _bad("'logprobs' must be a boolean.", "logprobs")
    if logprobs or data.get("top_logprobs") is not None:
        raise _bad("logprobs are not supported.", "logprobs", "unsupported_parameter")

    response_format = data.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _bad(
            "Only response_format {'type': 'text'} is supported.",
            "response_format",
            "unsupported_value",
        )

    user = data.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_LEN):
        raise _bad(f"'user' must be a string of at most {MAX_USER_LEN} characters.", "user")
    return req


def _parse_messages(messages: object) -> tuple[list[dict[str, str]], list[str]]:
    if messages is None:
        raise _bad(
            "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise _bad("'messages' must be an array.", "messages")
    if not messages:
        raise _bad("'messages' must contain at least one message.", "messages", "empty_array")
    if len(messages) > MAX_MESSAGES:
        raise _bad(
            f"'messages' holds more than {MAX_MESSAGES} messages.",
            "messages",
            "array_above_max_length",
        )
    out: list[dict[str, str]] = []
    texts: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"'{where}' must be an object.", where)
        role = message.get("role")
        if role is None:
            raise _bad(
                f"Missing required parameter: '{where}.role'.",
                f"{where}.role",
                "missing_required_parameter",
            )
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(
                f"'{where}.role' must be one of {sorted(ROLES)}.", f"{where}.role", "invalid_value"
            )
        text = _content_text(message.get("content"), role, where)
        # vLLM chat templates know "system"; "developer" is OpenAI's newer name for it.
        normal = {"role": "system" if role == "developer" else role, "content": text}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str) or not 0 < len(name) <= 64:
                raise _bad(
                    f"'{where}.name' must be a string of 1 to 64 characters.", f"{where}.name"
                )
            normal["name"] = name
        out.append(normal)
        texts.append(text)
    return out, texts


def _content_text(content: object, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise _bad(
            f"Missing required parameter: '{where}.content'.",
            f"{where}.content",
            "missing_required_parameter",
        )
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(f"'{pwhere}' must be an object with a 'type'.", pwhere)
            if part["type"] != "text":
                raise _bad(
                    f"Content parts of type '{part['type'][:32]}' are not supported.",
                    f"{pwhere}.type",
                    "unsupported_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{pwhere}.text' must be a string.", f"{pwhere}.text")
            parts.append(text)
        return "\n".join(parts)
    raise _bad(f"'{where}.content' must be a string or an array of text parts.", f"{where}.content")


def apply_limits(
    req: ChatRequest,
    version: schema.ModelVersionRecord,
    limit: schema.LimitRecord,
    prompt_tokens: int,
) -> int:
    """Check the request against the tenant's limits; return the effective max_tokens."""
    max_context = min(limit.max_context, version.context_length)
    if prompt_tokens >= max_context:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
            "messages.",
            param="messages",
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(limit.max_output, max_context - prompt_tokens)
    if req.max_tokens > limit.max_output:
        raise BadRequest(
            f"{req.max_tokens_param} is too large: {req.max_tokens}. This model supports at "
            f"most {limit.max_output} completion tokens for your organization.",
            param=req.max_tokens_param,
            code="invalid_value",
        )
    if prompt_tokens + req.max_tokens > max_context:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {prompt_tokens + req.max_tokens} tokens ({prompt_tokens} in the "
            f"messages, {req.max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="messages",
            code="context_length_exceeded",
        )
    return req.max_tokens
