"""The emulator's tokenizer: the documented rules, stability across processes, and speed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from emulator.tokenizer import (
    GENERATION_PROMPT_TOKENS,
    TOKENS_PER_MESSAGE,
    MessageFormatError,
    Tokenizer,
    output_vocab,
)


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("  two   words\n", 3),  # "two" + "word"|"s"
        ("naïve", 2),  # 6 UTF-8 bytes
        ("日本語", 3),  # 9 bytes
        ("x" * 17, 5),
    ],
)
def test_content_rule(text: str, count: int) -> None:
    tokenizer = Tokenizer()
    assert len(tokenizer.encode_text(text)) == count == tokenizer.count_text(text)


def test_chat_template_overheads() -> None:
    tokenizer = Tokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "yo"}],
        },
        {"role": "assistant", "content": None},
    ]
    ids = tokenizer.apply_chat_template(messages)
    assert len(ids) == 3 * TOKENS_PER_MESSAGE + (1 + 2) + (1 + 1) + GENERATION_PROMPT_TOKENS
    assert len(tokenizer.apply_chat_template(messages, add_generation_prompt=False)) == len(ids) - 3
    assert len(tokenizer.chat_token_strs(messages)) == len(ids)
    with pytest.raises(MessageFormatError):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_ids_are_stable_across_processes() -> None:
    code = (
        "from emulator.tokenizer import Tokenizer;"
        "print(Tokenizer().apply_chat_template([{'role':'user','content':'stable ids, café'}]))"
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, env=env, timeout=60, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    expected = Tokenizer().apply_chat_template([{"role": "user", "content": "stable ids, café"}])
    assert outputs.pop().decode().strip() == str(expected)


def test_a_128k_token_prompt_tokenizes_to_its_length() -> None:
    # Its CPU cost is measured by `python -m bench.emulator_bench` (engine costs).
    vocab = [word.strip() for word in output_vocab()]
    text = " ".join(vocab[(i * 7) % len(vocab)] for i in range(60_000))
    tokenizer = Tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    assert len(ids) > 100_000
    assert 0 < len(ids) - tokenizer.count_text(text) < 16  # the template's few tokens


def test_output_text_round_trip() -> None:
    vocab = output_vocab()
    assert len(vocab) == len(set(vocab)) == 4096
    assert all(word.startswith(" ") and word[1:].isalpha() for word in vocab)
    assert Tokenizer.decode_output([0, 1]) == vocab[0] + vocab[1]
