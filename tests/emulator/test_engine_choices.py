"""Engine accounting of n choices and decided outputs; the structured-output generator."""

from __future__ import annotations

import random
from typing import Any

import jsonschema
import pytest

from emulator.structured import (
    SchemaError,
    conforming_instance,
    plan_json,
    plan_tool_calls,
    split_tokens,
)
from emulator.tokenizer import Tokenizer

from .conftest import run_until_idle, small_engine

BS = 16


def test_n_sequences_share_the_prompt_blocks_and_each_grow_their_own() -> None:
    engine = small_engine(kv_capacity_tokens=BS * 200)
    prompt = list(range(5000, 5100))  # 100 tokens: 6 full blocks and a partial one
    reqs = [
        engine.add_request(f"{i}_r", prompt, 40, ignore_eos=True, seed=i, cache_salt="s")
        for i in range(3)
    ]
    engine.step()  # all three admitted in one step
    shared = reqs[0].blocks[:6]
    for req in reqs[1:]:
        assert req.blocks[:6] == shared  # the same physical blocks, by reference
        assert req.num_cached_tokens == 96  # prefill of the shared part computed once
    assert len({reqs[0].blocks[6], reqs[1].blocks[6], reqs[2].blocks[6]}) == 3
    assert engine.pool.num_used == 6 + 3
    for _ in range(30):
        engine.step()
    assert all(r.num_output == 31 for r in reqs)
    # Decode KV: each sequence holds its own blocks past the shared prefix, n times over.
    own = (100 + 31 - 1) // BS + 1 - 6
    assert all(len(r.blocks) == 6 + own for r in reqs)
    assert engine.pool.num_used == 6 + 3 * own
    assert len({r.tok_offset for r in reqs}) == 3  # different seeds: different text
    run_until_idle(engine)
    assert engine.pool.num_used == 0


def test_decided_output_is_emitted_exactly_and_cut_at_max_tokens() -> None:
    engine = small_engine()
    plan = plan_json({"city": "Paris", "days": [1, 2, 3], "note": "two words"})
    whole = engine.add_request("a", [5000] * 20, 1000, output_token_ids=plan.token_ids)
    cut = engine.add_request("b", [5001] * 20, 3, output_token_ids=plan.token_ids)
    run_until_idle(engine)
    assert whole.output_token_ids == plan.token_ids
    assert whole.finish_reason == "stop"
    assert cut.output_token_ids == plan.token_ids[:3] and cut.finish_reason == "length"
    assert whole.num_output == Tokenizer().count_text(plan.text)


def test_split_tokens_round_trips_and_counts_like_the_tokenizer() -> None:
    for text in ['{"a": "b c", "long_key_name": [1, 2]}', "  lead and trail  ", "x", ""]:
        pieces = split_tokens(text)
        assert "".join(pieces) == text
        assert len(pieces) == Tokenizer().count_text(text)


def test_parallel_tool_call_deltas_rebuild_each_call() -> None:
    rng = random.Random(5)
    plan = plan_tool_calls([("f", {"a": 1, "b": "x y"}), ("g", {"c": [True]})], rng, "tool_calls")
    names: dict[int, list[str]] = {}
    args: dict[int, str] = {}
    for delta in plan.deltas:
        for part in (delta or {}).get("tool_calls", []):
            function = part["function"]
            if "name" in function:
                names.setdefault(part["index"], []).append(function["name"])
            args[part["index"]] = args.get(part["index"], "") + function["arguments"]
    assert names == {0: ["f"], 1: ["g"]}
    assert args == {0: plan.tool_calls[0].arguments, 1: plan.tool_calls[1].arguments}
    assert len(plan.token_ids) == Tokenizer().count_text(plan.text)


SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"x": {"type": "integer", "exclusiveMinimum": 5, "maximum": 6}},
        "required": ["x"],
    },  # fmt: skip
    {
        "type": "array",
        "items": {"type": "number", "minimum": 0.5, "maximum": 0.75},
        "minItems": 2,
        "maxItems": 2,
    },  # fmt: skip
    {"type": "string", "format": "date-time"},
    {"type": "string", "minLength": 30, "maxLength": 40},
    {
        "anyOf": [
            {"type": "null"},
            {"type": "object", "properties": {"q": {"const": 3}}, "required": ["q"]},
        ]
    },  # fmt: skip
    {
        "$defs": {
            "N": {
                "type": "object",
                "properties": {
                    "kids": {"type": "array", "maxItems": 0, "items": {"$ref": "#/$defs/N"}}
                },
                "required": ["kids"],
            }
        },
        "$ref": "#/$defs/N",
    },  # fmt: skip
    {"type": ["integer", "null"], "multipleOf": 7, "minimum": 10, "maximum": 30},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_generated_instances_validate(schema: dict[str, Any]) -> None:
    for seed in range(5):
        jsonschema.validate(conforming_instance(schema, random.Random(seed)), schema)


def test_unsatisfiable_schema_is_refused() -> None:
    with pytest.raises(SchemaError):
        conforming_instance({"type": "string", "pattern": "^[0-9]{5}$"}, random.Random(0))
