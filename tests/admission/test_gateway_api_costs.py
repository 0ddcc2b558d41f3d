"""What tools, json schemas, ``n``, logprobs and legacy completions cost in admission (and
that the other new fields, ``stop`` to ``store``, cost nothing), through a running gateway
with real Redis and emulated replicas: the tokens/min charge (the
``x-ratelimit-remaining-tokens`` header right after admission), the KV·seconds lease (the
tenant's in-flight ledger in Redis while a stream is held) and the refunds at settle.

As in test_gateway_admission.py, ``GATEWAY_ADMISSION_TPOT_STALE_FACTOR=1`` pins the TPOT
estimate to the version's target, so each expected KV·seconds figure is computed exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from contracts import schema
from contracts.formulas import kv_gib_seconds
from emulator.testing import SpawnedEmulator, spawn_emulator
from emulator.tokenizer import Tokenizer
from gateway.admission.estimates import to_milli
from tests.admission.procs import (
    GatewayProc,
    Seeder,
    Tenant,
    chat_body,
    held_streams,
    open_stream,
    spawn_gateway,
)
from tests.admission.test_gateway_admission import inflight
from tests.admission.test_gateway_admission import version as plain_version
from tests.support import wait_until

pytestmark = pytest.mark.slow

PROFILE = "llama-8b-tp1-h100"
KV_BYTES = 128 * 1024
TARGET_S = 0.05
GW_ENV = {"GATEWAY_ADMISSION_TPOT_STALE_FACTOR": "1"}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number and the customer's postcode",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer"}, "postcode": {"type": "string"}},
                "required": ["number", "postcode"],
            },
        },
    }
]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
}


def version(name: str, family: str, url: str) -> schema.ModelVersionRecord:
    """test_gateway_admission's version, able to do what these requests ask."""
    return dataclasses.replace(
        plain_version(name, family, url, 16_384),
        supports_tools=True,
        tool_call_parser="llama3_json",
        supports_structured_output=True,
        max_n=8,
        supports_logprobs=True,
        max_top_logprobs=20,
    )


def limits(tpm: int) -> dict[str, schema.LimitRecord]:
    lim = schema.LimitRecord(
        rpm=100_000, tpm=tpm, max_context=16_000, max_output=4_096, kv_seconds_cap=1_000_000,
        reserved_kv=0,
    )  # fmt: skip
    return {"fast": lim, "slow": lim}


def est_milli(prompt: int, out: int, sequences: int = 1) -> int:
    """The lease: the prompt's KV once, each sequence's decode KV on top."""
    return to_milli(
        kv_gib_seconds(prompt, out, KV_BYTES, TARGET_S)
        + (sequences - 1) * kv_gib_seconds(0, out, KV_BYTES, TARGET_S)
    )


@pytest.fixture(scope="module")
def fast() -> Iterator[SpawnedEmulator]:
    with spawn_emulator(
        PROFILE, "fast-v1", 20.0, enable_auto_tool_choice=True, tool_call_parser="llama3_json"
    ) as emu:
        yield emu


@pytest.fixture(scope="module")
def slow() -> Iterator[SpawnedEmulator]:
    with spawn_emulator(
        PROFILE, "slow-v1", 0.5, kv_capacity_tokens=16_384, no_prefix_caching=True
    ) as emu:
        yield emu


@pytest.fixture(scope="module")
def rm(rdb: redis.Redis, fast: SpawnedEmulator, slow: SpawnedEmulator) -> Seeder:
    model = Seeder(rdb)
    model.add_version(version("fast-v1", "fast", fast.base_url))
    model.add_version(version("slow-v1", "slow", slow.base_url))
    return model


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, rm: Seeder
) -> Iterator[GatewayProc]:
    proc = spawn_gateway(tmp_path_factory.mktemp("gw"), redis_url, GW_ENV)
    yield proc
    proc.terminate(20)


def post(
    gw: GatewayProc, tenant: Tenant, body: dict[str, Any], path: str = "chat/completions"
) -> httpx.Response:
    response = httpx.post(f"{gw.base_url}/v1/{path}", json=body, headers=tenant.auth, timeout=60)
    assert response.status_code == 200, response.text
    return response


def charged(tpm: int, response: httpx.Response) -> int:
    """Tokens the request was charged at admission (a fresh tenant's first request)."""
    return tpm - int(response.headers["x-ratelimit-remaining-tokens"])


TPM = 1_000_000


def test_tool_definitions_are_charged_as_the_replica_counts_them(
    rm: Seeder, gw: GatewayProc
) -> None:
    bare_tenant = rm.tenant("standard", limits(TPM))
    tools_tenant = rm.tenant("standard", limits(TPM))
    bare = post(gw, bare_tenant, chat_body("fast", 10, 50))
    with_tools = post(gw, tools_tenant, chat_body("fast", 10, 50, tools=TOOLS, tool_choice="none"))
    # The estimate is the replica's own count (its template renders the tools as JSON).
    assert charged(TPM, with_tools) == with_tools.json()["usage"]["prompt_tokens"] + 50
    assert charged(TPM, bare) == bare.json()["usage"]["prompt_tokens"] + 50
    assert charged(TPM, with_tools) - charged(TPM, bare) > 40


def test_json_schema_is_charged_with_the_prompt(rm: Seeder, gw: GatewayProc) -> None:
    plain_tenant = rm.tenant("standard", limits(TPM))
    schema_tenant = rm.tenant("standard", limits(TPM))
    plain = post(gw, plain_tenant, chat_body("fast", 10, 50))
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    structured = post(gw, schema_tenant, chat_body("fast", 10, 50, response_format=fmt))
    json.loads(structured.json()["choices"][0]["message"]["content"])
    schema_tokens = Tokenizer().count_text(json.dumps(SCHEMA))
    assert charged(TPM, structured) - charged(TPM, plain) == schema_tokens


def test_n_multiplies_the_output_charge_and_the_unused_part_is_refunded(
    rm: Seeder, gw: GatewayProc
) -> None:
    tpm = 9_000  # refills 150 tokens/s
    t = rm.tenant("standard", limits(tpm))
    started = time.monotonic()
    first = post(gw, t, chat_body("fast", 3, 2_000, n=3, seed=4))
    est = 10 + 3 * 2_000
    assert charged(tpm, first) == est
    usage = first.json()["usage"]
    assert len(first.json()["choices"]) == 3
    actual = usage["prompt_tokens"] + usage["completion_tokens"]
    second = post(gw, t, chat_body("fast", 3, 10))
    gap = time.monotonic() - started
    left = int(second.headers["x-ratelimit-remaining-tokens"])
    assert left >= tpm - actual - 20  # settled at the actual count of all three choices
    assert 150 * gap < est - actual, (gap, actual)  # refill alone could not explain it


def test_completions_prompts_and_n_charged_and_refunded(rm: Seeder, gw: GatewayProc) -> None:
    tpm = 9_000
    t = rm.tenant("standard", limits(tpm))
    prompts = ["one two six", "four five ten nine"]  # one token a word
    result = post(
        gw, t, {"model": "fast", "prompt": prompts, "n": 2, "max_tokens": 1_000}, "completions"
    )
    # BOS + words per prompt; 2 prompts x n=2 sequences of up to 1,000 tokens
    assert charged(tpm, result) == (1 + 3) + (1 + 4) + 4 * 1_000
    assert result.json()["usage"]["prompt_tokens"] == 9
    assert len(result.json()["choices"]) == 4


def _tokens(value: Any) -> int:
    return Tokenizer().count_text(json.dumps(value))


PROMPT, OUT = 93 + 7, 3_000
TOOL_PROMPT = PROMPT + 4 + _tokens(TOOLS)  # the tools' template block
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
# The fields that cost nothing in admission: neither tokens/min nor KV·seconds move.
FREE_FIELDS: dict[str, Any] = {
    "stop": ["zz"], "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "logit_bias": {"11": 1}, "user": "u-1", "metadata": {"k": "v"},
    "service_tier": "default", "store": False,
}  # fmt: skip
LEASES: list[tuple[str, dict[str, Any], int, int]] = [
    # (case, extra fields, tokens charged, KV lease in milli-GiB·s)
    ("n=3", {"n": 3}, PROMPT + 3 * OUT, est_milli(PROMPT, OUT, 3)),
    ("logprobs", {"logprobs": True, "top_logprobs": 5}, PROMPT + OUT, est_milli(PROMPT, OUT)),
    (
        "tools",
        {"tools": TOOLS, "tool_choice": "none"},
        TOOL_PROMPT + OUT,
        est_milli(TOOL_PROMPT, OUT),
    ),
    (
        "json_schema",
        {"response_format": SCHEMA_FORMAT},
        PROMPT + _tokens(SCHEMA) + OUT,
        est_milli(PROMPT + _tokens(SCHEMA), OUT),
    ),
    ("free fields", FREE_FIELDS, PROMPT + OUT, est_milli(PROMPT, OUT)),
    (
        "tool_choice, parallel_tool_calls",
        {"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": False},
        TOOL_PROMPT + OUT,
        est_milli(TOOL_PROMPT, OUT),
    ),
]


@pytest.mark.parametrize(("case", "extra", "tokens", "kv"), LEASES, ids=[c[0] for c in LEASES])
async def test_lease_and_charge_then_refund_when_the_client_leaves(
    rm: Seeder,
    gw: GatewayProc,
    rdb: redis.Redis,
    case: str,
    extra: dict[str, Any],
    tokens: int,
    kv: int,
) -> None:
    """While a long stream is held, the tenant's ledger holds exactly the estimated lease
    (n sequences: the prompt's KV once; logprobs: nothing extra) and tokens/min the
    estimate; when the client goes away both are given back (only what ran is kept)."""
    tpm = 12_000  # refills 200 tokens/s: a refund shows
    t = rm.tenant("standard", limits(tpm))
    started = time.monotonic()
    async with held_streams() as (client, held):
        body = chat_body("slow", 93, OUT, ignore_eos=True, **extra)
        response = await open_stream(client, held, gw, t, body)
        assert response.status_code == 200, response.text
        assert inflight(rdb, t, "slow") == (1, kv)
        assert charged(tpm, response) == tokens
    await asyncio.to_thread(
        wait_until, lambda: inflight(rdb, t, "slow") == (0, 0), 10, 0.05, "lease released"
    )
    after = await asyncio.to_thread(post, gw, t, chat_body("fast", 3, 10))
    gap = time.monotonic() - started
    left = int(after.headers["x-ratelimit-remaining-tokens"])
    output = OUT * extra.get("n", 1)
    # Charged the prompt and the few tokens made before the client left (and the 20 of the
    # request just made), not the estimate ...
    assert left >= tpm - (tokens - output) - 200 - 20, case
    assert 200 * gap < output - 300, gap  # ... which refill alone could not explain
