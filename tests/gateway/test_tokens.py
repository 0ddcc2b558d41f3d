"""The gateway's token estimate against the emulator's tokenizer. No I/O."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.tokenizer import Tokenizer
from gateway.admission import tokens
from gateway.endpoints.validation import parse_chat

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=200)


@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), texts), min_size=1, max_size=6
    )
)
@settings(max_examples=200, deadline=None)
def test_estimate_bounds_the_emulator_tokenizer_and_equals_it_for_ascii(
    messages: list[tuple[str, str]],
) -> None:
    rendered = [{"role": role, "content": text} for role, text in messages]
    exact = len(Tokenizer().apply_chat_template(rendered))
    estimate = tokens.prompt_tokens(text for _, text in messages)
    assert estimate >= exact
    if all(text.isascii() for _, text in messages):
        assert estimate == exact


def test_estimate_with_ascii_text_parts_equals_the_emulator() -> None:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello world"},
                        {"type": "text", "text": "again and again"},
                    ],
                }
            ],
        }
    )
    req = parse_chat(body)
    exact = len(Tokenizer().apply_chat_template(orjson.loads(body)["messages"]))
    assert tokens.prompt_tokens(req.message_texts) == exact
