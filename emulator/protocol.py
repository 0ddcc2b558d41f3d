"""Request validation and response bodies in vLLM 0.33's exact shapes (vllm-api.md §2–3).

Everything here is pure: bytes in, ``ChatParams`` or ``ApiError`` out, and byte templates for
the SSE chunks so the hot path only concatenates.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

VLLM_VERSION = "0.33.0"
CACHE_SALT_MAX_CHARS = 128
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\x00")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with status = code."""

    def __init__(
        self, status: int, message: str, error_type: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.payload())


def bad_request(message: str, param: str | None = None) -> ApiError:
    """Request validation failure: vLLM maps pydantic errors to 400 ``"Bad Request"``."""
    return ApiError(400, message, "Bad Request", param)


def not_found_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def context_overflow(max_model_len: int, prompt_tokens: int) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {prompt_tokens} input tokens, which exceeds this limit. Please reduce the "
        "length of the input prompt.",
        "BadRequestError",
        "input_tokens",
    )


def max_tokens_too_large(max_tokens: int, max_model_len: int) -> ApiError:
    return ApiError(
        400,
        f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
        "Please request fewer output tokens.",
        "BadRequestError",
        "max_tokens",
    )


def service_unavailable() -> ApiError:
    return ApiError(
        503,
        "The engine is currently busy and cannot accept new requests. Please retry later.",
        "Service Unavailable",
    )


def generation_error() -> ApiError:
    return ApiError(500, "Internal server error during generation", "InternalServerError")


def validate_cache_salt(value: Any) -> str | None:
    """vLLM's ``validate_cache_salt``: non-empty, <= 128 chars, none of ``@ / \\ NUL``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request("cache_salt must be a string", "cache_salt")
    if not value:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    if len(value) > CACHE_SALT_MAX_CHARS:
        raise bad_request(
            f"cache_salt must be at most {CACHE_SALT_MAX_CHARS} characters", "cache_salt"
        )
    if any(ch in value for ch in _FORBIDDEN_SALT_CHARS):
        raise bad_request(
            "cache_salt must not contain '@', '/', '\\' or NUL characters", "cache_salt"
        )
    return value


def _int_field(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad_request(f"{name} must be an integer", name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # pydantic's lax mode accepts integral floats
    if not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    if not INT64_MIN <= value <= INT64_MAX:
        raise bad_request(f"{name} is out of the int64 range", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"{name} must be at least {minimum}, got {value}.", name)
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


@dataclass(slots=True)
class ChatParams:
    model: str
    messages: list[Any]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    priority: int
    cache_salt: str | None
    ignore_eos: bool
    seed: int | None
    min_tokens: int
    request_id: str


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"JSON decode error: {exc}", "body") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", "body")
    return body


def parse_chat_request(
    raw: bytes,
    served_model: str,
    header_request_id: str | None,
    header_priority: str | None,
) -> ChatParams:
    body = parse_json_object(raw)

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model and model != served_model:
        raise not_found_model(model)

    messages = body.get("messages")
    if messages is None:
        raise bad_request("Field required", "messages")
    if not isinstance(messages, list):
        raise bad_request("messages must be a list", "messages")
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")

    max_completion = _int_field(body, "max_completion_tokens")
    max_tokens_alias = _int_field(body, "max_tokens")
    max_tokens = max_completion if max_completion is not None else max_tokens_alias
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if max_completion is not None else "max_tokens"
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", name)

    stream = _bool_field(body, "stream")
    include_usage = False
    continuous = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if not isinstance(stream_options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        include_usage = _bool_field(stream_options, "include_usage")
        continuous = include_usage and _bool_field(stream_options, "continuous_usage_stats")

    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise bad_request("the emulator serves n=1 only", "n")

    priority = _int_field(body, "priority") or 0
    if header_priority is not None:
        try:
            priority = int(header_priority.strip())  # X-Vllm-Priority wins when it parses
        except ValueError:
            pass

    request_id = header_request_id
    if not request_id:
        body_id = body.get("request_id")
        if body_id is not None and not isinstance(body_id, str):
            raise bad_request("request_id must be a string", "request_id")
        request_id = body_id or uuid.uuid4().hex

    min_tokens = _int_field(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "min_tokens",
        )

    return ChatParams(
        model=served_model,
        messages=messages,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        priority=priority,
        cache_salt=validate_cache_salt(body.get("cache_salt")),
        ignore_eos=_bool_field(body, "ignore_eos"),
        seed=_int_field(body, "seed"),
        min_tokens=min_tokens,
        request_id=request_id,
    )


# -- responses ---------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_completion_body(
    *,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    system_fingerprint: str,
) -> bytes:
    usage = usage_dict(prompt_tokens, completion_tokens, cached_tokens)
    usage["prompt_tokens_details"].update(created_cache_tokens=None, multimodal_tokens=None)
    usage["completion_tokens_details"] = None
    return orjson.dumps(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": system_fingerprint,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


DONE_EVENT = b"data: [DONE]\n\n"


class ChunkTemplates:
    """Pre-serialised pieces of one stream's SSE events; per token only the text varies."""

    __slots__ = (
        "head",
        "role",
        "token_pre",
        "token_post",
        "token_tail",
        "final_post",
        "usage_pre",
        "usage_post",
    )

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        system_fingerprint: str,
        include_usage: bool,
    ) -> None:
        envelope = (
            b'{"id":'
            + orjson.dumps(response_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
        )
        self.head = b"data: " + envelope + b',"choices":[{"index":0,"delta":'
        self.role = (
            self.head + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":null,"prompt_text":null}\n\n'
        )
        self.token_pre = self.head + b'{"content":'
        self.token_post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]'
        self.token_tail = self.token_post + b',"kv_transfer_params":null}\n\n'
        fingerprint = b',"system_fingerprint":' + orjson.dumps(system_fingerprint)
        # The last content chunk carries system_fingerprint only when no usage chunk follows.
        self.final_post = b',"kv_transfer_params":null' + (b"" if include_usage else fingerprint)
        self.final_post += b"}\n\n"
        self.usage_pre = b"data: " + envelope + b',"choices":[],"usage":'
        self.usage_post = fingerprint + b"}\n\n"

    def token(self, piece: bytes, usage: bytes | None = None) -> bytes:
        if usage is None:
            return self.token_pre + piece + self.token_tail
        return b"".join(
            (
                self.token_pre,
                piece,
                self.token_post,
                b',"usage":',
                usage,
                b',"kv_transfer_params":null}\n\n',
            )
        )

    def final(self, piece: bytes, finish_reason: str, usage: bytes | None = None) -> bytes:
        parts = [
            self.token_pre,
            piece,
            b'},"logprobs":null,"finish_reason":',
            orjson.dumps(finish_reason),
            b',"stop_reason":null,"token_ids":null,"weight_versions":null}]',
        ]
        if usage is not None:
            parts += [b',"usage":', usage]
        parts.append(self.final_post)
        return b"".join(parts)

    def usage_event(self, prompt_tokens: int, completion_tokens: int, cached: int) -> bytes:
        usage = orjson.dumps(usage_dict(prompt_tokens, completion_tokens, cached))
        return self.usage_pre + usage + self.usage_post


def error_event(error: ApiError) -> bytes:
    """Mid-stream failure: the status is already 200, so the error rides as an event."""
    return b"data: " + error.body() + b"\n\n"
