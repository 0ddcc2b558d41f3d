"""Admission policy: the pure decisions, no I/O.

Everything here is a function of its arguments (randomness comes in as an explicit
``random.Random``), so the gateway, the Redis scripts' tests and the herd simulation in
``bench/herd.py`` all run the same rules. Design references: m01 §6 (the three quota
layers), §7 (classes and floors), R1 (measured TPOT), R2 (reserved ceiling and pool),
R5 (power of two choices with optimistic in-flight), R6 (jitter and retry budget).

Units: tokens are ints; KV·seconds are GiB·s as the control plane writes them, carried as
integer milli-GiB·s (``KV_MILLI``) wherever they are summed, so that Redis sums stay exact.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from gateway.schema import AdmissionClass

GIB = 1 << 30
KV_MILLI = 1000  # 1 GiB·s == 1000 milli-GiB·s
MINUTE_MS = 60_000

# The class a single request is admitted under. A reserved tenant above its own floor is
# routed as "standard": the floor is what it bought, the rest is shared like anyone's.
EffectiveClass = AdmissionClass
Strategy = Literal["p2c", "emptiest", "round_robin"]
Layer = Literal["requests", "tokens", "kv_seconds"]
# Layers that can be switched off for comparisons (the noisy-neighbour benchmark's
# "requests/min only" arm): the three quota layers, per-replica capacity, retry budget.
LAYERS = ("requests", "tokens", "kv_seconds", "capacity", "retry_budget")
ENV_PREFIX = "GATEWAY_ADMISSION_"

# vLLM's --scheduling-policy priority runs lower values first; the replica's scheduler
# must agree with the gateway about who matters most when it has to preempt.
VLLM_PRIORITY: dict[str, int] = {"reserved": 0, "standard": 1, "best_effort": 2}


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Every knob of admission in one value object (env/CLI mapping in gateway/README.md)."""

    # §7 / R2: per-replica KV occupancy ceilings by class.
    standard_max_occupancy: float = 0.85
    best_effort_max_occupancy: float = 0.60
    reserved_max_occupancy: float = 0.92
    # §7: reserved floors are sold against this share of the reserved pool (a written
    # capacity-planning decision, not a scheduler parameter).
    reserved_oversubscription: float = 0.6
    # Residence time that converts GiB·s floors into GiB of KV when sizing the pool:
    # the p95 output (1,200 tokens, §2) at the 40 ms TPOT target.
    pool_sizing_residence_s: float = 48.0
    # KV estimate: est_out = effective max_output, optionally capped (0 = no cap). The
    # default charges the full max_output: pessimistic, so the KV layer never over-admits
    # (§6 "charge max_tokens at admission"); the lease is released at the terminal event.
    est_out_cap: int = 0
    # R1.
    tpot_window_s: float = 30.0
    tpot_max_factor: float = 4.0
    tpot_stale_after_s: float = 60.0
    tpot_stale_factor: float = 2.0
    # R4 leases.
    lease_ttl_s: float = 15.0
    lease_renew_s: float = 5.0
    # R5 routing.
    strategy: Strategy = "p2c"
    optimistic_inflight: bool = True
    # A dispatch this close before a scrape may not be in the scraped figure yet.
    inflight_grace_s: float = 0.05
    # R6: retry budget over a sliding minute.
    retry_budget_ratio: float = 0.20
    retry_budget_min_admitted: int = 20
    retry_budget_window_s: float = 60.0
    storm_retry_after_s: tuple[float, float] = (30.0, 60.0)
    # R6: every retry-after is base + uniform jitter.
    quota_jitter_fraction: float = 0.5
    quota_jitter_min_ms: int = 500
    capacity_retry_base_ms: int = 5_000
    capacity_jitter_ms: int = 5_000
    # §8: with Redis down, KV·seconds fails closed to this share of each tenant's cap,
    # enforced in-process (per gateway process, hence a conservative fraction).
    local_kv_fraction: float = 0.25
    # Floors, not strict priority (§7): above its 0.60 ceiling, best-effort traffic may
    # still take this share of a gateway process's admissions (at least one request per
    # window) on replicas under the standard ceiling, so it is never starved to zero.
    best_effort_floor_share: float = 0.05
    best_effort_floor_window_s: float = 10.0
    # Early dispatch: the upstream request leaves while its quota answer is on the way when
    # this process's last answer for the tenant-model left at least this share of every
    # limit free (after the other early requests still awaiting theirs), was at most this
    # old, and fewer than ``early_dispatch_max_pending`` are awaiting theirs. The answer
    # stays authoritative: a refusal withdraws the upstream request within its round trip.
    early_dispatch: bool = True
    early_dispatch_margin: float = 0.25
    early_dispatch_max_age_s: float = 1.0
    early_dispatch_max_pending: int = 8
    # Which layers are enforced (all by default).
    layers: frozenset[str] = frozenset(LAYERS)

    def enforces(self, layer: str) -> bool:
        return layer in self.layers

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AdmissionConfig:
        """Every field from ``GATEWAY_ADMISSION_<FIELD>`` (upper case) when set: numbers as
        numbers, booleans as 1/0/true/false, ``STORM_RETRY_AFTER_S`` as ``low,high`` and
        ``LAYERS`` as a comma list. Raises ValueError naming the variable on bad input."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            raw = env.get(name, "").strip()
            if not raw:
                continue
            default = getattr(cls(), f.name)
            try:
                values[f.name] = _parse(f.name, raw, default)
            except ValueError as exc:
                raise ValueError(f"{name}={raw!r}: {exc}") from None
        try:
            return replace(cls(), **values)
        except ValueError as exc:
            raise ValueError(f"{ENV_PREFIX}*: {exc}") from None

    def __post_init__(self) -> None:
        for name in (
            "standard_max_occupancy",
            "best_effort_max_occupancy",
            "reserved_max_occupancy",
            "reserved_oversubscription",
            "retry_budget_ratio",
            "local_kv_fraction",
            "early_dispatch_margin",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not (
            self.best_effort_max_occupancy
            <= self.standard_max_occupancy
            <= self.reserved_max_occupancy
        ):
            raise ValueError("occupancy ceilings must satisfy best_effort <= standard <= reserved")
        if self.lease_renew_s * 2 >= self.lease_ttl_s:
            raise ValueError("lease_renew_s must be under half of lease_ttl_s")
        lo, hi = self.storm_retry_after_s
        if not 0 < lo <= hi:
            raise ValueError("storm_retry_after_s must be (low, high) with 0 < low <= high")
        if self.est_out_cap < 0 or self.tpot_max_factor < 1 or self.tpot_stale_factor < 1:
            raise ValueError("est_out_cap >= 0, tpot factors >= 1")
        if self.strategy not in get_args(Strategy):
            raise ValueError(f"strategy must be one of {get_args(Strategy)}")
        unknown = set(self.layers) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown layers {sorted(unknown)}; known: {', '.join(LAYERS)}")


def _parse(field_name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected a boolean")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, tuple):
        lo, hi = (float(x) for x in raw.split(","))
        return (lo, hi)
    if isinstance(default, frozenset):
        return frozenset(x.strip() for x in raw.split(",") if x.strip())
    return raw


# -- §6: the quota estimates -------------------------------------------------------------


def tokens_estimate(prompt_tokens: int, max_tokens: int | None, max_output: int) -> int:
    """Tokens/min charge at admission: prompt estimate + min(max_tokens, max_output)."""
    out = max_output if max_tokens is None else min(max_tokens, max_output)
    return max(0, prompt_tokens) + max(0, out)


def est_out_for_kv(max_output: int, cap: int = 0) -> int:
    """Output tokens assumed by the KV estimate: the effective max_output, capped if set."""
    return max(0, min(max_output, cap) if cap > 0 else max_output)


def tpot_estimate(
    measured_p95_s: float | None,
    age_s: float,
    target_s: float,
    *,
    max_factor: float = 4.0,
    stale_after_s: float = 60.0,
    stale_factor: float = 2.0,
) -> float:
    """R1: clamp(measured p95, target, 4 x target); stale or missing -> 2 x target.

    The floor keeps the estimate from ever being optimistic; the ceiling stops one stuck
    replica from freezing admission; the stale fallback is pessimistic on purpose.
    """
    if measured_p95_s is None or not math.isfinite(measured_p95_s) or age_s > stale_after_s:
        return stale_factor * target_s
    return min(max(measured_p95_s, target_s), max_factor * target_s)


def kv_gib_seconds(
    prompt_tokens: int, est_out: int, kv_bytes_per_token: int, tpot_s: float
) -> float:
    """est_kv = (prompt + est_out/2) x kv_bytes_per_token x est_out x tpot, in GiB·s."""
    residency_bytes = (prompt_tokens + est_out / 2) * kv_bytes_per_token
    return residency_bytes * est_out * tpot_s / GIB


def to_milli(gib_seconds: float) -> int:
    """GiB·s -> integer milli-GiB·s, rounded up (never under-charge)."""
    return max(0, math.ceil(gib_seconds * KV_MILLI))


def expected_duration_ms(est_out: int, tpot_s: float) -> int:
    """How long a request is expected to hold its lease: decode time at the estimated TPOT."""
    return max(1, math.ceil(est_out * tpot_s * 1000))


# -- §7 / R2: classes, floors and the reserved pool --------------------------------------


def effective_class(
    tenant_class: AdmissionClass, inflight_kv_milli: int, reserved_floor_milli: int
) -> EffectiveClass:
    """§7: a reserved tenant is served as reserved while its in-flight KV is under its floor.

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
    """R2: only floor traffic may enter the reserved pool, so its occupancy is controlled
    by construction rather than by hope."""
    return pool != "reserved" or cls == "reserved"


def reserved_pool_replicas_needed(
    floors_gib_s: Iterable[int], *, replica_kv_gib: float, cfg: AdmissionConfig
) -> int:
    """R2 sizing: sum of floors x over-subscription, as GiB of KV held (floors / residence
    time, Little's law), over what one replica may hold below the reserved ceiling."""
    total = sum(floors_gib_s)
    if total <= 0:
        return 0
    gib_needed = total * cfg.reserved_oversubscription / cfg.pool_sizing_residence_s
    return math.ceil(gib_needed / (replica_kv_gib * cfg.reserved_max_occupancy))


def check_reserved_floors(
    floors_gib_s: Sequence[int], *, pool_replicas: int, replica_kv_gib: float, cfg: AdmissionConfig
) -> str | None:
    """A human-readable problem if the configured pool cannot carry the sold floors."""
    need = reserved_pool_replicas_needed(floors_gib_s, replica_kv_gib=replica_kv_gib, cfg=cfg)
    if need > pool_replicas:
        return (
            f"reserved floors sum to {sum(floors_gib_s)} GiB·s; at over-subscription "
            f"{cfg.reserved_oversubscription} they need {need} reserved-pool replicas, "
            f"the catalog has {pool_replicas}"
        )
    return None


# -- R5: routing -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows about one replica at decision time."""

    replica_id: str
    pool: str
    occupancy: float  # last scraped vllm:kv_cache_usage_perc, 0..1
    inflight_bytes: int  # KV this router dispatched since that scrape (optimistic)
    capacity_bytes: int

    def load(self, optimistic: bool = True) -> float:
        if not optimistic or self.capacity_bytes <= 0:
            return self.occupancy
        return self.occupancy + self.inflight_bytes / self.capacity_bytes


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
    """The strategy R5 rejects (herds on stale data); kept for the herd benchmark."""
    return min(cands, key=lambda v: v.load(optimistic), default=None)


def choose_round_robin(cands: Sequence[ReplicaView], turn: int) -> ReplicaView | None:
    return cands[turn % len(cands)] if cands else None


def route(
    views: Sequence[ReplicaView],
    cls: EffectiveClass,
    cfg: AdmissionConfig,
    rng: random.Random,
    *,
    turn: int = 0,
) -> ReplicaView | None:
    """Pick a replica for one request, or None when no replica may take it (a 503).

    Floor traffic tries the reserved pool first, then shared replicas under 0.92 (R2:
    "try another"); everyone else only sees shared replicas under their class ceiling.
    """
    tiers: list[list[ReplicaView]]
    if cls == "reserved" and cfg.enforces("capacity"):
        tiers = [
            [v for v in views if v.pool == "reserved"],
            [v for v in views if v.pool != "reserved"],
        ]
    else:
        tiers = [list(views)]
    for tier in tiers:
        cands = eligible(tier, cls, cfg, optimistic=cfg.optimistic_inflight)
        if not cands:
            continue
        if cfg.strategy == "p2c":
            return choose_p2c(cands, rng, optimistic=cfg.optimistic_inflight)
        if cfg.strategy == "emptiest":
            return choose_emptiest(cands, optimistic=cfg.optimistic_inflight)
        return choose_round_robin(cands, turn)
    return None


# -- R6: jitter and the retry budget -----------------------------------------------------


def jittered_ms(base_ms: float, width_ms: float, rng: random.Random) -> int:
    """base + uniform[0, width]: no two clients are told the same instant."""
    return max(1, math.ceil(max(0.0, base_ms) + rng.uniform(0.0, max(0.0, width_ms))))


def quota_retry_after_ms(frees_in_ms: float, cfg: AdmissionConfig, rng: random.Random) -> int:
    """429: from when the limit frees, plus jitter proportional to the wait."""
    width = max(cfg.quota_jitter_min_ms, frees_in_ms * cfg.quota_jitter_fraction)
    return jittered_ms(frees_in_ms, width, rng)


def capacity_retry_after_ms(cfg: AdmissionConfig, rng: random.Random) -> int:
    """503 (fleet full): R6's base 5 s + uniform[0, 5 s] by default."""
    return jittered_ms(cfg.capacity_retry_base_ms, cfg.capacity_jitter_ms, rng)


def storm_retry_after_ms(cfg: AdmissionConfig, rng: random.Random) -> int:
    """503 for a shed retry during a retry storm: uniform in [30 s, 60 s] by default."""
    lo, hi = cfg.storm_retry_after_s
    return jittered_ms(lo * 1000, (hi - lo) * 1000, rng)


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    """``retry-after`` (whole seconds, rounded up) and OpenAI's ``retry-after-ms``."""
    return {
        "retry-after": str(max(1, math.ceil(retry_after_ms / 1000))),
        "retry-after-ms": str(retry_after_ms),
    }


def in_retry_storm(admitted: int, retries: int, cfg: AdmissionConfig) -> bool:
    """R6: retries above 20 % of admitted traffic over the last minute.

    A minimum volume keeps one retry on a quiet fleet from reading as a 100 % storm.
    (The Redis admit script implements the same rule; tests check them against each other.)
    """
    return admitted >= cfg.retry_budget_min_admitted and retries > cfg.retry_budget_ratio * admitted


def best_effort_floor_allows(admitted: int, floor_admitted: int, cfg: AdmissionConfig) -> bool:
    """May one more best-effort request go above its ceiling? Yes while such requests are
    under ``best_effort_floor_share`` of this window's admissions, and always for the first
    one of a window: the free tier's goodput stays above zero under sustained load."""
    return floor_admitted < max(1.0, cfg.best_effort_floor_share * admitted)


def sheds_retry(is_retry: bool, tenant_class: AdmissionClass, storm: bool) -> bool:
    """A first attempt is a user waiting, a retry is a client library; reserved is exempt."""
    return storm and is_retry and tenant_class != "reserved"


class WindowCounts:
    """(all, flagged) counts over a sliding window of ``slots`` buckets (in-process).

    The retry budget's window when Redis is unreachable (flagged = retries), and the
    best-effort floor's window (flagged = admitted above the best-effort ceiling).
    """

    def __init__(self, window_s: float = 60.0, slots: int = 6) -> None:
        self._width = window_s / slots
        self._slots = slots
        self._buckets: deque[tuple[int, int, int]] = deque()  # (index, all, flagged)

    def _trim(self, now_s: float) -> int:
        idx = int(now_s // self._width)
        while self._buckets and self._buckets[0][0] <= idx - self._slots:
            self._buckets.popleft()
        return idx

    def counts(self, now_s: float) -> tuple[int, int]:
        self._trim(now_s)
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def record(self, now_s: float, *, flagged: bool) -> None:
        idx = self._trim(now_s)
        if self._buckets and self._buckets[-1][0] == idx:
            _, a, r = self._buckets.pop()
        else:
            a, r = 0, 0
        self._buckets.append((idx, a + 1, r + int(flagged)))


# -- token buckets (the Lua scripts in gateway/limits.py implement the same arithmetic) --


def bucket_level(level: float | None, last_ms: int | None, now_ms: int, capacity: int) -> float:
    """A per-minute token bucket refilled continuously; an absent bucket is full."""
    if level is None or last_ms is None:
        return float(capacity)
    return min(float(capacity), level + max(0, now_ms - last_ms) * capacity / MINUTE_MS)


def bucket_reset_ms(level: float, capacity: int) -> int:
    """Time until the bucket is full again (OpenAI's ``x-ratelimit-reset-*``)."""
    if capacity <= 0:
        return 0
    return max(0, math.ceil((capacity - level) * MINUTE_MS / capacity))


class LocalBucket:
    """In-process token bucket: the header shadow while Redis is down (never enforcing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.level: float | None = None
        self.last_ms: int | None = None

    def take(self, amount: int, now_ms: int) -> float:
        level = bucket_level(self.level, self.last_ms, now_ms, self.capacity) - amount
        self.level, self.last_ms = level, now_ms
        return level

    def give(self, amount: int, now_ms: int) -> None:
        level = bucket_level(self.level, self.last_ms, now_ms, self.capacity)
        self.level, self.last_ms = min(float(self.capacity), level + amount), now_ms


# -- OpenAI's rate-limit headers ---------------------------------------------------------


def format_reset(ms: float) -> str:
    """A duration as OpenAI (Go's time.Duration) writes it: ``12ms``, ``1s``, ``6m0s``,
    ``1.5s``, ``1h2m3s``; under a second in whole milliseconds."""
    ms = max(0, math.ceil(ms))
    if ms < 1000:
        return f"{ms}ms"
    hours, rem = divmod(ms, 3_600_000)
    minutes, rem = divmod(rem, 60_000)
    seconds = f"{rem // 1000}.{rem % 1000:03d}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


@dataclass(frozen=True, slots=True)
class RateLimitState:
    limit_requests: int
    remaining_requests: int
    reset_requests_ms: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int

    def headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": str(self.limit_requests),
            "x-ratelimit-limit-tokens": str(self.limit_tokens),
            "x-ratelimit-remaining-requests": str(max(0, self.remaining_requests)),
            "x-ratelimit-remaining-tokens": str(max(0, self.remaining_tokens)),
            "x-ratelimit-reset-requests": format_reset(self.reset_requests_ms),
            "x-ratelimit-reset-tokens": format_reset(self.reset_tokens_ms),
        }


# -- early dispatch ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Headroom:
    """What one tenant-model had free after the last quota answer this process received."""

    at: float  # monotonic time of the answer
    requests: int  # requests left in the minute (ignored when the limit is 0: unlimited)
    tokens: int  # tokens left in the minute
    inflight_kv_milli: int  # the tenant's in-flight KV·seconds, that request included


@dataclass(slots=True)
class Undecided:
    """Early-dispatched requests of one tenant-model still awaiting their quota answer."""

    requests: int = 0
    tokens: int = 0
    kv_milli: int = 0


def early_dispatch_allowed(
    headroom: Headroom,
    undecided: Undecided,
    *,
    rpm: int,
    tpm: int,
    kv_cap_milli: int,
    est_tokens: int,
    est_kv_milli: int,
    now: float,
    cfg: AdmissionConfig,
) -> bool:
    """True when the quota answer is all but certain to be yes: every enforced limit keeps
    ``early_dispatch_margin`` of itself free after this request and the undecided ones, by
    an answer at most ``early_dispatch_max_age_s`` old. The margin is what other gateway
    processes may take meanwhile; if they take more, the answer is a refusal and the early
    request is withdrawn (a round trip of replica time wasted, never an overshoot: the
    quota ledger in Redis decides either way)."""
    if not cfg.early_dispatch or now - headroom.at > cfg.early_dispatch_max_age_s:
        return False
    if undecided.requests >= cfg.early_dispatch_max_pending:
        return False
    margin = cfg.early_dispatch_margin
    if rpm > 0 and headroom.requests - undecided.requests - 1 < margin * rpm:
        return False
    if tpm > 0 and headroom.tokens - undecided.tokens - est_tokens < margin * tpm:
        return False
    if kv_cap_milli > 0:
        free = kv_cap_milli - headroom.inflight_kv_milli - undecided.kv_milli - est_kv_milli
        if free < margin * kv_cap_milli:
            return False
    return True
