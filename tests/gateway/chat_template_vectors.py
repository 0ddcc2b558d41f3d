"""Generate ``tests/data/chat_template_vectors.json``: prompt token ids computed by
transformers' own ``apply_chat_template`` (tokenize=True, add_generation_prompt=True), for
``test_chat_template.py`` to check ``gateway.admission.chat_template`` against.

The model is the fixture's own (tests/data/chat_template/): a small byte-level BPE
``tokenizer.json`` trained here with ``tokenizers`` on a few sentences, with Llama 3's
special tokens, and a ``tokenizer_config.json`` holding a chat template written for this
test in Llama 3's style (BOS, headers, tools as JSON in the system turn, tool calls,
``raise_exception`` for an unknown role, ``namespace``, ``tojson`` with options). The
generator writes both files, renders the conversations below with transformers, and
hashes each prompt's blocks with vLLM's own code (``vllm_vectors.Vllm``, from the vLLM
wheel: sha256_cbor, PYTHONHASHSEED unset, ``SALT``, ``BLOCK_SIZE``), as the KV events of a
replica serving that prompt would carry them. Run, from the repository root, with
transformers in a throwaway venv (not the project's) and vLLM's two light dependencies::

    python3 -m venv /tmp/chattpl-venv
    /tmp/chattpl-venv/bin/pip install transformers tokenizers==0.23.3 jinja2
    pip download vllm==0.33.0 --no-deps -d /tmp/vllmwheel
    .venv/bin/python -m pip install --target /tmp/vllmvec-deps msgspec cbor2
    PYTHONPATH=$PWD:/tmp/vllmvec-deps /tmp/chattpl-venv/bin/python \\
        -m tests.gateway.chat_template_vectors /tmp/vllmwheel/vllm-0.33.0-*.whl
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL = DATA / "chat_template"
FIXTURE = DATA / "chat_template_vectors.json"
BLOCK_SIZE = 16
SALT = "tenant-a"
SCHEME = "sha256_cbor"

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|eom_id|>",
]

TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- if tools is not none or ns.system %}
<|start_header_id|>system<|end_header_id|>

{% if tools is not none %}
You can call these functions. Answer with a JSON object {"name": ..., "parameters": ...}.
{% for t in tools %}
{{ t | tojson(indent=4) }}
{% endfor %}
{% endif %}
{{- ns.system }}<|eot_id|>
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception('unknown role ' ~ message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'assistant' and message.get('tool_calls') %}
<|start_header_id|>assistant<|end_header_id|>

        {%- for call in message['tool_calls'] %}
{{ '<|python_tag|>' }}{"name": "{{ call['function']['name'] }}", "parameters": {{
    call['function']['arguments'] | tojson(sort_keys=true) }}}
        {%- endfor %}
<|eom_id|>
    {%- elif message['role'] in ['tool', 'ipython'] %}
<|start_header_id|>ipython<|end_header_id|>

{% if message['content'] is mapping %}{{ message['content'] | tojson }}{% else %}{{
    message['content'] }}{% endif %}<|eot_id|>
    {%- else %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}
{%- for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}
{%- endfor %}
{%- endif %}<|eot_id|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and in English.",
    "What is the weather like in Paris today? It is sunny, 21 degrees.",
    "get_weather location unit celsius fahrenheit parameters properties required type object",
    '{"name": "get_weather", "parameters": {"location": "Paris"}}',
    "Ünïcödé tèxt, 日本語のテキスト, emoji 🎉 and tabs\tand\nnewlines.",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place — now",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    }
]

CONVERSATIONS: list[dict[str, Any]] = [
    {"name": "user only", "messages": [{"role": "user", "content": "Hello there!"}]},
    {
        "name": "system, user, assistant, user",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather like in Paris?"},
            {"role": "assistant", "content": "It is sunny, 21 degrees."},
            {"role": "user", "content": "  And tomorrow?\n"},
        ],
    },
    {
        "name": "tools and a tool call",
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris, in celsius?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"unit": "celsius", "location": "Paris"},
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
    },
    {
        "name": "multi-part content and unicode",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Ünïcödé tèxt, "},
                    {"type": "text", "text": "日本語のテキスト 🎉\tand\nnewlines."},
                ],
            }
        ],
    },
    {
        "name": "special-token text in content",
        "messages": [{"role": "user", "content": "say <|eot_id|> literally"}],
    },
]

# Conversations the template refuses: (name, messages, a phrase of the error).
REFUSED = [("unknown role", [{"role": "wizard", "content": "hi"}], "unknown role wizard")]


def _train() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    MODEL.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(MODEL / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (MODEL / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from tests.gateway.vllm_vectors import Vllm

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("wheel", type=Path, help="vllm-0.33.0-*.whl")
    vllm = Vllm(parser.parse_args(argv).wheel)
    vllm.init_none_hash(SCHEME, None)

    _train()
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))  # as vLLM loads a model's files
    cases = []
    for case in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        text = tokenizer.apply_chat_template(
            case["messages"], tools=case.get("tools"), add_generation_prompt=True, tokenize=False
        )
        hashes = vllm.request_block_hashes(SCHEME, list(ids), SALT, BLOCK_SIZE)
        events = [vllm.external(h, True) for h in hashes]  # as KV events carry them
        cases.append({**case, "text": text, "token_ids": list(ids), "vllm_hashes": events})
    refused = []
    for name, messages, phrase in REFUSED:
        try:
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # transformers raises jinja2's TemplateError
            assert phrase in str(exc), exc
            refused.append({"name": name, "messages": messages, "error": phrase})
        else:
            raise AssertionError(f"{name}: rendered")
    out = {
        "generator": "tests/gateway/chat_template_vectors.py",
        "transformers": version("transformers"),
        "tokenizers": version("tokenizers"),
        "jinja2": version("jinja2"),
        "vllm": vllm.version,
        "vllm_wheel_sha256": vllm.wheel_sha256,
        "block_hashes": {"scheme": SCHEME, "seed": None, "salt": SALT, "block_size": BLOCK_SIZE},
        "cases": cases,
        "refused": refused,
    }
    FIXTURE.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
