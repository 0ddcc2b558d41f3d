"""Cache-aware routing's pieces: block hashes as the replica computes them, the bounded and
aged index, vLLM KV events (decoded and applied; over ZMQ from a real emulated replica), and
the ``prompt_cache_key`` field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

import httpx
import msgpack
import orjson
import pytest

from emulator.engine import Engine, EngineConfig
from emulator.kv import AllBlocksCleared, BlockRemoved, BlockStored
from emulator.kv_events import encode_batch
from emulator.profiles import get_profile
from emulator.testing import spawn_emulator
from emulator.tokenizer import Tokenizer
from gateway.admission.prefix import (
    MASK64,
    KVEventSubscriber,
    PrefixIndex,
    PrefixQuery,
    block_hashes,
    conversation_block,
    decode_event_batch,
    hint_key,
    make_query,
    parse_endpoints,
    prompt_token_ids,
)
from gateway.endpoints.validation import parse_chat
from gateway.errors import BadRequest
from tests.support import free_port, wait_until_async

SALT_A = "a" * 64
SALT_B = "b" * 64


def words(n: int, seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


def body(messages: Sequence[Mapping[str, object]], **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **extra})


def test_gateway_block_hashes_equal_the_replicas_own() -> None:
    """The gateway tokenizes the validated messages it sends upstream; the engine hashes what
    its tokenizer makes of them. The cacheable blocks must be the same hashes."""
    raw: list[dict[str, object]] = [
        {"role": "developer", "content": words(60, 1)},
        {"role": "user", "content": [{"type": "text", "text": words(30, 2)}]},
        {"role": "assistant", "content": words(45, 3)},
        {"role": "user", "content": words(20, 4) + " naïve ünïcode"},
    ]
    req = parse_chat(body(raw))
    engine = Engine(get_profile("llama-8b-tp1-h100"), EngineConfig())
    upstream_tokens = Tokenizer().apply_chat_template(req.messages)  # what the replica sees
    er = engine.add_request("r", upstream_tokens, 4, cache_salt=SALT_A)
    ours = block_hashes(prompt_token_ids(req.messages), 16, SALT_A)
    usable = (len(upstream_tokens) - 1) // 16
    assert len(ours) == usable > 5
    assert ours == er.block_hashes[:usable]


def test_salt_isolates_tenants_and_hints() -> None:
    msgs = [{"role": "user", "content": words(80, 5)}]
    tokens = prompt_token_ids(msgs)
    a, b = block_hashes(tokens, 16, SALT_A), block_hashes(tokens, 16, SALT_B)
    assert a and not set(a) & set(b)  # the salt in block 0 changes every chained hash
    assert hint_key("conv-1", SALT_A) != hint_key("conv-1", SALT_B)
    assert hint_key("conv-1", SALT_A) == hint_key("conv-1", SALT_A)
    qa = make_query("ta", msgs, SALT_A, 16, "conv-1")
    qb = make_query("tb", msgs, SALT_B, 16, "conv-1")
    assert qa.placement_key != qb.placement_key
    # no hint: the placement key is a chain hash, shared by prompts with the same start
    longer = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    assert make_query("ta", msgs, SALT_A, 16).placement_key == (
        make_query("ta", longer, SALT_A, 16).placement_key
    )


def conversation(system: str, first: str, turns: int) -> list[list[dict[str, str]]]:
    """The prompts of a conversation's turns: each resends the last one, the reply and a new
    user message."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    out = [list(msgs)]
    for t in range(1, turns):
        msgs += [
            {"role": "assistant", "content": words(40 + t, 100 + t)},
            {"role": "user", "content": words(15 + 7 * t, 200 + t)},
        ]
        out.append(list(msgs))
    return out


KEY_SCRIPT = """
import sys, json
from gateway.admission.prefix import make_query
turns = json.loads(sys.stdin.read())
print(json.dumps([make_query("t", m, "a" * 64, 16).placement_key for m in turns]))
"""


def test_a_conversation_keeps_its_key_on_every_turn_and_in_every_process() -> None:
    """The placement key of a chat request without a hint is its conversation's: the same on
    every turn (each turn resends the first user message after the same system prompt), and
    the same in another gateway process (another hash seed: nothing salted per process)."""
    turns = conversation(words(700, 1), words(60, 2), 5)
    keys = [make_query("t", m, SALT_A, 16).placement_key for m in turns]
    assert len(set(keys)) == 1
    assert all(make_query("t", m, SALT_A, 16).key_tokens > 0 for m in turns)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", KEY_SCRIPT],
        input=json.dumps(turns),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert json.loads(out.stdout) == keys


def test_conversations_sharing_a_long_system_prompt_get_their_own_keys() -> None:
    """A system prompt far longer than the key's old depth (3 blocks) gave every one of the
    tenant's conversations the same key; the conversation key differs between them, and
    their shared key (the old one, their system prompt's) does not."""
    system = words(700, 1)
    queries = [
        make_query("t", conversation(system, words(30, 10 + c), 1)[0], SALT_A, 16)
        for c in range(20)
    ]
    assert len({q.placement_key for q in queries}) == 20
    assert len({q.shared_key for q in queries}) == 1
    old = block_hashes(prompt_token_ids([{"role": "system", "content": system}]), 16, SALT_A)
    assert queries[0].shared_key == old[2] & MASK64  # the chain hash at the third block
    # only as far as the key is tokenized and hashed: the system prompt, and of a long first
    # user message the words that can reach 3 blocks past its start (2 tokens a word here)
    system_tokens = len(prompt_token_ids([{"role": "system", "content": system}])) - 3
    long_first = conversation(system, words(3000, 3), 3)[-1]
    q = make_query("t", long_first, SALT_A, 16)
    assert not q.settled and q.known_prompt_tokens <= system_tokens + 3 + 2 * 4 * 16
    assert q.key_tokens == len(q.known_hashes()) * 16


def test_a_client_hint_still_keys_the_placement() -> None:
    turns = conversation(words(700, 1), words(60, 2), 2)
    for m in turns:
        q = make_query("t", m, SALT_A, 16, "conv-9")
        assert q.placement_key == hint_key("conv-9", SALT_A) and q.hinted and q.key_tokens == 0


@pytest.mark.parametrize(
    ("start", "end", "block"),
    [
        (3, None, 2),  # a long first message: 3 blocks from where it starts
        (3, 200, 2),
        (705, 800, 46),  # after a long system prompt: the message starts in block 44
        (705, 730, 44),  # a short one: its last full block
        (705, 718, 43),  # too short to end a block past its start: the system prompt's
        (3, 12, None),  # under one block
    ],
)
def test_conversation_block(start: int, end: int | None, block: int | None) -> None:
    assert conversation_block(start, end, 16) == block


def test_a_short_prompt_has_no_cacheable_block() -> None:
    assert block_hashes(list(range(16)), 16, SALT_A) == []  # the last token is recomputed
    assert len(block_hashes(list(range(17)), 16, SALT_A)) == 1
    q = make_query("t", [{"role": "user", "content": "hi"}], SALT_A, 16)
    assert q.block_hashes == () and q.prompt_tokens == 8


def test_index_matches_leading_blocks_only() -> None:
    idx = PrefixIndex()
    idx.record("r0", [1, 2, 3, 4])
    idx.record("r1", [1, 2])
    assert idx.match([1, 2, 3, 9], ["r0", "r1", "r2"]) == {"r0": 3, "r1": 2, "r2": 0}
    assert idx.match([9, 1, 2], ["r0"]) == {"r0": 0}  # a chain starts at block 0


def test_index_is_bounded_per_replica_lru() -> None:
    idx = PrefixIndex(max_blocks_per_replica=100)
    idx.record("r0", range(80))
    idx.record("r0", range(10))  # touched again: most recent
    idx.record("r0", range(1000, 1050))
    assert idx.blocks_of("r0") == 100 and idx.evicted == 30
    assert idx.match(list(range(10)), ["r0"]) == {"r0": 10}  # recently used survive
    assert idx.match([10], ["r0"]) == {"r0": 0}  # least recently used went first
    for i in range(50):
        idx.record(f"x{i}", range(500))
    assert len(idx) <= 100 * 51  # bound holds whatever the traffic


def test_index_entries_age_out() -> None:
    now = [0.0]
    idx = PrefixIndex(ttl_s=10.0, clock=lambda: now[0])
    idx.record("r0", [1, 2, 3])
    now[0] = 8.0
    idx.record("r0", [1])  # refreshed
    now[0] = 15.0
    assert idx.match([1, 2, 3], ["r0"]) == {"r0": 1}
    assert idx.blocks_of("r0") == 1  # expired entries are dropped, not just skipped
    now[0] = 30.0
    assert idx.match([1], ["r0"]) == {"r0": 0}


def test_index_applies_vllm_events() -> None:
    idx = PrefixIndex()
    payload = encode_batch(
        0.0,
        [
            BlockStored([11, 12, 13], None, list(range(48)), 16, cache_salt=SALT_A),
            BlockRemoved([13]),
        ],
    )
    events = decode_event_batch(payload)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved"]
    idx.apply_events("r0", events)
    assert idx.match([11, 12, 13], ["r0"]) == {"r0": 2}
    idx.apply_events("r0", decode_event_batch(encode_batch(0.0, [AllBlocksCleared()])))
    assert idx.match([11], ["r0"]) == {"r0": 0}
    # msgspec's array_like encoding (tag first) is understood too
    arr = msgpack.packb([0.0, [["BlockStored", [21, 22], None, [], 16, None]], 0])
    idx.apply_events("r1", decode_event_batch(arr))
    assert idx.match([21, 22], ["r1"]) == {"r1": 2}
    with pytest.raises(ValueError):
        decode_event_batch(msgpack.packb(7))


def test_subscriber_drops_a_replica_on_a_sequence_gap() -> None:
    idx = PrefixIndex()
    sub = KVEventSubscriber(idx, "r0", "tcp://127.0.0.1:1")
    batch = encode_batch(0.0, [BlockStored([1, 2], None, [], 16)])
    sub.handle((b"", (0).to_bytes(8, "big"), batch))
    assert idx.blocks_of("r0") == 2
    sub.handle((b"", (5).to_bytes(8, "big"), encode_batch(0.0, [BlockStored([3], 2, [], 16)])))
    assert sub.gaps == 1 and idx.match([1], ["r0"]) == {"r0": 0} and idx.blocks_of("r0") == 1
    sub.handle((b"", (6).to_bytes(8, "big"), b"\xc1not msgpack"))  # ignored, no crash
    assert sub.batches == 2


def test_endpoints_config() -> None:
    assert parse_endpoints("r0=tcp://127.0.0.1:5557, r1=tcp://h:1") == {
        "r0": "tcp://127.0.0.1:5557",
        "r1": "tcp://h:1",
    }
    assert parse_endpoints("") == {}
    with pytest.raises(ValueError):
        parse_endpoints("r0:5557")


def test_salted_hashes_are_the_same_in_every_process() -> None:
    """``hash()`` of a str differs between processes: the salted chain must not use one."""
    code = (
        "from gateway.admission.prefix import block_hashes; "
        f"print(block_hashes(list(range(100)), 16, {SALT_A!r}))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(100)), 16, SALT_A))


async def test_subscriber_follows_a_replica_process_over_zmq() -> None:
    """A replica process publishing over ZMQ: the index learns exactly the blocks the
    gateway computes for the prompt it sent (salted, so not another tenant's), and forgets
    them when the replica evicts them."""
    port = free_port()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    idx = PrefixIndex()
    sub = KVEventSubscriber(idx, "r0", f"tcp://127.0.0.1:{port}")
    with spawn_emulator(
        "llama-8b-tp1-h100", "kv", 50.0, kv_events_config=config, kv_capacity_tokens=4096
    ) as emu:
        sub.start()
        try:
            async with httpx.AsyncClient(base_url=emu.base_url, timeout=30) as client:

                async def send(msgs: list[dict[str, str]]) -> None:
                    body = {"model": "kv", "messages": msgs, "max_tokens": 1, "cache_salt": SALT_A}
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200

                def stored(q: PrefixQuery) -> Callable[[], bool]:
                    return lambda: idx.match(q.block_hashes, ["r0"])["r0"] > 0

                # PUB drops what precedes the subscription: send until one lands
                query = None
                for attempt in range(50):
                    msgs = [{"role": "user", "content": words(120, 100 + attempt)}]
                    await send(msgs)
                    q = make_query("t", msgs, SALT_A, 16)
                    try:
                        await wait_until_async(stored(q), 0.3, 0.01)
                    except AssertionError:
                        continue  # not seen within 0.3 s: send another
                    query = q
                    break
                assert query is not None, "no KV event reached the subscriber"
                assert idx.match(query.block_hashes, ["r0"])["r0"] == len(query.block_hashes)
                other_tenant = make_query("u", msgs, SALT_B, 16)
                assert idx.match(other_tenant.block_hashes, ["r0"])["r0"] == 0
                # fill the 4,096-token cache with other prompts: the first one is evicted
                for n in range(12):
                    await send([{"role": "user", "content": words(300, 500 + n)}])
                await wait_until_async(
                    lambda: idx.match(query.block_hashes, ["r0"])["r0"] == 0, 5, 0.01, "eviction"
                )
                assert sub.gaps == 0 and sub.events > 0
        finally:
            await sub.stop()


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"prompt_cache_key": 5}, "prompt_cache_key", "invalid_type"),
        ({"prompt_cache_key": ["a"]}, "prompt_cache_key", "invalid_type"),
        ({"prompt_cache_key": ""}, "prompt_cache_key", "invalid_value"),
        ({"prompt_cache_key": "k" * 513}, "prompt_cache_key", "invalid_value"),
        ({"user": 7}, "user", "invalid_type"),
    ],
)
def test_prompt_cache_key_is_validated(extra: dict[str, object], param: str, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_chat(body([{"role": "user", "content": "hi"}], **extra))
    assert info.value.param == param and info.value.code == code


def test_prompt_cache_key_then_user_is_the_hint() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat(body(msgs, prompt_cache_key="k", user="u")).cache_hint == "k"
    assert parse_chat(body(msgs, user="u")).cache_hint == "u"
    assert parse_chat(body(msgs)).cache_hint is None
    assert "prompt_cache_key" not in parse_chat(body(msgs, prompt_cache_key="k")).sampling


def test_a_long_prompt_is_hashed_up_to_the_cap_and_agrees_with_the_full_hash() -> None:
    msgs = [
        {"role": "system", "content": words(500, 6)},
        {"role": "user", "content": words(3000, 7)},
        {"role": "assistant", "content": words(200, 8)},
    ]
    full = make_query("t", msgs, SALT_A, 16, max_blocks=10_000)
    capped = make_query("t", msgs, SALT_A, 16, max_blocks=100)
    assert len(capped.block_hashes) == 100 < len(full.block_hashes)
    assert capped.block_hashes == full.block_hashes[:100]
    assert capped.placement_key == full.placement_key
    tokens = prompt_token_ids(msgs)
    assert prompt_token_ids(msgs, 50) == tokens[:50]
    assert prompt_token_ids(msgs, len(tokens) + 5) == tokens
