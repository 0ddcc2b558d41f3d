"""The exact-count path (``GATEWAY_TOKENIZER_FILES``): with the model's own
``tokenizer.json`` the prompt estimate is a bound for any text, adversarial ASCII included,
which the rule (ceil(bytes / 4) per ASCII word) is not.

No real model tokenizer can be downloaded here, so the test trains a small byte-level BPE
(the kind Llama 3 and GPT-2 use) on English and gives it a Llama-3-style chat template's
special tokens; the "real count" is that tokenizer's count of the rendered prompt."""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from emulator.testing import SpawnedEmulator
from gateway.admission import tokens
from gateway.config import ConfigError, GatewayConfig
from gateway.endpoints.completions import Completions
from gateway.endpoints.validation import parse_completion
from tests.gateway.conftest import VERSION, GatewayProcess, ReadModelSeeder

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Admission sizes every request before it "
    "runs, and the replica's own count settles it afterwards. A tenant pays for the tokens "
    "it uses; the gateway only has to be safe about how many it might use. "
)
# Adversarial ASCII: letters and digits alternating, punctuation soup, no whitespace to
# split on (the rule charges a quarter token per byte; a BPE without such merges, one).
SOUP = "".join(random.Random(13).choice(string.punctuation + "a1") for _ in range(6000))


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tok.train_from_iterator([ENGLISH] * 50, trainer)
    return tok


REAL = train()
COUNTER = tokens.ExactCounter(REAL)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tokenizer as the file a vLLM deployment has."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    REAL.save(str(path))
    return path


def real_count(messages: list[str]) -> int:
    """The trained tokenizer's count of a Llama-3-style rendering (content not trimmed)."""
    rendered = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>" for text in messages
    )
    rendered += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    return len(REAL.encode(rendered, add_special_tokens=False))


adversarial_ascii = st.text(
    alphabet=st.sampled_from(string.punctuation + string.digits + "aZ \t\n"), max_size=400
)
cjk_and_emoji = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
        st.sampled_from(" \n!a"),
    ),
    max_size=300,
)
any_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=300)


@given(st.lists(st.one_of(adversarial_ascii, cjk_and_emoji, any_text), min_size=1, max_size=4))
@settings(max_examples=400, deadline=None)
def test_the_exact_path_bounds_the_tokenizers_real_count_for_any_text(
    messages: list[str],
) -> None:
    assert COUNTER.prompt_tokens(messages) >= real_count(messages)


def test_the_rule_is_below_the_real_count_for_adversarial_ascii_and_the_exact_path_is_not() -> None:
    real = real_count([SOUP])
    rule = tokens.prompt_tokens([SOUP])
    exact = COUNTER.prompt_tokens([SOUP])
    assert rule < real / 3  # the gap: 1,507 against 6,018
    assert exact >= real
    # English costs what it tokenizes to, plus the template allowances.
    english = ENGLISH * 20
    assert real_count([english]) <= COUNTER.prompt_tokens([english]) <= real_count([english]) + 40


def test_raw_completions_count_each_prompt_with_the_tokenizer() -> None:
    req = parse_completion(orjson.dumps({"model": "m", "prompt": [SOUP, "hi"]}))
    total, longest = Completions.__new__(Completions).prompt_estimate(req, COUNTER)
    soup = len(REAL.encode(SOUP, add_special_tokens=False))
    assert longest == COUNTER.bos + soup
    assert total == longest + COUNTER.bos + len(REAL.encode("hi", add_special_tokens=False))


def test_a_punctuation_soup_prompt_is_refused_by_the_exact_count(
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
    tokenizer_file: Path,
) -> None:
    """Under the 4,096-token context by the rule (1,507), over it by the tokenizer: 400
    ``context_length_exceeded`` before admission. The body is past INLINE_MAX_BYTES, so it
    is counted in the thread pool; English still runs."""
    seeder.set_replicas([("r1", replica.base_url)])
    gw = gateways(None, extra_env={"GATEWAY_TOKENIZER_FILES": f"{VERSION}={tokenizer_file}"})
    tenant = seeder.tenant(max_context=4096, max_output=16)
    assert tokens.prompt_tokens([SOUP]) + 16 < 4096
    auth = {"authorization": f"Bearer {tenant.secret}"}
    with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
        soup = {"model": VERSION, "messages": [{"role": "user", "content": SOUP}]}
        refused = client.post("/v1/chat/completions", json={**soup, "max_tokens": 16})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert str(COUNTER.prompt_tokens([SOUP])) in error["message"]
        english = {"role": "user", "content": ENGLISH * 10}
        ok = client.post(
            "/v1/chat/completions",
            json={"model": VERSION, "messages": [english], "max_tokens": 4},
        )
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "value",
    ["llama=/nonexistent/tokenizer.json", '{"llama": "{garbage}"}', "llama", "[1]"],
)
def test_a_bad_tokenizer_setting_is_a_config_error_naming_it(value: str, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not a tokenizer")
    value = value.replace("{garbage}", str(garbage))
    with pytest.raises(ConfigError, match="GATEWAY_TOKENIZER_FILES"):
        GatewayConfig.from_env({"GATEWAY_TOKENIZER_FILES": value})


def test_the_gateway_does_not_start_with_an_unreadable_tokenizer_file(tmp_path: Path) -> None:
    unreadable = tmp_path / "tokenizer.json"
    unreadable.mkdir()  # a directory: exists, cannot be read as a file
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GATEWAY_TOKENIZER_FILES": f"{VERSION}={unreadable}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--port", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "GATEWAY_TOKENIZER_FILES" in done.stderr and VERSION in done.stderr


def test_configured_by_version_or_family(tokenizer_file: Path) -> None:
    config = GatewayConfig.from_env({"GATEWAY_TOKENIZER_FILES": f'{{"fam": "{tokenizer_file}"}}'})
    assert config.token_counter("fam-2026", "fam") is not None
    assert config.token_counter("other", "other") is None
