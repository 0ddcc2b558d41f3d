"""The block hashes and KV-event batches of ``contracts.blockhash``, the gateway's prefix index
and the emulator, against vectors computed by vLLM's own code (``tests/data/vllm_vectors.json``,
written by ``tests/gateway/vllm_vectors.py`` from a vLLM wheel: see its docstring to
regenerate). No wheel, vLLM or network is needed here: only the fixture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts.blockhash import get_hasher
from emulator.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from emulator.kv_events import encode_batch
from gateway.admission.prefix import (
    MASK64,
    PrefixIndex,
    block_hashes,
    decode_event_batch,
    event_hash,
    query_from_tokens,
)

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "vllm_vectors.json"
DATA: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
TOKENS: list[list[int]] = DATA["token_lists"]
VECTORS: list[dict[str, Any]] = DATA["vectors"]


def _id(v: dict[str, Any]) -> str:
    return f"{v['scheme']}-seed={v['seed']}-salt={v['salt']!r}-n={len(TOKENS[v['tokens']])}"


def test_the_fixture_is_vllm_0_33_0s_and_covers_the_cases() -> None:
    assert DATA["vllm_version"] == "0.33.0"
    assert len(DATA["wheel_sha256"]) == 64
    assert {v["scheme"] for v in VECTORS} == {"sha256", "sha256_cbor"}
    assert {v["seed"] for v in VECTORS} >= {None, "0"}
    assert {v["salt"] for v in VECTORS} >= {None, "", "tenant-a"}
    lengths = {len(TOKENS[v["tokens"]]) % v["block_size"] for v in VECTORS}
    assert 0 in lengths and len(lengths) > 1  # exact blocks and partial last blocks
    assert any(v["hashes"] == [] for v in VECTORS)  # under one block


@pytest.mark.parametrize("scheme", ["sha256", "sha256_cbor"])
def test_none_hash_is_vllms_for_every_seed(scheme: str) -> None:
    for row in DATA["none_hashes"]:
        if row["scheme"] == scheme:
            assert get_hasher(scheme, row["seed"]).none_hash.hex() == row["none_hash"], row


@pytest.mark.parametrize("vector", VECTORS, ids=_id)
def test_block_hashes_are_vllms(vector: dict[str, Any]) -> None:
    """vLLM hashes every full block of the request; the gateway's ``block_hashes`` leaves out
    a block ending at the prompt's last token (vLLM recomputes it), ``chain`` hashes all."""
    tokens = TOKENS[vector["tokens"]]
    size = vector["block_size"]
    hasher = get_hasher(vector["scheme"], vector["seed"])
    want = [int(h, 16) for h in vector["hashes"]]
    every: list[int] = []
    hasher.chain(tokens, size, 0, 0, hasher.first_extra(vector["salt"]), every)
    assert every == want
    usable = (len(tokens) - 1) // size
    assert block_hashes(tokens, size, vector["salt"], hasher) == want[:usable]
    if vector["salt"]:  # the gateway's query always has a salt (one per tenant)
        query = query_from_tokens("t", tokens, vector["salt"], size, hasher=hasher)
        assert list(query.block_hashes) == want[:usable]


def _hashes(items: list[Any]) -> list[int]:
    """Fixture hashes (ints, or ``{"hex": digest}``) as the index keys them."""
    return [event_hash(bytes.fromhex(h["hex"]) if isinstance(h, dict) else h) for h in items]


@pytest.mark.parametrize(
    "batch", DATA["event_batches"], ids=lambda b: f"ints={b['int_block_hashes']}"
)
def test_vllm_event_batches_decode_to_its_hashes(batch: dict[str, Any]) -> None:
    payload = bytes.fromhex(batch["payload"])
    ts, want_events, rank = batch["decoded"]
    assert rank == 0  # the publisher fills in its data-parallel rank
    events = decode_event_batch(payload)
    assert [e["type"] for e in events] == [e["type"] for e in want_events]
    assert [e["type"] for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    for got, want in zip(events, want_events, strict=True):
        if "block_hashes" in want:
            assert list(map(event_hash, got["block_hashes"])) == _hashes(want["block_hashes"])
        if want["type"] == "BlockStored":
            assert got["token_ids"] == want["token_ids"]
            assert (got["block_size"], got["medium"]) == (want["block_size"], "GPU")
            assert got["extra_keys"] == want["extra_keys"]
        if want["type"] == "BlockRemoved":
            assert got["medium"] == "GPU"
    # vLLM's default int form (64 bits) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, digests
    first = want_events[0]["block_hashes"][0]
    if batch["int_block_hashes"]:
        assert isinstance(first, int) and first <= MASK64
    else:
        assert len(bytes.fromhex(first["hex"])) == 32

    # the hashes are the gateway's own for that prompt (vLLM's default seed, a salt)
    tokens = TOKENS[batch["tokens"]]
    hasher = get_hasher(batch["scheme"], batch["seed"])
    query = query_from_tokens("t", tokens + [1], batch["salt"], 16, hasher=hasher)
    ours = [h & MASK64 for h in query.block_hashes]
    stored = _hashes(want_events[0]["block_hashes"]) + _hashes(want_events[1]["block_hashes"])
    assert stored == ours
    assert _hashes([want_events[1]["parent_block_hash"]]) == ours[1:2]
    index = PrefixIndex()
    index.apply_events("r0", events[:2])
    assert index.match(query.block_hashes, ["r0"]) == {"r0": 4}
    index.apply_events("r0", events[2:3])
    assert index.match(query.block_hashes, ["r0"]) == {"r0": 3}
    index.apply_events("r0", events[3:])
    assert index.match(query.block_hashes, ["r0"]) == {"r0": 0}


@pytest.mark.parametrize(
    "row", DATA["emulator_batches"], ids=lambda r: f"hash_bytes={r['hash_bytes']}"
)
def test_the_emulators_batches_are_what_vllm_decodes(row: dict[str, Any]) -> None:
    """The emulator's encoder, on the events of the vLLM batch above, gives the bytes the
    generator fed to vLLM's own decoder (msgspec, strict types); what vLLM decoded from them
    is the vLLM batch's content."""
    vllm_batch = next(
        b for b in DATA["event_batches"] if b["int_block_hashes"] is not row["hash_bytes"]
    )
    tokens = TOKENS[vllm_batch["tokens"]]
    salt = vllm_batch["salt"]
    hasher = get_hasher(vllm_batch["scheme"], vllm_batch["seed"])
    ours = block_hashes(tokens + [1], 16, salt, hasher)
    events: list[KVEvent] = [
        BlockStored(ours[0:2], None, tokens[0:32], 16, cache_salt=salt),
        BlockStored(ours[2:4], ours[1], tokens[32:64], 16),
        BlockRemoved([ours[3]]),
        AllBlocksCleared(),
    ]
    payload = encode_batch(1_700_000_000.25, events, hash_bytes=row["hash_bytes"])
    assert payload.hex() == row["payload"]
    assert row["decoded_by_vllm"] == vllm_batch["decoded"]
    # (not byte for byte vLLM's own, ``same_bytes_as_vllm``: msgspec writes a tagged event's
    # map header as map16 whatever its size, msgpack the shortest; decoders read both alike)
