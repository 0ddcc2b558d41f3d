"""Deterministic log-probabilities for emitted tokens.

The emulator does not sample, so the values are made up — but consistently: the same token at
the same position of the same request gets the same numbers on every replica, the chosen
token is the most likely one (as under greedy decoding), its alternatives are distinct vocabulary
words in decreasing order, and the probabilities of a position never sum past 1.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

from emulator.tokenizer import output_vocab

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def _unit(key: int) -> float:
    key = (key * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    key ^= key >> 29
    key = (key * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    key ^= key >> 32
    return ((key >> 11) + 0.5) / float(1 << 53)


def position_logprobs(
    text: str, position: int, salt: int, top: int
) -> tuple[float, list[tuple[str, float]]]:
    """(logprob of ``text`` at ``position``, the ``top`` most likely tokens with theirs)."""
    key = (zlib.crc32(text.encode("utf-8")) << 24) ^ (position << 1) ^ (salt << 40)
    p0 = 0.35 + 0.6 * _unit(key)  # the chosen token's probability
    chosen = math.log(p0)
    alternatives: list[tuple[str, float]] = [(text, chosen)]
    vocab = output_vocab()
    rest = 1.0 - p0
    seen = {text}
    index = 1
    draw = key
    while len(alternatives) < top:
        draw += 1
        word = vocab[int(_unit(draw) * len(vocab))]
        if word in seen:
            continue
        seen.add(word)
        share = rest * 0.5**index * (0.5 + 0.5 * _unit(draw ^ 0x55))
        alternatives.append((word, math.log(share)))
        index += 1
    return chosen, alternatives[:top]


def chat_entry(text: str, position: int, salt: int, top: int) -> dict[str, Any]:
    """One element of ``choices[].logprobs.content`` in OpenAI's shape."""
    chosen, alternatives = position_logprobs(text, position, salt, top)
    return {
        "token": text,
        "logprob": chosen,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": word, "logprob": lp, "bytes": list(word.encode("utf-8"))}
            for word, lp in alternatives
        ],
    }


def legacy_entry(text: str, position: int, salt: int, top: int) -> tuple[float, dict[str, float]]:
    """(token logprob, ``top_logprobs`` dict) for ``/v1/completions``' legacy shape; with
    ``logprobs=0`` the dict holds the chosen token only, as vLLM returns it."""
    chosen, alternatives = position_logprobs(text, position, salt, max(top, 1))
    return chosen, dict(alternatives)
