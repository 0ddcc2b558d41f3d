"""Parse and validate generation bodies (chat and legacy completions) into requests.

Two stages: ``parse_chat`` / ``parse_completion`` need only the bytes (malformed JSON,
missing or wrongly typed fields, unsupported values), ``apply_limits`` needs the tenant's
limits and the resolved model version (context length, max_output, the version's
capabilities: tools, structured output, ``n``, logprobs). Every failure is a 400/413
``ApiError`` with ``param`` and ``code``; no input may raise anything else (the fuzz test
holds us to it).

Only validated fields are forwarded upstream. vLLM accepts and acts on extra fields
(``cache_salt``, ``priority``, ``kv_transfer_params``, ``vllm_xargs`` …) that must stay
under the gateway's control, so unknown parameters are refused rather than passed on.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from contracts import schema
from gateway.errors import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 4096
MAX_MODEL_LEN = 256
MAX_STOP = 4
MAX_STOP_LEN = 512
MAX_USER_LEN = 512
MAX_PROMPT_CACHE_KEY_LEN = 512
INT64_MAX = (1 << 63) - 1
# OpenAI's bounds: n and top_logprobs, tools per request, logit_bias entries, metadata.
MAX_N = 8
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
MAX_METADATA = 16
MAX_PROMPTS = 64
# A function, tool or schema name: what OpenAI accepts (and templates can render).
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# OpenAI's legacy completions default (vLLM's too): without max_tokens, 16.
COMPLETION_DEFAULT_MAX_TOKENS = 16

# A request for a capability the model version does not have: 400 with this code.
UNSUPPORTED_BY_MODEL = "unsupported_by_model"

# Accepted on chat and not forwarded: bookkeeping fields the official client may send
# (``user`` on both endpoints). What each means here is in gateway/README.md ("OpenAI
# fields"); tests/gateway/test_upstream_body.py checks none reaches a replica's body.
NOT_FORWARDED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key"})
SERVICE_TIERS = frozenset({"auto", "default"})
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
# Fields both endpoints take (parsed by ``_parse_common``).
COMMON = (
    frozenset(
        {"model", "stream", "stream_options", "n", "max_tokens", "seed", "stop", "ignore_eos"}
    )
    | {"logit_bias", "user"}
    | FLOAT_RANGES.keys()
)
KNOWN = (
    COMMON
    | NOT_FORWARDED
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
COMPLETION_KNOWN = COMMON | {"prompt", "echo", "suffix", "logprobs", "best_of"}


@dataclass(slots=True)
class GenerationRequest(ABC):
    """What the pipeline, admission and the upstream call need of any generation request
    (abstract: each endpoint's request says what it sends upstream)."""

    path: ClassVar[bytes]  # the replica's endpoint
    kind: ClassVar[str]  # "chat" or "text": how the relay reads and assembles chunks

    model: str
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    sampling: dict[str, Any] = field(default_factory=dict)  # validated, forwarded as is
    # OpenAI's ``prompt_cache_key`` (else ``user``): an affinity hint for cache-aware routing,
    # never forwarded (the router hashes it with the tenant's salt).
    cache_hint: str | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token asked for
    logprobs_param: str = "logprobs"
    top_logprobs_param: str = "top_logprobs"
    tools: bool = False  # tool definitions given (and a tool choice other than none)
    structured: bool = False  # json_object or json_schema output

    @property
    def sequences(self) -> int:
        """Sequences generated: what multiplies the output estimate in admission."""
        return self.n

    @abstractmethod
    def upstream_inputs(self) -> dict[str, Any]:
        """The endpoint's own fields of the upstream body (messages, or prompt and echo)."""


@dataclass(slots=True)
class ChatRequest(GenerationRequest):
    path: ClassVar[bytes] = b"/v1/chat/completions"
    kind: ClassVar[str] = "chat"

    # Normalised messages (role, flattened text content, name, tool calls, tool call id).
    messages: list[dict[str, Any]] = field(default_factory=list)
    # Per message, the text the replica tokenizes: its content and its tool calls' names
    # and arguments (the prompt estimate).
    message_texts: list[str] = field(default_factory=list)
    # Prompt text besides the messages: the tool definitions (as the template renders
    # them) and a json schema (guided decoding's cost, counted as if it were prompt).
    extra_texts: list[str] = field(default_factory=list)
    # The prompt's token ids as the replicas compute them, when the model's chat template is
    # configured (GATEWAY_CHAT_TEMPLATES): set by the prompt estimate, hashed by the router,
    # with where the first user message starts and ends in them (the conversation key).
    prompt_ids: list[int] | None = None
    first_user: tuple[int, int | None] | None = None

    def upstream_inputs(self) -> dict[str, Any]:
        return {"messages": self.messages}


@dataclass(slots=True)
class CompletionRequest(GenerationRequest):
    path: ClassVar[bytes] = b"/v1/completions"
    kind: ClassVar[str] = "text"

    prompts: list[str] = field(default_factory=list)
    single: bool = True  # the prompt was a string, not a list

    @property
    def sequences(self) -> int:
        return self.n * len(self.prompts)

    def upstream_inputs(self) -> dict[str, Any]:
        return {"prompt": self.prompts[0] if self.single else self.prompts}


def _bad(message: str, param: str | None, code: str = "invalid_type") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and type(value) is not bool and math.isfinite(value)


def _load_object(body: bytes, known: frozenset[str]) -> dict[str, Any]:
    if not body:
        raise _bad("The request body is empty; expected a JSON object.", None, "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"The request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("The request body must be a JSON object.", None, "invalid_json")
    for name in data:
        if name not in known:
            raise _bad(
                f"Unrecognized request argument supplied: {name}", name[:64], "unknown_parameter"
            )
    model = data.get("model")
    if model is None:
        raise _bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_LEN:
        raise _bad("'model' must be a non-empty string.", "model")
    return data


def parse_chat(body: bytes) -> ChatRequest:
    data = _load_object(body, KNOWN)
    messages, texts = _parse_messages(data.get("messages"))
    req = ChatRequest(model=data["model"], messages=messages, message_texts=texts)
    _parse_common(data, req)

    value = data.get("max_completion_tokens")
    if value is not None:
        # max_completion_tokens wins over max_tokens (as in vLLM and OpenAI).
        req.max_tokens = _positive_int(value, "max_completion_tokens")
        req.max_tokens_param = "max_completion_tokens"

    logprobs = data.get("logprobs")
    if logprobs is not None and type(logprobs) is not bool:
        raise _bad("'logprobs' must be a boolean.", "logprobs")
    top = data.get("top_logprobs")
    if top is not None:
        if not _is_int(top):
            raise _bad("'top_logprobs' must be an integer.", "top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _bad(
                f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}.",
                "top_logprobs",
                "invalid_value",
            )
        if not logprobs:
            raise _bad(
                "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value"
            )
        req.top_logprobs = top
        req.sampling["top_logprobs"] = top
    if logprobs:
        req.logprobs = True
        req.sampling["logprobs"] = True

    _parse_tools(data, req)
    _parse_response_format(data.get("response_format"), req)
    _parse_bookkeeping(data)

    cache_key = data.get("prompt_cache_key")
    if cache_key is not None:
        if not isinstance(cache_key, str):
            raise _bad("'prompt_cache_key' must be a string.", "prompt_cache_key")
        if not 0 < len(cache_key) <= MAX_PROMPT_CACHE_KEY_LEN:
            raise _bad(
                f"'prompt_cache_key' must be 1 to {MAX_PROMPT_CACHE_KEY_LEN} characters.",
                "prompt_cache_key",
                "invalid_value",
            )
        req.cache_hint = cache_key
    return req


def parse_completion(body: bytes) -> CompletionRequest:
    data = _load_object(body, COMPLETION_KNOWN)
    prompts, single = _parse_prompt(data.get("prompt"))
    req = CompletionRequest(model=data["model"], prompts=prompts, single=single)
    req.logprobs_param = req.top_logprobs_param = "logprobs"
    _parse_common(data, req)
    if req.max_tokens is None:
        req.max_tokens = COMPLETION_DEFAULT_MAX_TOKENS

    echo = data.get("echo")
    if echo is not None:
        if type(echo) is not bool:
            raise _bad("'echo' must be a boolean.", "echo")
        if echo:
            req.sampling["echo"] = True
    if data.get("suffix") is not None:
        # vLLM refuses it too: no served model has a fill-in-the-middle template.
        raise _bad("'suffix' is not supported.", "suffix", "unsupported_parameter")
    best_of = data.get("best_of")
    if best_of is not None and best_of != req.n:
        if not _is_int(best_of):
            raise _bad("'best_of' must be an integer.", "best_of")
        raise _bad(
            "'best_of' is not supported (other than equal to 'n').",
            "best_of",
            "unsupported_value",
        )
    logprobs = data.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs):
            raise _bad("'logprobs' must be an integer.", "logprobs")
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise _bad(
                f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}.",
                "logprobs",
                "invalid_value",
            )
        req.logprobs = True
        req.top_logprobs = logprobs
        req.sampling["logprobs"] = logprobs
    return req


def _parse_prompt(prompt: object) -> tuple[list[str], bool]:
    if prompt is None:
        raise _bad("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        return [prompt], True
    if not isinstance(prompt, list):
        raise _bad("'prompt' must be a string or an array of strings.", "prompt")
    if not prompt:
        raise _bad("'prompt' must not be empty.", "prompt", "empty_array")
    if len(prompt) > MAX_PROMPTS:
        raise _bad(
            f"'prompt' holds more than {MAX_PROMPTS} prompts.", "prompt", "array_above_max_length"
        )
    for i, item in enumerate(prompt):
        if not isinstance(item, str):
            # Token-id prompts would need the model's vocabulary to check and estimate.
            raise _bad(
                "'prompt' must be a string or an array of strings (token ids are not supported).",
                f"prompt[{i}]",
                "unsupported_value" if isinstance(item, list | int) else "invalid_type",
            )
    return list(prompt), False


def _positive_int(value: object, param: str) -> int:
    if not _is_int(value):
        raise _bad(f"'{param}' must be an integer.", param)
    assert isinstance(value, int)
    if value < 1:
        raise _bad(f"{value} is less than the minimum of 1 - '{param}'", param, "invalid_value")
    return value


def _parse_common(data: dict[str, Any], req: GenerationRequest) -> None:
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
        if n > MAX_N:
            raise _bad(f"{n} is greater than the maximum of {MAX_N} - 'n'", "n", "invalid_value")
        req.n = n
        if n > 1:
            req.sampling["n"] = n

    value = data.get("max_tokens")
    if value is not None:
        req.max_tokens = _positive_int(value, "max_tokens")

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

    bias = data.get("logit_bias")
    if bias is not None:
        req.sampling["logit_bias"] = _parse_logit_bias(bias)

    user = data.get("user")
    if user is not None:
        if not isinstance(user, str) or len(user) > MAX_USER_LEN:
            raise _bad(f"'user' must be a string of at most {MAX_USER_LEN} characters.", "user")
        if user:
            req.cache_hint = user


def _parse_logit_bias(bias: object) -> dict[str, float]:
    if not isinstance(bias, dict):
        raise _bad("'logit_bias' must be an object of token ids to biases.", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad(
            f"'logit_bias' holds more than {MAX_LOGIT_BIAS} entries.",
            "logit_bias",
            "invalid_value",
        )
    for token, value in bias.items():
        # Token ids past the model's vocabulary are the replica's to refuse (it knows it).
        if not (token.isascii() and token.isdigit() and len(token) <= 9):
            raise _bad(
                f"'logit_bias' keys must be token ids; got {token[:32]!r}.",
                "logit_bias",
                "invalid_value",
            )
        if not _is_number(value) or not -100 <= value <= 100:
            raise _bad(
                "'logit_bias' values must be numbers between -100 and 100.",
                "logit_bias",
                "invalid_value",
            )
    return bias


def _parse_bookkeeping(data: dict[str, Any]) -> None:
    """``metadata``, ``store`` and ``service_tier``: validated, never forwarded."""
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
            raise _bad(f"'metadata' must be an object of at most {MAX_METADATA} pairs.", "metadata")
        for key, value in metadata.items():
            if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
                raise _bad(
                    "'metadata' keys are at most 64 characters and values strings of at most 512.",
                    "metadata",
                    "invalid_value",
                )
    store = data.get("store")
    if store is not None:
        if type(store) is not bool:
            raise _bad("'store' must be a boolean.", "store")
        if store:
            raise _bad(
                "Stored completions are not offered: the gateway keeps no completion for "
                "later retrieval. Omit 'store' or set it to false.",
                "store",
                "unsupported_value",
            )
    tier = data.get("service_tier")
    if tier is not None:
        if not isinstance(tier, str):
            raise _bad("'service_tier' must be a string.", "service_tier")
        if tier not in SERVICE_TIERS:
            raise _bad(
                "Only service_tier 'auto' and 'default' are accepted: the admission class "
                "comes from your plan, not from the request.",
                "service_tier",
                "unsupported_value",
            )


# Schemas already checked, by their canonical JSON. Checking one against its metaschema
# costs ~1.5 ms of CPU here, and an agent sends the same tool definitions with every turn:
# a known schema costs one serialisation and a lookup. Bounded, emptied when full.
_VALID_SCHEMAS: set[bytes] = set()
MAX_VALID_SCHEMAS = 4096


def _check_schema(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be a JSON schema object.", param)
    try:
        key = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        raise _bad(f"'{param}' is not a valid JSON schema.", param, "invalid_value") from None
    if key in _VALID_SCHEMAS:
        return value
    try:
        validator_for(value).check_schema(value)
    except SchemaError as exc:
        raise _bad(
            f"'{param}' is not a valid JSON schema: {exc.message[:200]}", param, "invalid_value"
        ) from None
    except (RecursionError, ValueError, TypeError):
        raise _bad(f"'{param}' is not a valid JSON schema.", param, "invalid_value") from None
    if len(_VALID_SCHEMAS) >= MAX_VALID_SCHEMAS:
        _VALID_SCHEMAS.clear()
    _VALID_SCHEMAS.add(key)
    return value


def _parse_tools(data: dict[str, Any], req: ChatRequest) -> None:
    tools = data.get("tools")
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be an array.", "tools")
        if len(tools) > MAX_TOOLS:
            raise _bad(
                f"'tools' holds more than {MAX_TOOLS} tools.", "tools", "array_above_max_length"
            )
        clean: list[dict[str, Any]] = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise _bad(f"'{where}' must be an object.", where)
            if tool.get("type") != "function":
                raise _bad(f"'{where}.type' must be 'function'.", f"{where}.type", "invalid_value")
            function = tool.get("function")
            if not isinstance(function, dict):
                raise _bad(
                    f"Missing required parameter: '{where}.function'.",
                    f"{where}.function",
                    "missing_required_parameter",
                )
            clean.append({"type": "function", "function": _parse_function(function, where)})
            names.add(function["name"])
        if clean:
            req.sampling["tools"] = clean
            req.extra_texts.append(json.dumps(clean, ensure_ascii=False))

    choice = data.get("tool_choice")
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise _bad(
                    "'tool_choice' must be 'none', 'auto', 'required' or a named function.",
                    "tool_choice",
                    "invalid_value",
                )
        elif isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise _bad(
                    'A named \'tool_choice\' is {"type": "function", "function": {"name": ...}}.',
                    "tool_choice",
                )
            if name not in names:
                raise _bad(
                    f"'tool_choice' names {name[:64]!r}, which is not in 'tools'.",
                    "tool_choice",
                    "invalid_value",
                )
            choice = {"type": "function", "function": {"name": name}}
        else:
            raise _bad("'tool_choice' must be a string or an object.", "tool_choice")
        if choice != "none" and not names:
            raise _bad(
                "'tool_choice' other than 'none' needs 'tools'.", "tool_choice", "invalid_value"
            )
        if names:
            req.sampling["tool_choice"] = choice
    req.tools = bool(names) and choice != "none"

    parallel = data.get("parallel_tool_calls")
    if parallel is not None:
        if type(parallel) is not bool:
            raise _bad("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
        if names:
            req.sampling["parallel_tool_calls"] = parallel


def _parse_function(function: dict[str, Any], where: str) -> dict[str, Any]:
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(
            f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'.",
            f"{where}.function.name",
            "invalid_value",
        )
    out: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise _bad(
                f"'{where}.function.description' must be a string.",
                f"{where}.function.description",
            )
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        out["parameters"] = _check_schema(parameters, f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None:
        if type(strict) is not bool:
            raise _bad(f"'{where}.function.strict' must be a boolean.", f"{where}.function.strict")
        out["strict"] = strict
    return out


def _parse_response_format(fmt: object, req: ChatRequest) -> None:
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise _bad("'response_format' must be an object.", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        req.structured = True
        req.sampling["response_format"] = {"type": "json_object"}
        return
    if kind != "json_schema":
        raise _bad(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
            "response_format.type",
            "invalid_value",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(
            "Missing required parameter: 'response_format.json_schema'.",
            "response_format.json_schema",
            "missing_required_parameter",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(
            "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'.",
            "response_format.json_schema.name",
            "invalid_value",
        )
    out: dict[str, Any] = {"name": name}
    description = spec.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise _bad(
                "'response_format.json_schema.description' must be a string.",
                "response_format.json_schema.description",
            )
        out["description"] = description
    body = spec.get("schema")
    if body is not None:
        out["schema"] = _check_schema(body, "response_format.json_schema.schema")
        req.extra_texts.append(json.dumps(body, ensure_ascii=False))
    strict = spec.get("strict")
    if strict is not None:
        if type(strict) is not bool:
            raise _bad(
                "'response_format.json_schema.strict' must be a boolean.",
                "response_format.json_schema.strict",
            )
        out["strict"] = strict
    req.structured = True
    req.sampling["response_format"] = {"type": "json_schema", "json_schema": out}


def _parse_messages(messages: object) -> tuple[list[dict[str, Any]], list[str]]:
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
    out: list[dict[str, Any]] = []
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
        calls = _tool_calls(message.get("tool_calls"), role, where)
        text = _content_text(message.get("content"), role, where, bool(calls))
        # vLLM chat templates know "system"; "developer" is OpenAI's newer name for it.
        normal: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": text,
        }
        estimate = text or ""
        if calls:
            normal["tool_calls"] = calls
            estimate = " ".join(
                [
                    estimate,
                    *(f"{c['function']['name']} {c['function']['arguments']}" for c in calls),
                ]
            )
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
                raise _bad(
                    f"'{where}.tool_call_id' must be the id of the tool call this answers.",
                    f"{where}.tool_call_id",
                    "missing_required_parameter" if call_id is None else "invalid_type",
                )
            normal["tool_call_id"] = call_id
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str) or not 0 < len(name) <= 64:
                raise _bad(
                    f"'{where}.name' must be a string of 1 to 64 characters.", f"{where}.name"
                )
            normal["name"] = name
        out.append(normal)
        texts.append(estimate)
    return out, texts


def _tool_calls(calls: object, role: str, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, as the model made them."""
    if calls is None:
        return []
    param = f"{where}.tool_calls"
    if role != "assistant":
        raise _bad(f"'{param}' is only allowed on assistant messages.", param, "invalid_value")
    if not isinstance(calls, list):
        raise _bad(f"'{param}' must be an array.", param)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        cwhere = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(function, dict):
            raise _bad(f"'{cwhere}' must be an object with a 'function'.", cwhere)
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
            raise _bad(f"'{cwhere}.id' must be a non-empty string.", f"{cwhere}.id")
        if call.get("type", "function") != "function":
            raise _bad(f"'{cwhere}.type' must be 'function'.", f"{cwhere}.type", "invalid_value")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _bad(
                f"'{cwhere}.function.name' must be a function name.", f"{cwhere}.function.name"
            )
        if not isinstance(arguments, str):
            raise _bad(
                f"'{cwhere}.function.arguments' must be a string (JSON text).",
                f"{cwhere}.function.arguments",
            )
        out.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return out


def _content_text(content: object, role: str, where: str, has_calls: bool) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            # A tool-calling turn has no text; vLLM's templates take a null content there.
            return None if has_calls else ""
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
            kind = part["type"]
            if kind != "text":
                known = kind in ("image_url", "input_audio", "file", "refusal")
                raise _bad(
                    f"Content parts of type '{kind[:32]}' are not supported: no model served "
                    "here takes images, audio or files; send text parts only."
                    if known and kind != "refusal"
                    else f"Content parts of type '{kind[:32]}' are not supported.",
                    f"{pwhere}.type",
                    "unsupported_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{pwhere}.text' must be a string.", f"{pwhere}.text")
            parts.append(text)
        return "\n".join(parts)
    raise _bad(f"'{where}.content' must be a string or an array of text parts.", f"{where}.content")


def check_capabilities(req: GenerationRequest, version: schema.ModelVersionRecord) -> None:
    """A request for what the model version cannot do: 400 naming the parameter."""
    model = version.version

    def lacks(what: str, param: str) -> BadRequest:
        return BadRequest(
            f"The model `{model}` does not support {what}.", param=param, code=UNSUPPORTED_BY_MODEL
        )

    if req.tools and not version.supports_tools:
        raise lacks("tool calling", "tools")
    if req.structured and not version.supports_structured_output:
        raise lacks("structured output (json_object or json_schema)", "response_format")
    if req.logprobs and not version.supports_logprobs:
        raise lacks("logprobs", req.logprobs_param)
    if req.top_logprobs > max(0, version.max_top_logprobs):
        raise BadRequest(
            f"The model `{model}` returns at most {version.max_top_logprobs} alternatives per "
            f"token; '{req.top_logprobs_param}' asked for {req.top_logprobs}.",
            param=req.top_logprobs_param,
            code="invalid_value",
        )
    max_n = max(1, min(MAX_N, version.max_n))
    if req.n > max_n:
        raise BadRequest(
            f"The model `{model}` generates at most {max_n} choices per request; 'n' asked "
            f"for {req.n}.",
            param="n",
            code=UNSUPPORTED_BY_MODEL if max_n == 1 else "invalid_value",
        )


def apply_limits(
    req: GenerationRequest,
    version: schema.ModelVersionRecord,
    limit: schema.LimitRecord,
    prompt_tokens: int,
) -> int:
    """Check the request against the version's capabilities and the tenant's limits;
    return the effective max_tokens (per sequence). ``prompt_tokens`` is the longest
    single prompt (a completions request's prompts are separate sequences)."""
    check_capabilities(req, version)
    prompt_param = "messages" if req.kind == "chat" else "prompt"
    max_context = min(limit.max_context, version.context_length)
    if prompt_tokens >= max_context:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
            "messages.",
            param=prompt_param,
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
            param=prompt_param,
            code="context_length_exceeded",
        )
    return req.max_tokens
