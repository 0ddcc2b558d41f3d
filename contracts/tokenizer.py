"""The emulated model's prompt tokenizer: deterministic, cheap, and simple enough to estimate
against.

The emulated replicas (``emulator.tokenizer``, which adds the output side: vocabulary,
decoding, token strings) and the gateway's cache-aware router (which must reproduce a
replica's prompt token ids to hash its blocks) both import this module; it lives in
``contracts`` because the gateway must not import the emulator.

Rules (the gateway's fast estimator is designed to be conservative against exactly these):

* **Content.** Split the text on whitespace (``str.split()``). Each word becomes
  ``ceil(len(word.encode("utf-8")) / 4)`` pieces: consecutive 4-byte slices of its UTF-8 form.
  A piece's token id is ``PIECE_BASE + crc32(piece) % PIECE_SPAN``, stable across processes
  (CRC-32 is unsalted, unlike ``hash()`` of ``str``).
* **Chat template.** Every message costs 4 template tokens (``<|start_header_id|>``, a role
  token, ``<|end_header_id|>``, ``<|eot_id|>``) plus its content's tokens; the generation prompt
  that primes the assistant's reply adds 3 (``<|start_header_id|>``, ``assistant``,
  ``<|end_header_id|>``). So ``count = sum(4 + content_tokens(m)) + 3``.
* **Tools.** With ``tools``, one more block (4 template tokens) holds their definitions as
  JSON (``json.dumps(tools)``), before the messages, as Llama 3.1's template renders them.
  An assistant message's ``tool_calls`` add, per call, the tokens of its function name and
  of its ``arguments`` text; a ``tool`` message is its content like any other.
* **Content parts.** A list content is the concatenation of its ``{"type":"text"}`` parts, each
  tokenized separately. A null content has no tokens.
* **Raw prompts** (``/tokenize`` with ``prompt``) get the content rule plus one BOS token when
  ``add_special_tokens`` is true (vLLM's default).

Speed: a 128k-token prompt (~400 KB) tokenizes in tens of milliseconds because words are cached
(``str.split`` and dict lookups run in C); the cache is bounded and simply cleared when full.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

VOCAB_SIZE = 128_256
OUTPUT_VOCAB_SIZE = 4096
PIECE_BASE = OUTPUT_VOCAB_SIZE
PIECE_SPAN = 128_000 - PIECE_BASE
BYTES_PER_PIECE = 4

BOS_ID = 128_000
START_HEADER_ID = 128_006
END_HEADER_ID = 128_007
EOT_ID = 128_009
TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT_TOKENS = 3
_ROLE_IDS = {"system": 9125, "user": 882, "assistant": 78191, "tool": 23799, "developer": 16920}

_WORD_CACHE_LIMIT = 500_000


class MessageFormatError(ValueError):
    """A message the template cannot render (wrong types); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _piece_id(piece: bytes) -> int:
    return PIECE_BASE + zlib.crc32(piece) % PIECE_SPAN


def role_token_id(role: str) -> int:
    known = _ROLE_IDS.get(role)
    return known if known is not None else _piece_id(role.encode("utf-8"))


class PromptTokenizer:
    """Stateless rules plus a bounded word cache; one instance per server or engine user."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, ...]] = {}

    # -- content -----------------------------------------------------------------------

    def _word(self, word: str) -> tuple[int, ...]:
        raw = word.encode("utf-8")
        size = len(raw)
        crc = zlib.crc32
        # Most words are 1-2 pieces: skip the generator for them (this is the cold path of
        # tokenizing a long prompt of unseen words).
        ids: tuple[int, ...]
        if size <= BYTES_PER_PIECE:
            ids = (PIECE_BASE + crc(raw) % PIECE_SPAN,)
        elif size <= 2 * BYTES_PER_PIECE:
            ids = (PIECE_BASE + crc(raw[:4]) % PIECE_SPAN, PIECE_BASE + crc(raw[4:]) % PIECE_SPAN)
        else:
            ids = tuple(_piece_id(raw[i : i + BYTES_PER_PIECE]) for i in range(0, size, 4))
        if len(self._cache) >= _WORD_CACHE_LIMIT:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def encode_text(self, text: str, out: list[int] | None = None) -> list[int]:
        """Token ids of plain text (no template, no BOS), appended to ``out`` if given."""
        ids = [] if out is None else out
        get = self._cache.get
        extend = ids.extend
        for word in text.split():
            piece_ids = get(word)
            extend(piece_ids if piece_ids is not None else self._word(word))
        return ids

    def count_text(self, text: str) -> int:
        total = 0
        for word in text.split():
            total += (len(word.encode("utf-8")) + BYTES_PER_PIECE - 1) // BYTES_PER_PIECE
        return total

    # -- chat template -------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of a chat request; raises MessageFormatError on malformed input."""
        ids: list[int] = []
        if tools:
            ids.append(START_HEADER_ID)
            ids.append(_ROLE_IDS["system"])
            ids.append(END_HEADER_ID)
            self.encode_text(tools_text(tools), ids)
            ids.append(EOT_ID)
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise MessageFormatError(
                    f"messages[{index}] must be an object", f"messages.{index}"
                )
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise MessageFormatError(
                    f"messages[{index}].role must be a non-empty string", f"messages.{index}.role"
                )
            ids.append(START_HEADER_ID)
            ids.append(role_token_id(role))
            ids.append(END_HEADER_ID)
            for text in content_texts(message.get("content"), index):
                self.encode_text(text, ids)
            for text in tool_call_texts(message.get("tool_calls"), index):
                self.encode_text(text, ids)
            ids.append(EOT_ID)
        if add_generation_prompt:
            ids.append(START_HEADER_ID)
            ids.append(_ROLE_IDS["assistant"])
            ids.append(END_HEADER_ID)
        return ids

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        return self.encode_text(prompt, ids)


def tools_text(tools: Sequence[Any]) -> str:
    return json.dumps(list(tools), ensure_ascii=False)


def tool_call_texts(calls: Any, index: int) -> list[str]:
    """An assistant message's earlier tool calls: each one's name and arguments text."""
    if calls is None:
        return []
    where = f"messages.{index}.tool_calls"
    if not isinstance(calls, list):
        raise MessageFormatError("tool_calls must be a list", where)
    texts: list[str] = []
    for call_index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise MessageFormatError(
                "a tool call needs a 'function' object", f"{where}.{call_index}.function"
            )
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise MessageFormatError(
                "a tool call's function needs a string 'name' and string 'arguments'",
                f"{where}.{call_index}.function",
            )
        texts += [name, arguments]
    return texts


def content_texts(content: Any, index: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts: list[str] = []
        for part_index, part in enumerate(content):
            param = f"messages.{index}.content.{part_index}"
            if not isinstance(part, dict):
                raise MessageFormatError("content parts must be objects", param)
            kind = part.get("type")
            if kind != "text":
                raise MessageFormatError(
                    f"content part type {kind!r} is not supported by this text-only model", param
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise MessageFormatError("a text content part needs a string 'text'", param)
            texts.append(text)
        return texts
    raise MessageFormatError(
        f"messages[{index}].content must be a string, a list of parts or null",
        f"messages.{index}.content",
    )
