"""The emulator's tokenizer: the prompt rules of ``contracts.tokenizer`` (shared with the
gateway, which must reproduce a replica's prompt token ids) and the output side here.

The prompt rules (content, chat template, tools, content parts, raw prompts) are documented
in ``contracts.tokenizer``; the names are re-exported here for the emulator's modules.

Output tokens come from ``OUTPUT_VOCAB``: 4,096 pronounceable pseudo-words, each one token
(``" kelo"``), ids ``0..4095``. Prompt piece ids live in ``[PIECE_BASE, PIECE_BASE+PIECE_SPAN)``
and specials at 128,000+, as in Llama 3's 128,256-token vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

from contracts.tokenizer import (
    BOS_ID,
    BYTES_PER_PIECE,
    END_HEADER_ID,
    EOT_ID,
    GENERATION_PROMPT_TOKENS,
    OUTPUT_VOCAB_SIZE,
    PIECE_BASE,
    PIECE_SPAN,
    START_HEADER_ID,
    TOKENS_PER_MESSAGE,
    VOCAB_SIZE,
    MessageFormatError,
    PromptTokenizer,
    content_texts,
    role_token_id,
    tool_call_texts,
    tools_text,
)

__all__ = [
    "BOS_ID",
    "BYTES_PER_PIECE",
    "END_HEADER_ID",
    "EOT_ID",
    "GENERATION_PROMPT_TOKENS",
    "MessageFormatError",
    "OUTPUT_TABLE_MASK",
    "OUTPUT_VOCAB_SIZE",
    "PIECE_BASE",
    "PIECE_SPAN",
    "PromptTokenizer",
    "START_HEADER_ID",
    "TOKENS_PER_MESSAGE",
    "Tokenizer",
    "VOCAB_SIZE",
    "content_texts",
    "output_token_table",
    "output_vocab",
    "role_token_id",
    "tool_call_texts",
    "tools_text",
]

_SPECIAL_STRS = {
    BOS_ID: "<|begin_of_text|>",
    START_HEADER_ID: "<|start_header_id|>",
    END_HEADER_ID: "<|end_header_id|>",
    EOT_ID: "<|eot_id|>",
}


@cache
def output_vocab() -> tuple[str, ...]:
    """4,096 distinct pseudo-words with a leading space: the text of output token ids."""
    rng = random.Random(20260501)  # fixed: text must not depend on anything configurable
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v"]
    onsets += ["w", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st"]
    words: set[str] = set()
    out: list[str] = []
    while len(out) < OUTPUT_VOCAB_SIZE:
        syllables = rng.choice((1, 1, 2, 2, 2, 3))
        word = "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)
        )
        if word not in words:
            words.add(word)
            out.append(" " + word)
    return tuple(out)


class Tokenizer(PromptTokenizer):
    """The prompt rules (``contracts.tokenizer``) plus token strings and output decoding."""

    # -- decoding ------------------------------------------------------------------------

    def piece_strs(self, text: str) -> list[str]:
        """The pieces of plain text as strings (for /tokenize ``token_strs``)."""
        out: list[str] = []
        for word in text.split():
            raw = word.encode("utf-8")
            out.extend(
                raw[i : i + BYTES_PER_PIECE].decode("utf-8", errors="replace")
                for i in range(0, len(raw), BYTES_PER_PIECE)
            )
        return out

    def chat_token_strs(
        self, messages: Sequence[Any], add_generation_prompt: bool = True
    ) -> list[str]:
        """Token strings parallel to ``apply_chat_template`` (slow path, /tokenize only)."""
        out: list[str] = []
        for index, message in enumerate(messages):
            out.append(_SPECIAL_STRS[START_HEADER_ID])
            out.append(str(message["role"]))
            out.append(_SPECIAL_STRS[END_HEADER_ID])
            for text in content_texts(message.get("content"), index):
                out.extend(self.piece_strs(text))
            for text in tool_call_texts(message.get("tool_calls"), index):
                out.extend(self.piece_strs(text))
            out.append(_SPECIAL_STRS[EOT_ID])
        if add_generation_prompt:
            out.extend((_SPECIAL_STRS[START_HEADER_ID], "assistant", _SPECIAL_STRS[END_HEADER_ID]))
        return out

    def prompt_token_strs(self, prompt: str, add_special_tokens: bool = True) -> list[str]:
        head = [_SPECIAL_STRS[BOS_ID]] if add_special_tokens else []
        return head + self.piece_strs(prompt)

    @staticmethod
    def decode_output(token_ids: Iterable[int]) -> str:
        vocab = output_vocab()
        return "".join(vocab[t] for t in token_ids)


OUTPUT_TABLE_MASK = 0xFFFF


@cache
def output_token_table() -> tuple[int, ...]:
    """65,536 output token ids; request ``r`` emits ``table[(offset_r + i) & mask]``.

    A fixed table makes a seeded request's text identical on every replica, and makes
    emitting a token one tuple index instead of a PRNG call.
    """
    rng = random.Random(20260502)
    bits = OUTPUT_VOCAB_SIZE.bit_length() - 1  # the vocabulary size is a power of two
    return tuple(rng.getrandbits(bits) for _ in range(OUTPUT_TABLE_MASK + 1))
