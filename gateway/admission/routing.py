"""What routing sees of a replica (``ReplicaView``) and the building blocks of a choice
(docs/design.md R5): eligibility, power of two choices, the emptiest, and stable per-replica
keys for rendezvous hashing. The choice itself is ``gateway/admission/placement.py``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.admission.classes import pool_admits, replica_admits
from gateway.admission.config import AdmissionConfig, EffectiveClass


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows about one replica at decision time."""

    replica_id: str
    pool: str
    occupancy: float  # last scraped vllm:kv_cache_usage_perc, 0..1
    inflight_bytes: int  # KV this router dispatched since that scrape (optimistic)
    capacity_bytes: int
    # Long-context placement (gateway/admission/placement.py): the replica's position in the
    # version's long-context order (-1: not in it, e.g. the reserved pool), how many
    # replicas of that order long contexts may use, and whether it hosts any now.
    long_rank: int = -1
    long_designated: int = 0
    hosts_long: bool = False
    # Prefix-aware routing: prompt tokens of this request the replica is expected to hold
    # in its prefix cache already (0 = unknown / none), and the prompt tokens this process
    # dispatched there that have not produced a first token yet (its queued prefill work).
    cache_hit_tokens: int = 0
    # The occupancy the fleet's long-context ledger implies here (its KV in flight packed in
    # the designated order): what other gateway processes placed, which neither the scrape
    # (a long prefill arrives chunk by chunk) nor this process's in-flight record shows.
    long_floor: float = 0.0
    queued_prefill_tokens: int = 0
    # Long prefills in flight on the replica (long contexts dispatched there, no first token
    # yet) as the router knows them, and how many of them are very long: a long context
    # goes where a prefill slot of its tier is free (``placement.prefill_slot_free``).
    long_prefills: int = 0
    very_long_prefills: int = 0

    def load(self, optimistic: bool = True) -> float:
        if not optimistic or self.capacity_bytes <= 0:
            return self.occupancy
        return max(self.occupancy + self.inflight_bytes / self.capacity_bytes, self.long_floor)


def eligible(
    views: Iterable[ReplicaView],
    cls: EffectiveClass,
    cfg: AdmissionConfig,
    *,
    optimistic: bool = True,
) -> list[ReplicaView]:
    if not cfg.enforces("capacity"):  # comparison mode: any healthy replica, any class
        return list(views)
    return [
        v
        for v in views
        if pool_admits(cls, v.pool) and replica_admits(cls, v.load(optimistic), cfg)
    ]


def choose_p2c(
    cands: Sequence[ReplicaView], rng: random.Random, *, optimistic: bool = True
) -> ReplicaView | None:
    """Power of two random choices: the less loaded of two distinct random candidates."""
    if not cands:
        return None
    if len(cands) == 1:
        return cands[0]
    a, b = rng.sample(range(len(cands)), 2)
    ca, cb = cands[a], cands[b]
    return ca if ca.load(optimistic) <= cb.load(optimistic) else cb


def choose_emptiest(cands: Sequence[ReplicaView], *, optimistic: bool = True) -> ReplicaView | None:
    """The strategy docs/design.md R5 rejects (herds on stale data); kept for the herd benchmark."""
    return min(cands, key=lambda v: v.load(optimistic), default=None)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an int, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_ID_HASHES: dict[str, int] = {}


def replica_key(replica_id: str) -> int:
    """A stable 64-bit key per replica id (``hash(str)`` differs between processes)."""
    key = _ID_HASHES.get(replica_id)
    if key is None:
        digest = hashlib.blake2b(replica_id.encode("utf-8"), digest_size=8).digest()
        key = _ID_HASHES[replica_id] = int.from_bytes(digest, "little")
    return key


def rendezvous_order(key: int, cands: Sequence[ReplicaView]) -> list[ReplicaView]:
    """Highest-random-weight order of ``cands`` for ``key``: every gateway process computes
    the same order, and removing a replica moves only the keys it ranked first."""
    return sorted(cands, key=lambda v: _mix64(key ^ replica_key(v.replica_id)), reverse=True)


@dataclass(frozen=True, slots=True)
class PrefixTerms:
    """What cache-aware routing adds to a placement request (the per-replica hit is in
    ``ReplicaView.cache_hit_tokens``): where to place a prefix nobody holds yet, and the
    prefill rate that turns cached tokens into seconds saved."""

    placement_key: int  # same key, same replica (a conversation, a shared system prompt)
    tenant_key: int  # per-tenant rendezvous key for ``affinity_tenant_replicas``
    prefill_tokens_per_s: float = 0.0  # the version's; 0 = the config's default
    # the key is the client's own affinity hint (``prompt_cache_key``/``user``): a new prefix
    # follows it even before any replica holds part of the prompt
    hinted: bool = False
    # the prompt tokens through the block ``placement_key`` hashes when it is a conversation
    # key (``gateway.admission.prefix.conversation_block``), else 0: a replica holding that
    # many holds this conversation, one holding fewer only what it shares with others
    key_tokens: int = 0
    # with a conversation key: the key of what its prompt shares with its tenant's other
    # conversations (the system prompt's), whose rendezvous pair the conversation goes to
    shared_key: int = 0
    # the prompt goes on a conversation (an assistant turn precedes it): its earlier turns
    # are where its conversation key places it; a first turn goes to the better of two
    continues: bool = False
    # the replica this process sent the conversation's previous turn to ("" if it did not):
    # that replica holds the whole history, whichever process placed the turns before
    latest_replica: str = ""
