"""The prompt estimate is an upper bound a client cannot steer down with its choice of
script: non-ASCII text counts one token per UTF-8 byte (what a byte-level BPE emits at
worst), so CJK or emoji no longer pass the context check and tokens/min at a quarter of
their size, while plain English keeps the estimate it had (exact for the emulated fleet)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import schema
from emulator.tokenizer import Tokenizer
from gateway.admission import tokens
from gateway.endpoints.validation import apply_limits, parse_chat
from gateway.errors import BadRequest

VERSION = schema.ModelVersionRecord(
    version="v", family="f", context_length=131_072, kv_bytes_per_token=1,
    tpot_target_ms=1, kv_capacity_tokens=1,
)  # fmt: skip
LIMIT = schema.LimitRecord(
    rpm=1, tpm=1, max_context=8192, max_output=64, kv_seconds_cap=1, reserved_kv=0
)

any_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=300)
# Scripts a byte-level BPE may have no merges for, with spaces: CJK, kana, Hangul, emoji,
# Cyrillic, Arabic, Devanagari.
scripts = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
        st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),
        st.characters(min_codepoint=0xAC00, max_codepoint=0xD7A3),
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
        st.characters(min_codepoint=0x0400, max_codepoint=0x04FF),
        st.characters(min_codepoint=0x0600, max_codepoint=0x06FF),
        st.characters(min_codepoint=0x0900, max_codepoint=0x097F),
        st.just(" "),
    ),
    min_size=1,
    max_size=300,
)


def _prompt(text: str) -> tuple[int, int]:
    """(estimate, the emulated replica's count) for one user message."""
    exact = len(Tokenizer().apply_chat_template([{"role": "user", "content": text}]))
    return tokens.prompt_tokens([text]), exact


@given(any_text)
@settings(max_examples=300, deadline=None)
def test_the_estimate_is_at_least_the_emulators_count_for_any_text(text: str) -> None:
    estimate, exact = _prompt(text)
    assert estimate >= exact


@given(scripts)
@settings(max_examples=300, deadline=None)
def test_the_estimate_is_at_least_a_byte_fallback_tokenizers_count(text: str) -> None:
    """A byte-level BPE without merges for a script emits one token per UTF-8 byte of it
    (GPT-2 on CJK; Llama 3 on rare ideographs and many emoji); whitespace joins the next
    word, as the BPE's pre-tokenizer does."""
    byte_fallback = sum(len(word.encode("utf-8")) for word in text.split())
    assert tokens.text_tokens(text) >= byte_fallback


def test_plain_english_keeps_its_estimate() -> None:
    english = (
        "The quick brown fox jumps over the lazy dog. Admission sizes every request "
        "before it runs, and the replica's own count settles it afterwards. "
    ) * 40
    estimate, exact = _prompt(english)
    assert estimate == exact  # ratio 1.00 to the emulated fleet's count
    # (to a Llama-3 tokenizer, ~4.2 bytes per token for English prose: about the same)
    assert 0.8 <= estimate / (len(english.encode()) / 4.2) <= 1.25


def test_a_cjk_prompt_cannot_slip_under_the_context_limit() -> None:
    """3,000 ideographs (9,000 UTF-8 bytes): the old estimate said ~2,260 tokens and let
    it through an 8,192-token limit; a byte-level BPE may need up to 9,000."""
    text = "漢字" * 1500
    body = orjson.dumps({"model": "v", "messages": [{"role": "user", "content": text}]})
    req = parse_chat(body)
    estimate = tokens.prompt_tokens(req.message_texts)
    assert estimate == 9000 + 7
    with pytest.raises(BadRequest) as refused:
        apply_limits(req, VERSION, LIMIT, estimate)
    assert refused.value.code == "context_length_exceeded"
