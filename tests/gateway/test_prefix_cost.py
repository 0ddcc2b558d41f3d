"""Cache-aware routing pays only for what the index can follow: a ``PrefixQuery`` tokenizes and
hashes lazily, ``PrefixIndex.match_query`` stops at the first block no replica holds, and the
router records a dispatch's whole chain after the request's handler yields. Each lazy path
must give exactly what the eager computation gives (hashes, token count, placement key,
matches, the index's contents)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import schema
from contracts.blockhash import get_hasher, salt_key
from gateway.admission.config import AdmissionConfig
from gateway.admission.prefix import (
    MASK64,
    PLACEMENT_BLOCK,
    PrefixIndex,
    PrefixQuery,
    block_hashes,
    make_query,
    prompt_token_ids,
)
from gateway.admission.router import Router
from tests.admission.test_router import VERSION, Registry

SALT = "c" * 64
HASHERS = [get_hasher("emulator"), get_hasher("sha256_cbor", "7")]

# Few distinct words, so that prompts share prefixes and chains collide across examples.
word = st.sampled_from(["a", "bb", "ccc", "dddd", "eeeee", "ffffffffff", "gé", "日本"])
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.lists(word, max_size=120).map(" ".join),
    }
)
conversations = st.lists(message, min_size=1, max_size=4)


def eager(
    msgs: list[dict[str, str]], bs: int, max_blocks: int, hasher_index: int
) -> tuple[list[int], int, int]:
    """The query as computed before it was lazy: (hashes, tokens examined, placement key)."""
    cap = max_blocks * bs + 1
    tokens = prompt_token_ids(msgs, cap)
    hashes = block_hashes(tokens, bs, SALT, HASHERS[hasher_index])
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    key_block = -1
    if users:  # the conversation key: the first user message's last block, at most 3 blocks
        # past the one its content starts in (the message's end only if within the cap)
        i = users[0]
        start = len(prompt_token_ids(msgs[:i])) - 3 + 3  # its frame starts where the
        # generation prompt would, and its content 3 template tokens later
        end = len(prompt_token_ids(msgs[: i + 1])) - 3
        last = start // bs + PLACEMENT_BLOCK
        if end <= cap:
            last = min(last, end // bs)
        key_block = last - 1
    if 0 <= key_block < len(hashes):
        key = hashes[key_block] & MASK64
    elif hashes:
        key = hashes[min(len(hashes), PLACEMENT_BLOCK) - 1] & MASK64
    else:
        key = hash((salt_key(SALT), tuple(tokens))) & MASK64
    return hashes, len(tokens), key


@settings(max_examples=300, deadline=None)
@given(
    conversations,
    st.sampled_from([1, 2, 4, 16]),
    st.integers(1, 40),
    st.integers(0, 1),
)
def test_a_lazy_query_settles_to_the_eager_hashes_count_and_key(
    msgs: list[dict[str, str]], bs: int, max_blocks: int, hasher_index: int
) -> None:
    hashes, n, key = eager(msgs, bs, max_blocks, hasher_index)
    q = make_query("t", msgs, SALT, bs, max_blocks=max_blocks, hasher=HASHERS[hasher_index])
    assert q.placement_key == key
    # before settling: what is known is a prefix of the chain and of the prompt
    assert list(q.known_hashes()) == hashes[: len(q.known_hashes())]
    assert q.known_prompt_tokens <= n
    assert q.block_hashes == tuple(hashes)
    assert q.prompt_tokens == n and q.settled
    for i in range(len(hashes) + 2):  # hash_at agrees block by block, None past the end
        assert q.hash_at(i) == (hashes[i] if i < len(hashes) else None)


@settings(max_examples=300, deadline=None)
@given(
    conversations,
    st.sampled_from([1, 4, 16]),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60), st.booleans()), max_size=6),
    st.integers(0, 1),
)
def test_match_query_equals_match_and_hashes_no_further_than_the_index_follows(
    msgs: list[dict[str, str]],
    bs: int,
    holdings: list[tuple[int, int, bool]],
    hasher_index: int,
) -> None:
    """Replicas hold leading runs of this chain (or of a foreign one); match_query gives
    match's answer, and hashes at most the placement key's blocks or twice the longest run
    + 1."""
    hasher = HASHERS[hasher_index]
    full = make_query("t", msgs, SALT, bs, hasher=hasher).block_hashes
    idx = PrefixIndex()
    for replica, length, foreign in holdings:
        chain = [h ^ 1 for h in full] if foreign else list(full)
        idx.record(f"r{replica}", chain[:length])
    rids = [f"r{i}" for i in range(4)]
    q = make_query("t", msgs, SALT, bs, hasher=hasher)
    got = idx.match_query(q, rids)
    assert got == idx.match(full, rids)
    longest = max(got.values())
    key_blocks = q.key_tokens // bs  # the conversation key's blocks are hashed to place it
    assert len(q.known_hashes()) <= max(PLACEMENT_BLOCK, key_blocks, 2 * (longest + 1))


def long_prompt(i: int, words: int = 3000) -> list[dict[str, str]]:
    # unique from its first block: what a herd of unrelated prompts looks like
    return [{"role": "user", "content": f"request {i} " + " ".join(f"w{k}" for k in range(words))}]


def test_a_prompt_nobody_holds_is_tokenized_and_hashed_only_for_its_placement() -> None:
    idx = PrefixIndex()
    idx.record("r0", make_query("t", long_prompt(0), SALT, 16).block_hashes)
    q = make_query("t", long_prompt(1), SALT, 16)
    assert idx.match_query(q, ["r0", "r1"]) == {"r0": 0, "r1": 0}
    assert len(q.known_hashes()) == PLACEMENT_BLOCK
    assert q.known_prompt_tokens == PLACEMENT_BLOCK * 16 + 1 and not q.settled
    assert q.prompt_tokens > 3000  # settling it tokenizes the rest


def test_a_prompt_under_one_block_hashes_nothing() -> None:
    q = make_query("t", [{"role": "user", "content": "hi"}], SALT, 16)
    assert q.settled and list(q.known_hashes()) == [] and q.known_prompt_tokens == 8
    idx = PrefixIndex()
    idx.record("r0", [1, 2, 3])
    assert idx.match_query(q, ["r0"]) == {"r0": 0}


def test_a_held_chain_is_followed_to_its_end() -> None:
    base = long_prompt(2, 600)
    held = make_query("t", base, SALT, 16).block_hashes
    idx = PrefixIndex()
    idx.record("r0", held)
    idx.record("r1", held[:5])
    longer = [*base, {"role": "user", "content": "and then"}]
    q = make_query("t", longer, SALT, 16)
    assert idx.match_query(q, ["r0", "r1", "r2"]) == {"r0": len(held), "r1": 5, "r2": 0}


def dispatched(prompt: int) -> tuple[Router, PrefixQuery, schema.ReplicaRecord]:
    """A cache-aware router over 2 replicas that has just chosen and dispatched a long
    prompt nobody held (request id "a")."""
    reg = Registry(2)
    reg.scrape(0.9, r0=0.1, r1=0.1)
    r = Router(reg, random.Random(3), config=AdmissionConfig(strategy="cache_aware"))
    q = make_query("t", long_prompt(prompt), SALT, 16)
    pick = r.choose(VERSION, "standard", 1000, prefix=q)
    assert pick is not None
    r.on_dispatch(pick, "a", 1000, prefix=q)
    return r, q, pick


def test_the_dispatch_is_recorded_whole_at_once() -> None:
    """A request routed right after (a burst sharing a system prompt) sees the whole hit,
    not just the leading blocks the choice hashed."""
    r, q, pick = dispatched(3)
    full = q.block_hashes
    assert q.settled and r.index.blocks_of(pick.replica_id) == len(full) > PLACEMENT_BLOCK
    assert r.index.match(full, [pick.replica_id]) == {pick.replica_id: len(full)}
    views = {v.replica_id: v for v in r.with_hits(r.views(VERSION), q)}
    assert views[pick.replica_id].queued_prefill_tokens == q.prompt_tokens
    assert views[pick.replica_id].cache_hit_tokens == len(full) * 16
    # the views choose builds with the query in hand are with_hits' views
    other = make_query("t", long_prompt(3)[:1] + [{"role": "user", "content": "more"}], SALT, 16)
    for query in (q, other, make_query("t", long_prompt(9), SALT, 16)):
        assert r.views(VERSION, query) == r.with_hits(r.views(VERSION), query)


def test_the_same_prompt_again_finds_the_whole_chain_and_its_queue_is_gone() -> None:
    r, q, pick = dispatched(4)
    r.on_first_token(pick, "a")
    again = make_query("t", long_prompt(4), SALT, 16)
    views = {v.replica_id: v for v in r.with_hits(r.views(VERSION), again)}
    assert views[pick.replica_id].queued_prefill_tokens == 0
    assert views[pick.replica_id].cache_hit_tokens == len(q.block_hashes) * 16
    second = r.choose(VERSION, "standard", 1000, prefix=again)
    assert second is not None and second.replica_id == pick.replica_id
