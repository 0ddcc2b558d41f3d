"""Sizing formulas both sides compute: the control plane when it sizes plans and checks the
reserved floors it sells, the gateway when it admits a request. One definition, so the
numbers the control plane promises are the numbers the gateway enforces.

KV·seconds (GiB·s) is the KV cache a request is expected to hold, integrated over its decode
time: the cache grows from ``prompt`` to ``prompt + output`` tokens while ``output`` tokens
are produced one per TPOT, so on average it holds ``prompt + output/2`` tokens for
``output x TPOT`` seconds (docs/design.md §6).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

GIB = 1 << 30


def kv_gib_seconds(
    prompt_tokens: int, est_out: int, kv_bytes_per_token: int, tpot_s: float
) -> float:
    """est_kv = (prompt + est_out/2) x kv_bytes_per_token x est_out x tpot, in GiB·s."""
    residency_bytes = (prompt_tokens + est_out / 2) * kv_bytes_per_token
    return residency_bytes * est_out * tpot_s / GIB


def kv_gib_seconds_ceil(*, prompt: int, output: int, kv_bytes_per_token: int, tpot_ms: int) -> int:
    """The same formula in exact integers, rounded up: what plan limits are sized with.
    Numerator and denominator are both doubled so that output/2 stays exact."""
    numerator = (2 * prompt + output) * kv_bytes_per_token * output * tpot_ms
    denominator = 2 * 1000 * GIB
    return -(-numerator // denominator)


# Reserved floors (docs/design.md §7): the reserved pool is sized for the sum of the sold
# floors at a planned over-subscription, converted from GiB·s into GiB of KV held by the
# residence time (the p95 output, 1,200 tokens, at the 40 ms TPOT target), over what one
# replica may hold below the reserved class's occupancy ceiling.
RESERVED_OVERSUBSCRIPTION = 0.6
POOL_SIZING_RESIDENCE_S = 48.0
RESERVED_MAX_OCCUPANCY = 0.92


@dataclass(frozen=True, slots=True)
class ReservedPoolSizing:
    oversubscription: float = RESERVED_OVERSUBSCRIPTION
    residence_s: float = POOL_SIZING_RESIDENCE_S
    max_occupancy: float = RESERVED_MAX_OCCUPANCY


def reserved_pool_replicas_needed(
    floors_gib_s: Iterable[int], *, replica_kv_gib: float, sizing: ReservedPoolSizing
) -> int:
    """Sum of floors x over-subscription, as GiB of KV held (floors / residence time,
    Little's law), over what one replica may hold below the reserved ceiling."""
    total = sum(floors_gib_s)
    if total <= 0:
        return 0
    gib_needed = total * sizing.oversubscription / sizing.residence_s
    return math.ceil(gib_needed / (replica_kv_gib * sizing.max_occupancy))


def check_reserved_floors(
    floors_gib_s: Sequence[int],
    *,
    pool_replicas: int,
    replica_kv_gib: float,
    sizing: ReservedPoolSizing,
) -> str | None:
    """A human-readable problem if the configured pool cannot carry the sold floors."""
    need = reserved_pool_replicas_needed(floors_gib_s, replica_kv_gib=replica_kv_gib, sizing=sizing)
    if need > pool_replicas:
        return (
            f"reserved floors sum to {sum(floors_gib_s)} GiB·s; at over-subscription "
            f"{sizing.oversubscription} they need {need} reserved-pool replicas, "
            f"the catalog has {pool_replicas}"
        )
    return None
