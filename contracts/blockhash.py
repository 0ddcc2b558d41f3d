"""Prefix-cache block hashes, as the replicas compute them and the gateway reproduces them.

A replica's prefix cache is keyed by chained hashes of full token blocks: block ``i``'s hash
covers its tokens and block ``i-1``'s hash, and the first block also mixes in the request's
cache salt (vLLM puts ``("cache_salt", salt)`` in the first block's extra keys), so two salts
never share a chain. The emulated replica (``emulator.kv``) and the gateway's cache-aware
router (``gateway.admission.prefix``) both import this module, so their chains cannot drift;
it lives in ``contracts`` because the gateway must not import the emulator (it stands in for
GPUs, and the gateway's production path fronts real vLLM replicas).

Hash schemes (``get_hasher``; the replica's ``--prefix-caching-hash-algo``, the gateway's
``GATEWAY_PREFIX_HASH``): ``emulator``, the default, is CPython ``hash()`` of tuples of ints only
(no str, no None: those hash differently in every process), so a router in another process
computes the same chains. ``sha256`` and ``sha256_cbor`` are vLLM v1's construction: each
full block is SHA-256 of the serialisation (pickle at the highest protocol, or canonical
CBOR) of ``(parent hash, tuple of the block's token ids, extra keys)``; the first block's
parent is ``NONE_HASH`` = the same function applied to the ``PYTHONHASHSEED`` string, or to
``"vllm-none-hash"`` when that is unset (vLLM >= 0.33 for these two schemes), and its extra
keys are ``(("cache_salt", salt),)`` when the request has a non-empty salt, else None (None on
every later block). A hash is kept as the big-endian integer of its 32-byte digest; ``& MASK64``
of it is what vLLM publishes in KV events (integer block hashes, its default: the digest's
last 8 bytes). Checked against vectors computed by vLLM 0.33.0's own functions
(``tests/data/vllm_vectors.json``, ``tests/gateway/test_vllm_vectors.py``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache
from typing import Literal, get_args

NONE_HASH = 0x5EED_BA5E_0000_0001  # parent of the first block (vLLM: NONE_HASH)
# vLLM's NONE_HASH seed for sha256 / sha256_cbor when PYTHONHASHSEED is unset
# (kv_cache_utils.DEFAULT_NONE_HASH_SEED)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
CACHE_SALT_TAG = 0x5A17_0000_0000_0001  # stands for vLLM's ("cache_salt", salt) extra key


def salt_key(cache_salt: str | None) -> int:
    """The first block's extra key for a salt; unsalted requests share one chain."""
    if cache_salt is None:
        return NONE_HASH
    digest = hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=8).digest()
    # ints only: hash() of a str is salted per process (PYTHONHASHSEED), and a router
    # outside the replica must compute the same chain
    return hash((CACHE_SALT_TAG, int.from_bytes(digest, "little")))


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    start_block: int,
    parent: int,
    first_extra: int,
    out: list[int],
    end_block: int | None = None,
) -> None:
    """Append hashes of full blocks ``start_block..`` of ``token_ids`` to ``out`` (up to
    ``end_block``, excluded, when given: no need to slice a long prompt)."""
    num_full = len(token_ids) // block_size if end_block is None else end_block
    for index in range(start_block, num_full):
        tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
        # 0, not None, for "no extra key": before Python 3.12 hash(None) is the object's
        # address, which differs between processes
        parent = hash((parent, tokens, first_extra if index == 0 else 0))
        out.append(parent)


HashAlgo = Literal["emulator", "sha256", "sha256_cbor"]
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)


def cbor_canonical(obj: object) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1, as ``cbor2.dumps(obj, canonical=True)``) of what a
    block hash serialises: unsigned and negative 64-bit ints, bytes, str, None, booleans,
    and tuples or lists of them (arrays)."""
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out.append(major << 5 | 25)
        out += n.to_bytes(2, "big")
    elif n < 1 << 32:
        out.append(major << 5 | 26)
        out += n.to_bytes(4, "big")
    elif n < 1 << 64:
        out.append(major << 5 | 27)
        out += n.to_bytes(8, "big")
    else:
        raise ValueError("CBOR: integer beyond 64 bits")


_CBOR_UINTS: dict[int, bytes] = {}  # token ids recur: their encodings are kept (< 2**20)


def _cbor_uint(n: int) -> bytes:
    enc = _CBOR_UINTS.get(n)
    if enc is None:
        buf = bytearray()
        _cbor_head(0, n, buf)
        enc = bytes(buf)
        if n < 1 << 20:
            _CBOR_UINTS[n] = enc
    return enc


def _cbor(obj: object, out: bytearray) -> None:
    if type(obj) is int and obj >= 0:
        out += _cbor_uint(obj)
    elif obj is None:
        out.append(0xF6)
    elif obj is True or obj is False:
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            _cbor_head(0, obj, out)
        else:
            _cbor_head(1, -1 - obj, out)
    elif isinstance(obj, bytes):
        _cbor_head(2, len(obj), out)
        out += obj
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _cbor_head(3, len(raw), out)
        out += raw
    elif isinstance(obj, tuple | list):
        _cbor_head(4, len(obj), out)
        for item in obj:
            _cbor(item, out)
    else:
        raise TypeError(f"CBOR: cannot encode {type(obj).__name__}")


def _pickle_sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_sha256(obj: object) -> bytes:
    return hashlib.sha256(cbor_canonical(obj)).digest()


class BlockHasher:
    """One prefix-cache hash scheme: ``first_extra(salt)`` is the first block's extra key for
    a request's cache salt, ``chain`` appends the hashes of full blocks ``start_block..`` of
    ``token_ids`` to ``out`` (``parent``: the previous block's hash, 0 for none; up to
    ``end_block``, excluded, when given, which must be a full block of ``token_ids``).

    Without ``serialize``, the emulator's chain hash. With it, vLLM v1's construction (see the
    module doc): ``serialize`` is pickle or canonical CBOR then SHA-256, ``seed`` the
    replicas' ``PYTHONHASHSEED`` (None: unset, vLLM's ``DEFAULT_NONE_HASH_SEED``)."""

    def __init__(
        self,
        name: str = "emulator",
        serialize: Callable[[object], bytes] | None = None,
        seed: str | None = None,
    ) -> None:
        self.name = name
        self._hash = serialize
        self.none_hash = b""
        if serialize is not None:
            self.none_hash = serialize(DEFAULT_NONE_HASH_SEED if seed is None else seed)

    def first_extra(self, cache_salt: str | None) -> Hashable:
        if self._hash is None:
            return salt_key(cache_salt)
        # vLLM's generate_block_hash_extra_keys: the salt tagged with its source
        return (("cache_salt", cache_salt),) if cache_salt else None

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        start_block: int,
        parent: int,
        first_extra: Hashable,
        out: list[int],
        end_block: int | None = None,
    ) -> None:
        h = self._hash
        if h is None:
            chain_hashes(token_ids, block_size, start_block, parent, first_extra, out, end_block)  # type: ignore[arg-type]
            return
        digest = self.none_hash if start_block == 0 or not parent else parent.to_bytes(32, "big")
        end = len(token_ids) // block_size if end_block is None else end_block
        for index in range(start_block, end):
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            digest = h((digest, tokens, first_extra if index == 0 else None))
            out.append(int.from_bytes(digest, "big"))


EMULATOR_HASHER = BlockHasher()


@lru_cache(maxsize=16)
def get_hasher(algo: str = "emulator", seed: str | None = None) -> BlockHasher:
    """The scheme named ``algo`` (``HASH_ALGOS``); ``seed`` (the replicas' ``PYTHONHASHSEED``,
    None when unset) only matters to vLLM's."""
    if algo == "emulator":
        return EMULATOR_HASHER
    if algo == "sha256":
        return BlockHasher(algo, _pickle_sha256, seed)
    if algo == "sha256_cbor":
        return BlockHasher(algo, _cbor_sha256, seed)
    raise ValueError(f"unknown prefix-caching hash algo {algo!r}; known: {HASH_ALGOS}")
