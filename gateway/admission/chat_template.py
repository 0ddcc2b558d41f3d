"""A real model's prompt token ids: its chat template rendered as transformers'
``apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=False)``
renders it, then tokenized with its ``tokenizer.json`` without adding special tokens (the
template writes BOS itself; vLLM's chat path tokenizes with ``add_special_tokens=False``).

Those are the ids a vLLM replica hashes into its prefix-cache blocks, so with a model's
template and tokenizer configured (``GATEWAY_CHAT_TEMPLATES`` with
``GATEWAY_TOKENIZER_FILES``, gateway/README.md "Tokens") the gateway's block hashes match
the replicas' KV-cache events, and its prompt count is exact.

The Jinja environment is transformers': sandboxed (immutable), ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that is
``json.dumps`` (no HTML escaping, ``ensure_ascii=False`` by default, with ``indent``,
``separators`` and ``sort_keys``), the globals ``raise_exception`` (a template error),
``strftime_now`` (local time), ``dict`` and ``namespace`` (names with a leading underscore
refused), and a ``{% generation %}`` block that renders its body. The template sees
``messages``, ``tools`` (None without), ``documents`` (None), ``add_generation_prompt`` and
the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...), as
transformers passes them. Like vLLM, an assistant message's tool-call ``arguments`` (a JSON
string in OpenAI's format) are given to the template as the object they encode, and a tool
definition as vLLM's request model dumps it (``description`` and ``parameters`` null when
absent).
tests/gateway/test_chat_template.py checks the ids against transformers' own
(tests/data/chat_template_vectors.json, made by tests/gateway/chat_template_vectors.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.admission.tokens import ExactCounter


class TemplateRenderError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed rendering it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # noqa: DTZ005 (local time, as transformers renders it)


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace``, refusing attributes that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature)
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with _")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask marker): the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _dict
    env.globals["namespace"] = _Namespace
    return env


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """``tokenizer_config.json``'s special tokens (``bos_token``: a string or an
    ``{"content": ...}`` object), as the template sees them."""
    out = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _template_text(config: Mapping[str, Any]) -> str:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError("no chat_template (a string, or a list with a 'default' one)")
    return template


# A conversation every chat template must render (some refuse a system message): at start.
_PROBE = [{"role": "user", "content": "probe"}]


class ChatRenderer:
    """A model's chat template and tokenizer: prompt ids as its vLLM replicas compute them."""

    def __init__(self, template: str, tokenizer: Any, special_tokens: Mapping[str, str]) -> None:
        self._template = _environment().from_string(template)
        self._tokenizer = tokenizer
        self._special = dict(special_tokens)
        # The tokenizer's special tokens' ids: the template's turn delimiters among them.
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_file(cls, path: Path, tokenizer: Any) -> ChatRenderer:
        """From a ``tokenizer_config.json`` (its ``chat_template`` and special tokens);
        ``ValueError`` says why it cannot be used, including a template that fails to
        render a user message."""
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
            renderer = cls(_template_text(config), tokenizer, _special_tokens(config))
            renderer.token_ids(_PROBE)
        except (OSError, ValueError, jinja2.TemplateError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
        return renderer

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str:
        """The prompt text; ``TemplateRenderError`` when the template refuses it."""
        try:
            return self._template.render(
                messages=[_message(m) for m in messages],
                tools=[_tool(t) for t in tools] if tools is not None else None,
                documents=None,
                add_generation_prompt=True,
                **self._special,
            )
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(str(exc)) from exc
        except Exception as exc:  # a template is code: whatever it raises refuses the prompt
            raise TemplateRenderError(f"{type(exc).__name__}: {exc}") from exc

    def token_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        """The prompt's token ids (no special tokens added: the template has them)."""
        return self._encode(self.render(messages, tools))

    def _encode(self, text: str) -> list[int]:
        (encoding,) = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)
        ids: list[int] = encoding.ids
        return ids

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        within: int | None = None,
    ) -> tuple[list[int], tuple[int, int | None] | None]:
        """The prompt's token ids and where its first user message is in them: (its first
        content token, just past its end-of-turn token (None: not found, or not within
        ``within`` tokens of the start when given)), for the conversation key
        (``prefix.conversation_block``, which needs no end past its key block); None when
        it cannot be told.

        The content is found in the rendered text (its first occurrence, as the template
        trims it); the text before it is tokenized once more (the system prompt and the
        tools: templates put the content after a header that ends with a special token or a
        newline, so those tokens are a prefix of the prompt's, which is checked); the message
        ends at the first special token after its content starts (the end of turn)."""
        text = self.render(messages, tools)
        ids = self._encode(text)
        return ids, self._first_user(messages, text, ids, within)

    def _first_user(
        self, messages: Sequence[Mapping[str, Any]], text: str, ids: list[int], within: int | None
    ) -> tuple[int, int | None] | None:
        content = next((m.get("content") for m in messages if m.get("role") == "user"), None)
        content = content.strip() if isinstance(content, str) else ""
        at = text.find(content) if content else -1
        if at < 0:
            return None
        head = self._encode(text[:at])
        start = len(head)
        if ids[:start] != head:  # the content's first piece merged with the header's
            return None
        special = self._special_ids
        stop = len(ids) if within is None else min(len(ids), start + within)
        end = next((i + 1 for i in range(start, stop) if ids[i] in special), None)
        return start, end


def _message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """As vLLM gives it to the template: an assistant's tool-call arguments as an object
    (a JSON string decoded; empty, invalid or not an object: ``{}``)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
            if not isinstance(arguments, Mapping):
                arguments = {}
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _tool(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """As vLLM dumps its ``ChatCompletionToolsParam``: the function's ``description`` and
    ``parameters`` always present (null when not given), ``strict`` only when given."""
    function = tool.get("function")
    if not isinstance(function, Mapping):
        return tool
    out = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    return {"type": tool.get("type", "function"), "function": out}


class TemplateCounter(ExactCounter):
    """A model with its tokenizer and its chat template: a chat prompt is counted exactly,
    from the token ids its replicas compute (``renderer.prompt``), which also key its
    prefix-cache blocks. Other text (a json schema) is counted as ``ExactCounter`` does."""

    def __init__(self, tokenizer: Any, renderer: ChatRenderer) -> None:
        super().__init__(tokenizer)
        self.renderer = renderer

    @classmethod
    def from_file(cls, path: Path, tokenizer: Any) -> TemplateCounter:  # type: ignore[override]
        """The chat template of ``path`` (a ``tokenizer_config.json``) over ``tokenizer``
        (the model's, already loaded); ``ValueError`` says why it cannot be used."""
        return cls(tokenizer, ChatRenderer.from_file(path, tokenizer))
