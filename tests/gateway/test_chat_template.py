"""A real model's prompt ids (``gateway.admission.chat_template``) against transformers' own
``apply_chat_template`` and vLLM's own block hashes of them (``tests/data/
chat_template_vectors.json``, written by ``tests/gateway/chat_template_vectors.py`` with the
model files of tests/data/chat_template/: see its docstring to regenerate). Neither
transformers nor vLLM is needed here: only the fixture, jinja2 and tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from tokenizers import Tokenizer

from contracts.blockhash import get_hasher
from gateway.admission.chat_template import ChatRenderer, TemplateCounter, TemplateRenderError
from gateway.admission.prefix import event_hash, query_from_tokens
from gateway.config import ConfigError, GatewayConfig
from gateway.endpoints.chat import ChatCompletions
from gateway.endpoints.validation import parse_chat
from gateway.errors import BadRequest
from gateway.upstream.client import UpstreamClient

ROOT = Path(__file__).resolve().parents[2]
DATA: dict[str, Any] = json.loads(
    (ROOT / "tests" / "data" / "chat_template_vectors.json").read_text(encoding="utf-8")
)
MODEL = ROOT / "tests" / "data" / "chat_template"
CONFIG = MODEL / "tokenizer_config.json"
TOKENIZER = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
RENDERER = ChatRenderer.from_file(CONFIG, TOKENIZER)
HASHES = DATA["block_hashes"]
CASES = DATA["cases"]


def _name(case: dict[str, Any]) -> str:
    return str(case["name"])


def test_the_fixture_is_transformers_and_vllms() -> None:
    assert DATA["transformers"] and DATA["vllm"] == "0.33.0"
    assert HASHES == {"scheme": "sha256_cbor", "seed": None, "salt": "tenant-a", "block_size": 16}
    assert any(c.get("tools") for c in CASES)
    assert any(isinstance(m["content"], list) for c in CASES for m in c["messages"])
    assert all(c["token_ids"][0] == TOKENIZER.token_to_id("<|begin_of_text|>") for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_the_rendered_prompt_is_transformers(case: dict[str, Any]) -> None:
    assert RENDERER.render(case["messages"], case.get("tools")) == case["text"]
    assert RENDERER.token_ids(case["messages"], case.get("tools")) == case["token_ids"]


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_the_prompts_block_hashes_are_vllms(case: dict[str, Any]) -> None:
    """The query of the rendered ids hashes as vLLM does: the hashes its KV events carry (as
    the index keys them), less the block that ends at the prompt's last token (vLLM
    recomputes that one)."""
    ids = RENDERER.token_ids(case["messages"], case.get("tools"))
    size = HASHES["block_size"]
    query = query_from_tokens(
        "t", ids, HASHES["salt"], size, hasher=get_hasher(HASHES["scheme"], HASHES["seed"])
    )
    want = [event_hash(h) for h in case["vllm_hashes"]]
    assert [event_hash(h) for h in query.block_hashes] == want[: (len(ids) - 1) // size]
    assert query.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "case", [c for c in CASES if isinstance(c["messages"][-1]["content"], str)], ids=_name
)
def test_the_first_user_message_is_located_in_the_ids(case: dict[str, Any]) -> None:
    """(first content token, just past the end of turn): the conversation key's span. A
    content holding a special token's text (tokenized as that token, by vLLM too) ends
    there."""
    ids, first_user = RENDERER.prompt(case["messages"], case.get("tools"))
    assert ids == case["token_ids"] and first_user is not None
    start, end = first_user
    assert end is not None
    content = next(m["content"] for m in case["messages"] if m["role"] == "user").strip()
    eot = TOKENIZER.token_to_id("<|eot_id|>")
    assert ids[end - 1] == eot and eot not in ids[start : end - 1]
    if "<|eot_id|>" in content:
        content = content[: content.index("<|eot_id|>")]
    assert TOKENIZER.decode(ids[start : end - 1]) == content


def test_a_first_user_message_that_cannot_be_located_gives_no_span() -> None:
    assert RENDERER.prompt([{"role": "user", "content": "  "}])[1] is None


def test_the_end_is_looked_for_within_the_tokens_asked() -> None:
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    ids, whole = RENDERER.prompt(messages)
    assert whole is not None
    start, end = whole
    assert end is not None
    assert RENDERER.prompt(messages, within=end - start) == (ids, whole)
    assert RENDERER.prompt(messages, within=end - start - 1) == (ids, (start, None))


def test_tool_call_arguments_as_openai_sends_them_render_as_their_object() -> None:
    """OpenAI's tool-call ``arguments`` is a JSON string; vLLM gives the template the object
    (the fixture's case passes the object to transformers)."""
    (case,) = [c for c in CASES if c.get("tools")]
    messages = json.loads(json.dumps(case["messages"]))
    for m in messages:
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    assert RENDERER.token_ids(messages, case["tools"]) == case["token_ids"]


def test_a_conversation_the_template_refuses_is_a_render_error() -> None:
    for refused in DATA["refused"]:
        with pytest.raises(TemplateRenderError, match=refused["error"]):
            RENDERER.token_ids(refused["messages"])


def _config(**env: str) -> GatewayConfig:
    return GatewayConfig.from_env(
        {
            "GATEWAY_TOKENIZER_FILES": f"fam={MODEL / 'tokenizer.json'}",
            "GATEWAY_CHAT_TEMPLATES": f"fam={CONFIG}",
            "GATEWAY_ADMISSION_STRATEGY": "cache_aware",
            "GATEWAY_PREFIX_HASH": HASHES["scheme"],
            **env,
        }
    )


def test_a_chat_requests_count_and_prefix_query_are_the_models_ids() -> None:
    """Through the chat endpoint: the body as parsed, counted by the configured template
    (one tokenization), its query hashed from the same ids (vLLM's hashes with the
    tenant's salt) and keyed by its first user message."""
    config = _config()
    counter = config.token_counter("fam-2026", "fam")
    assert isinstance(counter, TemplateCounter)
    upstream = UpstreamClient(config)
    endpoint = ChatCompletions(cast(Any, None), config, upstream)
    (case,) = [c for c in CASES if c["name"] == "system, user, assistant, user"]
    req = parse_chat(orjson.dumps({"model": "fam-2026", "messages": case["messages"]}))
    estimate, longest = endpoint.prompt_estimate(req, counter)
    assert estimate == longest == len(case["token_ids"])
    assert req.prompt_ids == case["token_ids"]
    assert req.first_user is not None
    query = endpoint.prefix_query(req, "tenant-1")
    assert query is not None
    hasher = get_hasher(HASHES["scheme"], None)
    salt = upstream.cache_salt("tenant-1")
    want = query_from_tokens("tenant-1", case["token_ids"], salt, 16, hasher=hasher)
    assert list(query.block_hashes) == list(want.block_hashes) and want.block_hashes
    assert query.key_tokens > 0  # placed by the conversation key, as the emulator's prompts


def test_a_refused_conversation_is_a_400_not_a_500() -> None:
    config = _config()
    counter = config.token_counter("fam", "fam")
    assert counter is not None
    endpoint = ChatCompletions(cast(Any, None), config, UpstreamClient(config))
    body = {"model": "fam", "messages": [{"role": "developer", "content": "x"}]}
    req = parse_chat(orjson.dumps(body))  # a role the gateway takes, the template not
    req.messages[0]["role"] = "wizard"
    with pytest.raises(BadRequest, match="unknown role wizard"):
        endpoint.prompt_estimate(req, counter)


@pytest.mark.parametrize(
    ("templates", "why"),
    [
        ("other={config}", "no tokenizer"),
        ("fam=/nonexistent/tokenizer_config.json", "nonexistent"),
        ("fam={empty}", "no chat_template"),
        ("fam={raises}", "always refuses"),
        ("fam={broken}", "endfor"),
        ("fam", "not model=path"),
    ],
)
def test_a_bad_template_setting_is_a_config_error_naming_it(
    templates: str, why: str, tmp_path: Path
) -> None:
    files = {
        "empty": {"bos_token": "<s>"},
        "raises": {"chat_template": "{{ raise_exception('always refuses') }}"},
        "broken": {"chat_template": "{% for m in messages %}"},  # never closed
    }
    paths = {"config": str(CONFIG)}
    for name, content in files.items():
        path = tmp_path / name / "tokenizer_config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(content))
        paths[name] = str(path)
    with pytest.raises(ConfigError, match="GATEWAY_CHAT_TEMPLATES") as raised:
        _config(GATEWAY_CHAT_TEMPLATES=templates.format(**paths))
    assert why in str(raised.value)


@pytest.mark.parametrize("arguments", ["", "not json", "[1, 2]", None])
def test_tool_call_arguments_that_are_no_object_render_as_an_empty_one(arguments: Any) -> None:
    """vLLM's coercion: empty, invalid JSON or JSON that is not an object gives ``{}``."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    given: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
    ]
    empty = {**call, "function": {"name": "f", "arguments": {}}}
    want = [given[0], {"role": "assistant", "tool_calls": [empty]}]
    assert RENDERER.render(given) == RENDERER.render(want)
    assert '"parameters": {}' in RENDERER.render(given)
