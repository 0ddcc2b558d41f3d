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

Hashes are CPython ``hash()`` of tuples of ints, which is unsalted and stable across processes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

NONE_HASH = 0x5EED_BA5E_0000_0001  # parent of the first block (vLLM: NONE_HASH)


def salt_key(cache_salt: str | None) -> int:
    """The first block's extra key for a salt; unsalted requests share one chain."""
    if cache_salt is None:
        return NONE_HASH
    digest = hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=8).digest()
    return hash(("cache_salt", int.from_bytes(digest, "little")))


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
        parent = hash((parent, tokens, first_extra if index == 0 else None))
        out.append(parent)


class BlockPool:
    """Block bookkeeping only: which block is referenced, free, cached. No request logic."""

    __slots__ = ("num_gpu_blocks", "ref_cnt", "block_hash", "free", "cached", "enable_caching")

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("need at least 2 KV blocks (one is the reserved null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        # OrderedDict as an O(1) LRU queue that also supports removal from the middle.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

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

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the LRU head, evicting their cache entries."""
        if count > len(self.free):
            raise RuntimeError(f"allocate({count}) with only {len(self.free)} free blocks")
        popitem = self.free.popitem
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        out: list[int] = []
        for _ in range(count):
            block, _unused = popitem(last=False)
            old = block_hash[block]
            if old is not None:
                if self.cached.get(old) == block:
                    del self.cached[old]
                block_hash[block] = None
            ref_cnt[block] = 1
            out.append(block)
        return out

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
        for block in blocks:
            if ref_cnt[block] == 0:
                del free[block]
            ref_cnt[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, in the order given (callers pass reversed)."""
        ref_cnt = self.ref_cnt
        free = self.free
        for block in blocks:
            count = ref_cnt[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than referenced")
            ref_cnt[block] = count
            if count == 0:
                free[block] = None

    def cache_block(self, block: int, block_hash: int) -> None:
        """Register a computed full block. A duplicate hash keeps the first block cached."""
        if not self.enable_caching or block_hash in self.cached:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash

    def check_invariants(self) -> None:
        """Consistency checks for tests (O(num blocks))."""
        assert self.ref_cnt[0] == 0 and 0 not in self.free
        for block in range(1, self.num_gpu_blocks):
            count = self.ref_cnt[block]
            assert count >= 0, f"negative refcount on block {block}"
            assert (count == 0) == (block in self.free), f"free queue disagrees on block {block}"
        for block_hash, block in self.cached.items():
            assert self.block_hash[block] == block_hash
