"""Prompt-token estimate made before admission.

It mirrors the replicas' (emulated) tokenizer: each message costs 4 tokens of chat-template
overhead plus its content, where every whitespace-separated word is ceil(utf-8 bytes / 4)
tokens, and the reply priming adds 3. For that tokenizer the estimate is exact; for a real
BPE tokenizer it is a conservative stand-in (English averages ~4 characters per token, and
rounding up per word over-counts). Either way the exact count comes back in the upstream
``usage`` chunk and is what gets billed; the estimate only sizes admission.

No exact-count path from a tokenizer file is implemented: the emulated fleet's tokenizer is
the rule above, so the estimate already is exact there.
"""

from __future__ import annotations

from collections.abc import Iterable

MESSAGE_OVERHEAD = 4
REPLY_PRIMING = 3


def text_tokens(text: str) -> int:
    if text.isascii():
        # Fast path: for ASCII, characters are bytes.
        return sum((len(word) + 3) >> 2 for word in text.split())
    return sum((len(word.encode("utf-8")) + 3) >> 2 for word in text.split())


def prompt_tokens(message_texts: Iterable[str]) -> int:
    """Tokens of a chat prompt given each message's text content (one entry per message)."""
    total = REPLY_PRIMING
    for text in message_texts:
        total += MESSAGE_OVERHEAD + text_tokens(text)
    return total
