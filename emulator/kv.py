"""Paged KV-cache block pool with automatic prefix caching, after vLLM v1's ``BlockPool``.

* ``num_gpu_blocks`` blocks; block 0 is the reserved null block, so ``num_gpu_blocks - 1`` are
  usable and usage is ``1 - free/(num_gpu_blocks - 1)`` (vLLM's ``get_usage``).
* The free queue is LRU-ordered: allocation takes from the head, freeing appends to the tail.
  A request frees its blocks in reverse order, so its last blocks are evicted before its
  first ones (prefixes are the likeliest to be shared).
* A freed block keeps its hash and stays findable in the prefix cache until it is reused for
  another allocation (eviction). Cached blocks nobody references count as free.
* A full block's hash chains from the previous block's hash; the first block mixes in the
  cache salt (vLLM puts ``("cache_salt", salt)`` in the first block's extra keys), so two
  salts never share a chain.
* Duplicates are kept, as vLLM keeps them: when two requests compute the same block in one
  step, both blocks are registered under the hash; a lookup returns the earliest registered
  one still cached, and each copy is evicted (and reported removed) on its own.
* With ``enable_kv_cache_events`` the pool records ``BlockStored`` (the engine appends those,
  it knows the tokens), ``BlockRemoved`` when a cached block is evicted for reuse, and
  ``AllBlocksCleared`` on a prefix-cache reset; ``take_events()`` hands them over.

* Emulator-only, off by default (vLLM has no such knob): ``tenant_cache_share`` caps how
  much of the prefix cache one cache salt (a tenant) may keep. A block is owned by the salt
  of the request that cached it; when a salt already owns at least ``share x usable blocks``
  cached blocks and the next free block to reuse holds a cached block, its own least
  recently used idle cached block is reused instead — a tenant churning unique prompts
  recycles its own cache rather than evicting everyone else's.

Hash schemes (``get_hasher``; the replica's ``--prefix-caching-hash-algo``, the gateway's
``GATEWAY_PREFIX_HASH``): ``emulator``, the default, is CPython ``hash()`` of tuples of ints only
(no str, no None: those hash differently in every process), so a router in another process
computes the same chains. ``sha256`` and ``sha256_cbor`` are vLLM v1's construction: each
full block is SHA-256 of the serialisation (pickle at the highest protocol, or canonical
CBOR) of ``(parent hash, tuple of the block's token ids, extra keys)``; the first block's
parent is ``NONE_HASH`` = the same function applied to the ``PYTHONHASHSEED`` string (random
when unset: nobody outside the replica can then reproduce its hashes), and its extra keys are
``(cache_salt,)`` when the request has a salt, else None (None on every later block). A hash is
kept as the big-endian integer of its 32-byte digest; ``& MASK64`` of it is what vLLM publishes
in KV events with integer block hashes (the digest's last 8 bytes).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

NONE_HASH = 0x5EED_BA5E_0000_0001  # parent of the first block (vLLM: NONE_HASH)
CACHE_SALT_TAG = 0x5A17_0000_0000_0001  # stands for vLLM's ("cache_salt", salt) extra key


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None  # the first block's extra key, when it carries one


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


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
) -> None:
    """Append hashes of full blocks ``start_block..`` of ``token_ids`` to ``out``."""
    num_full = len(token_ids) // block_size
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
    ``token_ids`` to ``out`` (``parent``: the previous block's hash, 0 for none).

    Without ``serialize``, the emulator's chain hash. With it, vLLM v1's construction (see the
    module doc): ``serialize`` is pickle or canonical CBOR then SHA-256, ``seed`` the
    replicas' ``PYTHONHASHSEED`` (None: a random ``NONE_HASH``, as vLLM)."""

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
            self.none_hash = serialize(seed) if seed is not None else os.urandom(32)

    def first_extra(self, cache_salt: str | None) -> Hashable:
        if self._hash is None:
            return salt_key(cache_salt)
        return (cache_salt,) if cache_salt else None

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        start_block: int,
        parent: int,
        first_extra: Hashable,
        out: list[int],
    ) -> None:
        h = self._hash
        if h is None:
            chain_hashes(token_ids, block_size, start_block, parent, first_extra, out)  # type: ignore[arg-type]
            return
        digest = self.none_hash if start_block == 0 or not parent else parent.to_bytes(32, "big")
        for index in range(start_block, len(token_ids) // block_size):
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            digest = h((digest, tokens, first_extra if index == 0 else None))
            out.append(int.from_bytes(digest, "big"))


EMULATOR_HASHER = BlockHasher()


@lru_cache(maxsize=16)
def get_hasher(algo: str = "emulator", seed: str | None = None) -> BlockHasher:
    """The scheme named ``algo`` (``HASH_ALGOS``); ``seed`` only matters to vLLM's."""
    if algo == "emulator":
        return EMULATOR_HASHER
    if algo == "sha256":
        return BlockHasher(algo, _pickle_sha256, seed)
    if algo == "sha256_cbor":
        return BlockHasher(algo, _cbor_sha256, seed)
    raise ValueError(f"unknown prefix-caching hash algo {algo!r}; known: {HASH_ALGOS}")


class BlockPool:
    """Block bookkeeping only: which block is referenced, free, cached. No request logic."""

    __slots__ = (
        "num_gpu_blocks",
        "ref_cnt",
        "block_hash",
        "free",
        "cached",
        "duplicates",
        "enable_caching",
        "events",
        "share_cap",
        "owner",
        "owned",
        "idle_by_owner",
    )

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        tenant_cache_share: float = 0.0,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("need at least 2 KV blocks (one is the reserved null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        # OrderedDict as an O(1) LRU queue that also supports removal from the middle.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.cached: dict[int, int] = {}  # block hash -> first registered block id
        # Later copies of a hash, in registration order (rare: only same-step recomputes).
        self.duplicates: dict[int, list[int]] = {}
        self.events: list[KVEvent] | None = [] if enable_kv_cache_events else None
        if not 0.0 <= tenant_cache_share <= 1.0:
            raise ValueError("tenant_cache_share must be in [0, 1]")
        # Per-owner bookkeeping only when the share is on (the hot paths test one attribute).
        self.share_cap = max(1, int(tenant_cache_share * (num_gpu_blocks - 1)))
        self.owner: list[int | None] | None = None
        self.owned: dict[int, int] = {}
        self.idle_by_owner: dict[int, OrderedDict[int, None]] = {}
        if tenant_cache_share > 0 and enable_caching:
            self.owner = [None] * num_gpu_blocks

    @property
    def num_usable(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_gpu_blocks - 1 - len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / (self.num_gpu_blocks - 1)

    def allocate(self, count: int, owner: int | None = None) -> list[int]:
        """Take ``count`` blocks from the LRU head, evicting their cache entries (with a
        tenant share, an ``owner`` over it reuses its own idle cached blocks first)."""
        if count > len(self.free):
            raise RuntimeError(f"allocate({count}) with only {len(self.free)} free blocks")
        if self.owner is not None:
            return self._allocate_shared(count, owner)
        popitem = self.free.popitem
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        out: list[int] = []
        for _ in range(count):
            block, _unused = popitem(last=False)
            old = block_hash[block]
            if old is not None:
                self._evict(block, old)
                block_hash[block] = None
            ref_cnt[block] = 1
            out.append(block)
        return out

    def _allocate_shared(self, count: int, owner: int | None) -> list[int]:
        free = self.free
        block_hash = self.block_hash
        own = self.idle_by_owner.get(owner) if owner is not None else None
        out: list[int] = []
        for _ in range(count):
            block = next(iter(free))
            if (
                own and block_hash[block] is not None and self.owned.get(owner, 0) >= self.share_cap  # type: ignore[arg-type]
            ):
                block = next(iter(own))
            del free[block]
            old = block_hash[block]
            if old is not None:
                self._evict(block, old)
                block_hash[block] = None
                self._disown(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def _disown(self, block: int) -> None:
        assert self.owner is not None
        o = self.owner[block]
        if o is None:
            return
        self.owner[block] = None
        self.owned[o] -= 1
        idle = self.idle_by_owner.get(o)
        if idle is not None:
            idle.pop(block, None)

    def _evict(self, block: int, block_hash: int) -> None:
        copies = self.duplicates.get(block_hash)
        if self.cached.get(block_hash) == block:
            if copies:
                self.cached[block_hash] = copies.pop(0)
                if not copies:
                    del self.duplicates[block_hash]
            else:
                del self.cached[block_hash]
        elif copies is not None and block in copies:
            copies.remove(block)
            if not copies:
                del self.duplicates[block_hash]
        else:
            return
        if self.events is not None:
            self.events.append(BlockRemoved([block_hash]))

    def take_events(self) -> list[KVEvent]:
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry; refused (False) while any block is referenced."""
        if len(self.free) != self.num_gpu_blocks - 1:
            return False
        block_hash = self.block_hash
        for block in range(self.num_gpu_blocks):
            block_hash[block] = None
        self.cached.clear()
        self.duplicates.clear()
        if self.owner is not None:
            self.owner = [None] * self.num_gpu_blocks
            self.owned.clear()
            self.idle_by_owner.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (at most ``max_blocks``)."""
        if not self.enable_caching:
            return []
        hits: list[int] = []
        get = self.cached.get
        for index in range(min(max_blocks, len(hashes))):
            block = get(hashes[index])
            if block is None:
                break
            hits.append(block)
        return hits

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them consumes free blocks)."""
        ref_cnt = self.ref_cnt
        return sum(1 for b in blocks if ref_cnt[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Reference cache-hit blocks, pulling unreferenced ones out of the free queue."""
        ref_cnt = self.ref_cnt
        free = self.free
        owner = self.owner
        for block in blocks:
            if ref_cnt[block] == 0:
                del free[block]
                if owner is not None and owner[block] is not None:
                    self.idle_by_owner[owner[block]].pop(block, None)  # type: ignore[index]
            ref_cnt[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, in the order given (callers pass reversed)."""
        ref_cnt = self.ref_cnt
        free = self.free
        owner = self.owner
        for block in blocks:
            count = ref_cnt[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than referenced")
            ref_cnt[block] = count
            if count == 0:
                free[block] = None
                if owner is not None and (o := owner[block]) is not None:
                    self.idle_by_owner.setdefault(o, OrderedDict())[block] = None

    def cache_block(self, block: int, block_hash: int, owner: int | None = None) -> None:
        """Register a full block under its hash. Another block already registered under the
        hash stays the one lookups return; this one is kept as a further copy. ``owner``
        (the request's salt key) counts against its tenant share, when one is set."""
        if not self.enable_caching:
            return
        first = self.cached.get(block_hash)
        if first is None:
            self.cached[block_hash] = block
        elif first != block:
            self.duplicates.setdefault(block_hash, []).append(block)
        else:
            return
        self.block_hash[block] = block_hash
        if self.owner is not None and owner is not None:
            self.owner[block] = owner
            self.owned[owner] = self.owned.get(owner, 0) + 1

    def check_invariants(self) -> None:
        """Consistency checks for tests (O(num blocks))."""
        assert self.ref_cnt[0] == 0 and 0 not in self.free
        for block in range(1, self.num_gpu_blocks):
            count = self.ref_cnt[block]
            assert count >= 0, f"negative refcount on block {block}"
            assert (count == 0) == (block in self.free), f"free queue disagrees on block {block}"
        for block_hash, block in self.cached.items():
            assert self.block_hash[block] == block_hash
        for block_hash, copies in self.duplicates.items():
            assert copies and block_hash in self.cached
            for block in copies:
                assert self.block_hash[block] == block_hash
        if self.owner is not None:
            counts: dict[int, int] = {}
            for block, o in enumerate(self.owner):
                if o is not None:
                    assert self.block_hash[block] is not None, f"owned block {block} uncached"
                    counts[o] = counts.get(o, 0) + 1
            assert counts == {o: n for o, n in self.owned.items() if n}
            for o, idle in self.idle_by_owner.items():
                for block in idle:
                    assert self.owner[block] == o and self.ref_cnt[block] == 0
