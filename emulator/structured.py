"""What the emulated model writes when the request constrains it: tool calls and JSON.

A real replica decodes under a grammar (structured output) or lets a tool-call parser pick
calls out of the generated text. The emulator does not sample; it *decides* the output up
front, deterministically from the request's content, and hands the engine the exact token
sequence (``Engine.add_request(output_token_ids=...)``). Those tokens then cost KV and time
like any other output, and the response is built from the same plan.

* ``instance_for(schema, rng)``: a JSON value that validates against a JSON Schema
  (types, ``required``, ``enum``/``const``, nested objects and arrays, ``$ref`` to ``$defs``,
  ``anyOf``/``oneOf``/``allOf``, simple numeric and length bounds, common string formats).
  Every generated value is checked with ``jsonschema`` before it is used.
* ``plan_text`` / ``plan_json`` / ``plan_tool_calls``: an ``OutputPlan`` — token ids, the
  text of each token, and for chat streaming the delta each token produces.

Text is split into tokens by the emulator tokenizer's rules (whitespace-separated words, each
in 4-byte pieces), with the whitespace before a word carried by its first piece, so the
completion token count is exactly the tokenizer's count of the generated text and the pieces
concatenate back to it. Generated JSON is ASCII (``ensure_ascii``), so no piece splits a
character.
"""

from __future__ import annotations

import json
import random
import re
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from emulator.tokenizer import BYTES_PER_PIECE, PIECE_BASE, PIECE_SPAN, output_vocab

MAX_SCHEMA_DEPTH = 12


class SchemaError(ValueError):
    """A schema the emulator cannot produce an instance for (the message says why)."""


def _words(rng: random.Random, count: int) -> list[str]:
    vocab = output_vocab()
    return [vocab[rng.randrange(len(vocab))].strip() for _ in range(count)]


def _resolve_ref(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise SchemaError(f"only local $ref are supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise SchemaError(f"unresolvable $ref {ref!r}")
        node = node[part]
    if not isinstance(node, dict):
        raise SchemaError(f"$ref {ref!r} does not point at a schema")
    return node


def _string_for(schema: dict[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "date-time":
        value = f"{day}T{rng.randint(0, 23):02d}:00:00Z"
    elif fmt == "date":
        value = day
    elif fmt == "time":
        value = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z"
    elif fmt == "email":
        value = f"{_words(rng, 1)[0]}@example.com"
    elif fmt == "uuid":
        value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    elif fmt in ("uri", "url"):
        value = f"https://example.com/{_words(rng, 1)[0]}"
    else:
        value = " ".join(_words(rng, rng.randint(1, 4)))
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    while len(value) < low:
        value += " " + _words(rng, 1)[0]
    if high is not None and len(value) > int(high):
        value = value[: int(high)].rstrip() or value[: int(high)]
    pattern = schema.get("pattern")
    if pattern is not None and not re.search(pattern, value):
        raise SchemaError("string patterns are not supported by the emulator's generator")
    return value


def _number_for(schema: dict[str, Any], rng: random.Random, integer: bool) -> int | float:
    low: Any = schema.get("minimum")
    high: Any = schema.get("maximum")
    ex_low = schema.get("exclusiveMinimum")
    ex_high = schema.get("exclusiveMaximum")
    if isinstance(ex_low, (int, float)) and not isinstance(ex_low, bool):
        low = ex_low + (1 if integer else 0.01) if low is None else max(low, ex_low + 0.01)
    if isinstance(ex_high, (int, float)) and not isinstance(ex_high, bool):
        high = ex_high - (1 if integer else 0.01) if high is None else min(high, ex_high - 0.01)
    if low is None and high is None:
        low, high = 0, 100
    elif low is None:
        low = high - 100
    elif high is None:
        high = low + 100
    if integer:
        lo, hi = int(-(-low // 1)), int(high // 1)
        if lo > hi:
            raise SchemaError("integer bounds leave no value")
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0:
            first = -(-lo // step) * step
            if first > hi:
                raise SchemaError("no multiple of multipleOf within the bounds")
            return first + step * rng.randint(0, (hi - first) // step)
        return rng.randint(lo, hi)
    if low > high:
        raise SchemaError("number bounds leave no value")
    return round(rng.uniform(float(low), float(high)), 2)


def instance_for(
    schema: Any, rng: random.Random, root: dict[str, Any] | None = None, depth: int = 0
) -> Any:
    """A value valid against ``schema`` (drawn from ``rng``); raises SchemaError."""
    if schema is True or schema == {}:
        return " ".join(_words(rng, 2))
    if not isinstance(schema, dict):
        raise SchemaError("a schema must be an object")
    root = schema if root is None else root
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError("schema nests too deeply")
    if "$ref" in schema:
        return instance_for(_resolve_ref(schema["$ref"], root), rng, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        options = schema["enum"]
        if not isinstance(options, list) or not options:
            raise SchemaError("enum must be a non-empty list")
        return options[rng.randrange(len(options))]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [
                o for o in schema[key] if not (isinstance(o, dict) and o.get("type") == "null")
            ]
            return instance_for((options or schema[key])[0], rng, root, depth + 1)
    if "allOf" in schema:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve_ref(part["$ref"], root) if "$ref" in part else part
            for k, v in part.items():
                if k == "properties":
                    merged.setdefault("properties", {}).update(v)
                elif k == "required":
                    merged["required"] = sorted(set(merged.get("required", [])) | set(v))
                else:
                    merged.setdefault(k, v)
        return instance_for(merged, rng, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if kinds else "null"
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        props: dict[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        value: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or rng.random() < 0.5:
                value[name] = instance_for(sub, rng, root, depth + 1)
        for name in sorted(required - set(props)):
            value[name] = " ".join(_words(rng, 1))
        return value
    if kind == "array":
        high = schema.get("maxItems")
        low = int(schema.get("minItems", 1 if high is None else min(1, int(high))))
        top = low + 2 if high is None else min(int(high), low + 2)
        if top < low:
            raise SchemaError("maxItems is below minItems")
        items = schema.get("items", {})
        return [instance_for(items, rng, root, depth + 1) for _ in range(rng.randint(low, top))]
    if kind == "string":
        return _string_for(schema, rng)
    if kind == "integer":
        return _number_for(schema, rng, integer=True)
    if kind == "number":
        return _number_for(schema, rng, integer=False)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise SchemaError(f"unsupported schema type {kind!r}")


def conforming_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """``instance_for`` checked with ``jsonschema`` (a few draws, then SchemaError)."""
    validator = jsonschema.Draft202012Validator(schema)
    for _ in range(8):
        value = instance_for(schema, rng)
        if validator.is_valid(value):
            return value
    raise SchemaError("the emulator could not generate an instance of this schema")


def check_schema(schema: Any) -> str | None:
    """None if ``schema`` is a valid JSON Schema, else the reason."""
    if not isinstance(schema, dict):
        return "the schema must be a JSON object"
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"invalid JSON schema: {exc.message}"
    return None


def request_rng(*parts: Any) -> random.Random:
    """A PRNG seeded by the request's content (stable across processes and replicas)."""
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=True).encode()
    return random.Random(zlib.crc32(blob) ^ (len(blob) << 32))


# -- turning text into tokens --------------------------------------------------------------


def split_tokens(text: str) -> list[str]:
    """The emulator tokenizer's pieces of ``text``, whitespace kept on the following piece
    (trailing whitespace on the last), so ``"".join`` gives ``text`` back."""
    pieces: list[str] = []
    pending = ""
    for match in re.finditer(r"(\s*)(\S+)", text):
        lead, word = match.group(1), match.group(2)
        raw = word.encode("utf-8")
        chunks = [
            raw[i : i + BYTES_PER_PIECE].decode("utf-8", errors="replace")
            for i in range(0, len(raw), BYTES_PER_PIECE)
        ]
        chunks[0] = pending + lead + chunks[0]
        pending = ""
        pieces.extend(chunks)
    tail = text[len("".join(pieces)) :]
    if tail:
        if pieces:
            pieces[-1] += tail
        else:
            pending = tail
    return pieces


def piece_token_id(piece: str) -> int:
    return PIECE_BASE + zlib.crc32(piece.strip().encode("utf-8")) % PIECE_SPAN


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class OutputPlan:
    """The whole output of one sequence, decided before it runs.

    ``texts[i]`` is token i's text; ``deltas[i]`` is what a chat stream sends for it (a
    ``delta`` object, or None when the tool parser holds it back). ``tool_calls`` is set when
    the complete output is a tool call; a truncated one (max_tokens) is plain text, as a
    parser that cannot parse it returns.
    """

    token_ids: list[int]
    texts: list[str]
    deltas: list[dict[str, Any] | None]
    tool_calls: list[ToolCall] = field(default_factory=list)
    complete_finish: str = "stop"  # finish_reason when the whole plan is generated

    @property
    def text(self) -> str:
        return "".join(self.texts)


def plan_text(text: str) -> OutputPlan:
    texts = split_tokens(text)
    return OutputPlan(
        token_ids=[piece_token_id(t) for t in texts],
        texts=texts,
        deltas=[{"content": t} for t in texts],
    )


def plan_json(value: Any) -> OutputPlan:
    return plan_text(json.dumps(value, ensure_ascii=True))


def object_for_json_mode(rng: random.Random) -> dict[str, Any]:
    """``response_format: json_object``: some object with a few keys of mixed types."""
    keys = _words(rng, rng.randint(1, 4))
    value: dict[str, Any] = {}
    for index, key in enumerate(keys):
        pick = (index + rng.randrange(3)) % 3
        value[key] = (
            " ".join(_words(rng, rng.randint(1, 5)))
            if pick == 0
            else rng.randint(0, 1000)
            if pick == 1
            else rng.random() < 0.5
        )
    return value


def tool_call_id(rng: random.Random) -> str:
    return f"chatcmpl-tool-{rng.getrandbits(128):032x}"


def plan_tool_calls(calls: list[tuple[str, Any]], rng: random.Random, finish: str) -> OutputPlan:
    """The generated text of ``calls`` (name, arguments) in the Llama 3 JSON tool format
    (``{"name": ..., "parameters": {...}}``, ``; `` between parallel calls), and the stream
    deltas a tool parser derives from it: the call's id and name once its header is complete,
    then the arguments' text as it arrives (pieces straddling the arguments send their part)."""
    text = ""
    spans: list[tuple[int, int, int]] = []  # (header end, arguments start, arguments end)
    tool_calls: list[ToolCall] = []
    for index, (name, arguments) in enumerate(calls):
        args_text = json.dumps(arguments, ensure_ascii=True)
        tool_calls.append(ToolCall(id=tool_call_id(rng), name=name, arguments=args_text))
        text += ("; " if index else "") + '{"name": ' + json.dumps(name, ensure_ascii=True)
        text += ', "parameters":'
        header_end = len(text)
        text += " "
        spans.append((header_end, len(text), len(text) + len(args_text)))
        text += args_text + "}"
    texts = split_tokens(text)
    deltas: list[dict[str, Any] | None] = []
    offset = 0
    for piece in texts:
        start, offset = offset, offset + len(piece)
        parts: list[dict[str, Any]] = []
        for index, (header_end, args_start, args_end) in enumerate(spans):
            if start < header_end <= offset:
                call = tool_calls[index]
                parts.append(
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            low, high = max(start, args_start), min(offset, args_end)
            if low < high:
                parts.append({"index": index, "function": {"arguments": text[low:high]}})
        deltas.append({"tool_calls": parts} if parts else None)
    return OutputPlan(
        token_ids=[piece_token_id(t) for t in texts],
        texts=texts,
        deltas=deltas,
        tool_calls=tool_calls,
        complete_finish=finish,
    )
