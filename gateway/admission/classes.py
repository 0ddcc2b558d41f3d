"""Plan classes, their per-replica KV occupancy ceilings, the reserved floor and pool
(docs/design.md §7 and R2), and the best-effort floor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from contracts import formulas
from contracts.schema import AdmissionClass
from gateway.admission.config import AdmissionConfig, EffectiveClass


def effective_class(
    tenant_class: AdmissionClass, inflight_kv_milli: int, reserved_floor_milli: int
) -> EffectiveClass:
    """docs/design.md §7: a reserved tenant is served as reserved while its in-flight KV is
    under its floor.

    Above the floor the same request competes as standard traffic (shared pool, 0.85).
    """
    if tenant_class == "reserved":
        if reserved_floor_milli > 0 and inflight_kv_milli < reserved_floor_milli:
            return "reserved"
        return "standard"
    return tenant_class


def occupancy_ceiling(cls: EffectiveClass, cfg: AdmissionConfig) -> float:
    if cls == "reserved":
        return cfg.reserved_max_occupancy
    if cls == "standard":
        return cfg.standard_max_occupancy
    return cfg.best_effort_max_occupancy


def replica_admits(cls: EffectiveClass, load: float, cfg: AdmissionConfig) -> bool:
    """Admit below the class's ceiling; reserved is never sent into a replica above 0.92."""
    ceiling = occupancy_ceiling(cls, cfg)
    return load <= ceiling if cls == "reserved" else load < ceiling


def pool_admits(cls: EffectiveClass, pool: str) -> bool:
    """docs/design.md R2: only floor traffic may enter the reserved pool, so its occupancy is
    controlled by construction rather than by hope."""
    return pool != "reserved" or cls == "reserved"


def reserved_sizing(cfg: AdmissionConfig) -> formulas.ReservedPoolSizing:
    """The reserved-pool sizing knobs of ``cfg`` (the formula is in contracts/formulas.py)."""
    return formulas.ReservedPoolSizing(
        oversubscription=cfg.reserved_oversubscription,
        residence_s=cfg.pool_sizing_residence_s,
        max_occupancy=cfg.reserved_max_occupancy,
    )


def reserved_pool_replicas_needed(
    floors_gib_s: Iterable[int], *, replica_kv_gib: float, cfg: AdmissionConfig
) -> int:
    return formulas.reserved_pool_replicas_needed(
        floors_gib_s, replica_kv_gib=replica_kv_gib, sizing=reserved_sizing(cfg)
    )


def check_reserved_floors(
    floors_gib_s: Sequence[int], *, pool_replicas: int, replica_kv_gib: float, cfg: AdmissionConfig
) -> str | None:
    return formulas.check_reserved_floors(
        floors_gib_s,
        pool_replicas=pool_replicas,
        replica_kv_gib=replica_kv_gib,
        sizing=reserved_sizing(cfg),
    )


def best_effort_floor_allows(admitted: int, floor_admitted: int, cfg: AdmissionConfig) -> bool:
    """May one more best-effort request go above its ceiling? Yes while such requests are
    under ``best_effort_floor_share`` of this window's admissions, and always for the first
    one of a window: the free tier's goodput stays above zero under sustained load."""
    return floor_admitted < max(1.0, cfg.best_effort_floor_share * admitted)
