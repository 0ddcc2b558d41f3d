"""The selectable prefix-cache block hash (``contracts.blockhash.get_hasher``), used alike by the
emulated replica and the gateway: vLLM v1's ``sha256`` and ``sha256_cbor`` pinned by vectors
computed here, independently, from the construction (SHA-256 over pickle or canonical CBOR of
``(parent, tuple of token ids, extra keys)``, the first parent ``NONE_HASH`` = the function of
the ``PYTHONHASHSEED`` string, the salt the first block's only extra key), the salt isolating
tenants, the chaining, and the digests in KV events keying the index as vLLM's int form
does. Vectors computed by vLLM's own code: ``test_vllm_vectors.py``."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from contracts.blockhash import BlockHasher, cbor_canonical, get_hasher
from emulator.engine import Engine, EngineConfig
from emulator.kv import BlockStored
from emulator.kv_events import encode_batch
from emulator.profiles import get_profile
from gateway.admission.prefix import (
    MASK64,
    PrefixIndex,
    block_hashes,
    decode_event_batch,
    query_from_tokens,
)
from gateway.config import ConfigError, GatewayConfig

SEED = "4242"  # the replicas' PYTHONHASHSEED
SALT = "s" * 64


def pickled(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def as_int(digest: bytes) -> int:
    return int.from_bytes(digest, "big")


def test_sha256_is_vllms_pickle_construction() -> None:
    tokens = list(range(1000, 1000 + 40))  # two full blocks of 16, and 8 tokens over
    none = pickled(SEED)
    b0 = pickled((none, tuple(tokens[:16]), (("cache_salt", SALT),)))
    b1 = pickled((b0, tuple(tokens[16:32]), None))
    hasher = get_hasher("sha256", SEED)
    assert block_hashes(tokens, 16, SALT, hasher) == [as_int(b0), as_int(b1)]
    # unsalted: no extra keys at all (None), not an empty tuple
    plain = pickled((none, tuple(tokens[:16]), None))
    assert block_hashes(tokens[:17], 16, None, hasher) == [as_int(plain)]
    assert block_hashes(tokens[:17], 16, "", hasher) == [as_int(plain)]  # vLLM: `if salt`


def test_sha256_cbor_is_vllms_canonical_cbor_construction() -> None:
    # RFC 8949 Appendix A examples for the types a block hash serialises
    for value, hex_ in [
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1_000_000, "1a000f4240"),
        (1_000_000_000_000, "1b000000e8d4a51000"),
        (-1, "20"),
        (-1000, "3903e7"),
        ("", "60"),
        ("a", "6161"),
        (b"", "40"),
        ((1, 2, 3), "83010203"),
        ([1, [2, 3], [4, 5]], "8301820203820405"),
        (None, "f6"),
        (True, "f5"),
    ]:
        assert cbor_canonical(value).hex() == hex_, value
    # a block written out byte by byte: [parent bstr(32), [tokens], [["cache_salt", salt]]]
    none = hashlib.sha256(bytes([0x60 + len(SEED)]) + SEED.encode()).digest()
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 100_000] * 2
    eight = ["00", "17", "1818", "18ff", "190100", "19ffff", "1a00010000", "1a000186a0"]
    enc_tokens = bytes.fromhex("90" + "".join(eight))
    enc_tokens = enc_tokens + enc_tokens[1:]  # the same eight again, one array of 16
    salt = bytes([0x78, len(SALT)]) + SALT.encode()  # text of 64 bytes: 0x78, length
    first = b"\x83" + b"\x58\x20" + none + enc_tokens + b"\x81\x82\x6acache_salt" + salt
    b0 = hashlib.sha256(first).digest()
    hasher = get_hasher("sha256_cbor", SEED)
    assert block_hashes(tokens + [1], 16, SALT, hasher) == [as_int(b0)]
    second = b"\x83" + b"\x58\x20" + b0 + enc_tokens + b"\xf6"
    assert block_hashes(tokens * 2 + [1], 16, SALT, hasher)[1] == as_int(
        hashlib.sha256(second).digest()
    )


@pytest.mark.parametrize("algo", ["emulator", "sha256", "sha256_cbor"])
def test_salt_isolates_tenants_and_the_chain_carries_every_earlier_block(algo: str) -> None:
    hasher = get_hasher(algo, SEED)
    tokens = list(range(7, 7 + 16 * 6 + 1))
    a = block_hashes(tokens, 16, "tenant-a", hasher)
    b = block_hashes(tokens, 16, "tenant-b", hasher)
    none = block_hashes(tokens, 16, None, hasher)
    assert len(a) == 6 and not set(a) & set(b) and not set(a) & set(none)
    assert not {h & MASK64 for h in a} & {h & MASK64 for h in b}  # as the index keys them
    changed = tokens.copy()
    changed[16 * 3 + 5] += 1  # a token of block 3
    c = block_hashes(changed, 16, "tenant-a", hasher)
    assert c[:3] == a[:3] and not set(c[3:]) & set(a[3:])
    # chaining on from a parent gives the same hashes as hashing from the start
    tail: list[int] = []
    hasher.chain(tokens[: 16 * 6], 16, 2, a[1], hasher.first_extra("tenant-a"), tail)
    assert tail == a[2:]


def test_the_seed_decides_the_first_parent() -> None:
    tokens = list(range(33))
    h1 = block_hashes(tokens, 16, SALT, get_hasher("sha256", "1"))
    h2 = block_hashes(tokens, 16, SALT, get_hasher("sha256", "2"))
    assert not set(h1) & set(h2)
    # vLLM (>= 0.33) without PYTHONHASHSEED: NONE_HASH from a fixed seed for these schemes,
    # so replicas agree with each other and with the gateway
    r1, r2 = BlockHasher("sha256", pickled, None), BlockHasher("sha256", pickled, None)
    assert r1.none_hash == pickled("vllm-none-hash") == get_hasher("sha256").none_hash
    assert block_hashes(tokens, 16, SALT, r1) == block_hashes(tokens, 16, SALT, r2)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_the_replica_and_the_gateway_agree_and_events_key_the_index(algo: str) -> None:
    """The emulated replica with vLLM's scheme: its blocks are the gateway's hashes, its
    prefix cache still hits, and its KV events (32-byte digests, vLLM's default) key the
    index exactly where the gateway's query looks (and as vLLM's int form would)."""
    cfg = EngineConfig(
        prefix_caching_hash_algo=algo, prefix_hash_seed=SEED, enable_kv_cache_events=True
    )
    engine = Engine(get_profile("llama-8b-tp1-h100"), cfg)
    tokens = list(range(500, 500 + 16 * 5 + 3))
    req = engine.add_request("a", tokens, 2, cache_salt=SALT)
    query = query_from_tokens("t", tokens, SALT, 16, hasher=get_hasher(algo, SEED))
    assert list(query.block_hashes) == req.block_hashes[:5]
    while engine.has_work():
        engine.step()
    again = engine.add_request("b", tokens, 2, cache_salt=SALT)
    while engine.has_work():
        engine.step()
    assert again.num_cached_tokens == 16 * 5
    events = engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    payload = encode_batch(0.0, stored, hash_bytes=True)
    decoded = decode_event_batch(payload)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in decoded[0]["block_hashes"])
    idx = PrefixIndex()
    idx.apply_events("r0", decoded)
    assert idx.match(query.block_hashes, ["r0"]) == {"r0": 5}
    # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES form: the digest's big-endian value's low
    # 64 bits, the same keys
    ints = [int.from_bytes(h, "big") & MASK64 for h in decoded[0]["block_hashes"]]
    other = PrefixIndex()
    other.apply_events("r0", [{"type": "BlockStored", "block_hashes": ints}])
    assert other.match(query.block_hashes, ["r0"]) == {"r0": 5}


def test_gateway_config_selects_the_scheme() -> None:
    assert GatewayConfig.from_env({}).prefix_hash == "emulator"
    cfg = GatewayConfig.from_env(
        {"GATEWAY_PREFIX_HASH": "sha256_cbor", "GATEWAY_PREFIX_HASH_SEED": SEED}
    )
    assert (cfg.prefix_hash, cfg.prefix_hash_seed) == ("sha256_cbor", SEED)
    # no seed: the replicas run without PYTHONHASHSEED, vLLM's fixed default seed
    unseeded = GatewayConfig.from_env({"GATEWAY_PREFIX_HASH": "sha256"})
    assert (unseeded.prefix_hash, unseeded.prefix_hash_seed) == ("sha256", None)
    with pytest.raises(ConfigError, match="GATEWAY_PREFIX_HASH"):
        GatewayConfig.from_env({"GATEWAY_PREFIX_HASH": "md5", "GATEWAY_PREFIX_HASH_SEED": "1"})
    with pytest.raises(ValueError):
        get_hasher("xxhash")


@pytest.mark.parametrize("seed", ["-1", "4294967296", "0x10", "abc", " 1", "١"])
def test_a_hash_seed_the_replicas_python_would_refuse_stops_the_gateway(seed: str) -> None:
    with pytest.raises(ConfigError, match="GATEWAY_PREFIX_HASH_SEED"):
        GatewayConfig.from_env({"GATEWAY_PREFIX_HASH": "sha256", "GATEWAY_PREFIX_HASH_SEED": seed})
    for ok in ("0", "4294967295", "random"):
        cfg = GatewayConfig.from_env(
            {"GATEWAY_PREFIX_HASH": "sha256", "GATEWAY_PREFIX_HASH_SEED": ok}
        )
        assert cfg.prefix_hash_seed == ok
