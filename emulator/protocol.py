"""Request validation and response bodies in vLLM 0.33's exact shapes.

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
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    stop: list[str] | None = None

    @property
    def plain(self) -> bool:
        """Served by the single-choice fast path (no choices, tools, logprobs or schema)."""
        return (
            self.n == 1
            and not self.logprobs
            and self.tool_choice == "none"
            and (self.response_format is None or self.response_format.get("type") == "text")
        )


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
    check_model(body, served_model)

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
    include_usage, continuous = parse_stream_options(body, stream)

    n = parse_n(body)

    priority = parse_priority(body, header_priority)
    request_id = parse_request_id(body, header_request_id)
    min_tokens = parse_min_tokens(body, max_tokens)

    sampling = parse_sampling(body)
    logprobs = _bool_field(body, "logprobs")
    top_logprobs = _int_field(body, "top_logprobs")
    if top_logprobs is not None:
        if not logprobs:
            raise bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        _check_logprobs_count(top_logprobs, "top_logprobs")
    tools, tool_choice = parse_tools(body)
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
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_bool_field(body, "parallel_tool_calls", default=True),
        response_format=parse_response_format(body),
        stop=sampling.stop,
    )


# -- fields shared by chat and completions -------------------------------------------------


def check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model and model != served_model:
        raise not_found_model(model)


def parse_stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) from ``stream_options``."""
    stream_options = body.get("stream_options")
    if stream_options is None:
        return False, False
    if not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    if not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = _bool_field(stream_options, "include_usage")
    return include_usage, include_usage and _bool_field(stream_options, "continuous_usage_stats")


def parse_priority(body: dict[str, Any], header_priority: str | None) -> int:
    priority = _int_field(body, "priority") or 0
    if header_priority is not None:
        try:
            priority = int(header_priority.strip())  # X-Vllm-Priority wins when it parses
        except ValueError:
            pass
    return priority


def parse_request_id(body: dict[str, Any], header_request_id: str | None) -> str:
    if header_request_id:
        return header_request_id
    body_id = body.get("request_id")
    if body_id is not None and not isinstance(body_id, str):
        raise bad_request("request_id must be a string", "request_id")
    return body_id or uuid.uuid4().hex


def parse_min_tokens(body: dict[str, Any], max_tokens: int | None) -> int:
    min_tokens = _int_field(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "min_tokens",
        )
    return min_tokens


MAX_N = 128  # the emulator's bound; vLLM bounds n only through memory


def parse_n(body: dict[str, Any]) -> int:
    n = _int_field(body, "n")
    if n is None:
        return 1
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {n}.", "n")
    return n


def _check_logprobs_count(value: int, param: str) -> None:
    from emulator.logprobs import MAX_LOGPROBS

    if value < 0:
        raise bad_request(f"`{param}` must be a non-negative value.", param)
    if value > MAX_LOGPROBS:
        raise bad_request(
            f"Requested sample logprobs of {value}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            param,
        )


def _float_field(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number", name)
    return float(value)


@dataclass(slots=True)
class Sampling:
    stop: list[str] | None


def parse_sampling(body: dict[str, Any]) -> Sampling:
    """The sampling fields vLLM validates (``SamplingParams._verify_args``); the emulator does
    not sample, so beyond validation they change nothing."""
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        value = _float_field(body, name)
        if value is not None and not low <= value <= high:
            raise bad_request(f"{name} must be in [{low:g}, {high:g}], got {value:g}.", name)
    temperature = _float_field(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad_request(f"temperature must be non-negative, got {temperature:g}.", "temperature")
    top_p = _float_field(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p:g}.", "top_p")
    repetition = _float_field(body, "repetition_penalty")
    if repetition is not None and repetition <= 0:
        raise bad_request(
            f"repetition_penalty must be greater than zero, got {repetition:g}.",
            "repetition_penalty",
        )
    bias = body.get("logit_bias")
    if bias is not None:
        from emulator.tokenizer import VOCAB_SIZE

        if not isinstance(bias, dict):
            raise bad_request("logit_bias must be an object of token id -> bias", "logit_bias")
        bad: list[str] = []
        for key, value in bias.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"logit_bias[{key!r}] must be a number", "logit_bias")
            try:
                token = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias key {key!r} is not a token id", "logit_bias"
                ) from None
            if not 0 <= token < VOCAB_SIZE:
                bad.append(str(token))
        if bad:
            raise bad_request(
                f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {VOCAB_SIZE}",
                "logit_bias",
            )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user")
    stop = body.get("stop")
    stops: list[str] | None
    if stop is None:
        stops = None
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad_request("stop must be a string or a list of strings", "stop")
    return Sampling(stop=stops)


def parse_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    """``tools`` and ``tool_choice`` as vLLM checks them (``check_tool_usage``): function
    tools only, ``tool_choice`` defaulting to ``auto`` when tools are given, a named choice
    that must be one of the tools, no choice other than ``none`` without tools."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        for index, tool in enumerate(tools):
            where = f"tools.{index}"
            if not isinstance(tool, dict):
                raise bad_request(f"{where} must be an object", where)
            if tool.get("type", "function") != "function":
                raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
            function = tool.get("function")
            if not isinstance(function, dict):
                raise bad_request("Field required", f"{where}.function")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(
                    "a function needs a non-empty string name", f"{where}.function.name"
                )
            parameters = function.get("parameters")
            if parameters is not None:
                from emulator.structured import check_schema

                problem = check_schema(parameters)
                if problem is not None:
                    raise bad_request(problem, f"{where}.function.parameters")
        if not tools:
            tools = None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or a named function",
                "tool_choice",
            )
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
    else:
        raise bad_request("tool_choice must be a string or an object", "tool_choice")
    if choice != "none" and tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        assert tools is not None
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return tools, choice


def parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "When response_format type is 'json_schema', 'json_schema' must be provided",
                "response_format.json_schema",
            )
        if not isinstance(spec.get("name"), str):
            raise bad_request("Field required", "response_format.json_schema.name")
        schema = spec.get("schema", {})
        from emulator.structured import check_schema

        problem = check_schema(schema)
        if problem is not None:
            raise bad_request(problem, "response_format.json_schema.schema")
        return {"type": "json_schema", "schema": schema, "name": spec["name"]}
    raise bad_request(
        "response_format.type must be 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )


# -- responses ---------------------------------------------------------------------------


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None
) -> dict[str, Any]:
    """``cached_tokens`` None: no ``prompt_tokens_details`` (vLLM without
    ``--enable-prompt-tokens-details``, its default)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def chat_completion_body(
    *,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None,
    system_fingerprint: str,
) -> bytes:
    usage = usage_dict(prompt_tokens, completion_tokens, cached_tokens)
    details = usage.get("prompt_tokens_details")
    if details is None:
        usage["prompt_tokens_details"] = None  # non-streaming bodies keep null fields
    else:
        details.update(created_cache_tokens=None, multimodal_tokens=None)
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
        "role_pre",
        "role_post",
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
        self.role_pre = (
            self.head + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
        )
        self.role_post = b',"prompt_token_ids":null,"prompt_text":null}\n\n'
        self.role = self.role_pre + self.role_post
        self.token_pre = self.head + b'{"content":'
        self.token_post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]'
        self.token_tail = self.token_post + b',"kv_transfer_params":null}\n\n'
        fingerprint = b',"system_fingerprint":' + orjson.dumps(system_fingerprint)
        # The last content chunk carries system_fingerprint only when no usage chunk follows.
        self.final_post = b',"kv_transfer_params":null' + (b"" if include_usage else fingerprint)
        self.final_post += b"}\n\n"
        self.usage_pre = b"data: " + envelope + b',"choices":[],"usage":'
        self.usage_post = fingerprint + b"}\n\n"

    def role_with_usage(self, usage: bytes) -> bytes:
        """The role chunk under ``continuous_usage_stats``: vLLM gives it the prompt's count
        (``completion_tokens`` 0), between ``choices`` and ``prompt_token_ids``."""
        return self.role_pre + b',"usage":' + usage + self.role_post

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

    def usage_event(self, prompt_tokens: int, completion_tokens: int, cached: int | None) -> bytes:
        usage = orjson.dumps(usage_dict(prompt_tokens, completion_tokens, cached))
        return self.usage_pre + usage + self.usage_post


def error_event(error: ApiError) -> bytes:
    """Mid-stream failure: the status is already 200, so the error rides as an event."""
    return b"data: " + error.body() + b"\n\n"


# -- legacy completions --------------------------------------------------------------------

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (OpenAI's too)


@dataclass(slots=True)
class CompletionParams:
    model: str
    prompts: list[str | list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    priority: int
    cache_salt: str | None
    ignore_eos: bool
    seed: int | None
    min_tokens: int
    request_id: str
    n: int
    echo: bool
    logprobs: int | None
    stop: list[str] | None


def _token_ids(value: list[Any], param: str) -> list[int]:
    from emulator.tokenizer import VOCAB_SIZE

    if not value:
        raise bad_request("prompt must not be empty", param)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad_request("a token-id prompt must be a list of integers", param)
        if not 0 <= token < VOCAB_SIZE:
            raise bad_request(f"Token id {token} is out of vocabulary", param)
    return list(value)


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of those."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("Field required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(
            "prompt must be a string, a list of strings or a list of token ids", "prompt"
        )
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_token_ids(prompt, "prompt")]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, f"prompt.{i}") for i, p in enumerate(prompt)]
    raise bad_request("prompt must be a string, a list of strings or a list of token ids", "prompt")


def parse_completion_request(
    raw: bytes,
    served_model: str,
    header_request_id: str | None,
    header_priority: str | None,
) -> CompletionParams:
    body = parse_json_object(raw)
    check_model(body, served_model)
    prompts = _prompts(body)
    if body.get("suffix") is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    stream = _bool_field(body, "stream")
    include_usage, continuous = parse_stream_options(body, stream)
    logprobs = _int_field(body, "logprobs")
    if logprobs is not None:
        _check_logprobs_count(logprobs, "logprobs")
    echo = _bool_field(body, "echo")
    if echo and any(not isinstance(p, str) for p in prompts):
        # The emulator's tokenizer cannot decode prompt token ids back to text.
        raise bad_request("echo is supported with text prompts only by this emulator", "echo")
    priority = parse_priority(body, header_priority)
    request_id = parse_request_id(body, header_request_id)
    min_tokens = parse_min_tokens(body, max_tokens)
    sampling = parse_sampling(body)
    return CompletionParams(
        model=served_model,
        prompts=prompts,
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
        n=parse_n(body),
        echo=echo,
        logprobs=logprobs,
        stop=sampling.stop,
    )
