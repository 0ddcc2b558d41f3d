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

Hash schemes: ``contracts.blockhash`` (shared with the gateway, which must compute the
same chains; it does not import the emulator).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# The hash schemes live in contracts (the gateway computes the same chains); re-exported for
# the emulator's own modules and tests.
from contracts.blockhash import (
    CACHE_SALT_TAG,
    EMULATOR_HASHER,
    HASH_ALGOS,
    NONE_HASH,
    BlockHasher,
    HashAlgo,
    cbor_canonical,
    chain_hashes,
    get_hasher,
    salt_key,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CACHE_SALT_TAG",
    "EMULATOR_HASHER",
    "HASH_ALGOS",
    "HashAlgo",
    "KVEvent",
    "NONE_HASH",
    "cbor_canonical",
    "chain_hashes",
    "get_hasher",
    "salt_key",
]


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
