"""Admission: the one stage between validation and the upstream call.

Quota first (the edge, §5 decision 1; 429, the customer can fix it), then capacity (the
router; 503, they cannot) — never mixed up (§3):

1. One atomic Redis round trip (``gateway.limits``): requests/min, tokens/min charged on
   the estimate, concurrent KV·seconds as a lease, the retry budget (R6). Refused → 429
   ``rate_limit_exceeded`` whose ``type`` names the layer (``requests`` | ``tokens`` |
   ``kv_seconds``, as OpenAI's own 429 bodies name ``requests`` / ``tokens``), with
   ``retry-after`` / ``retry-after-ms`` from when that limit frees, jittered; a retry shed
   during a storm → 503 ``retry_budget_exhausted`` with 30–60 s.
2. The effective class (§7): a reserved tenant under its own floor is ``reserved`` (reserved
   pool first, then any replica up to 0.92); above it, ``standard``.
3. The router picks a replica under the class's occupancy ceiling (P2C + optimistic
   in-flight, R5); none → 503 ``capacity`` (the quota charge is refunded in full).
   Floors, not strict priority: past its 0.60 ceiling, best-effort traffic still gets a
   small share of admissions (``best_effort_floor_share``) so the free tier never starves.
4. The class goes to vLLM as ``priority`` so the replica's scheduler agrees with us.

Early dispatch: the quota round trip is the largest wait the gateway adds before the
upstream call, and for a tenant well inside its limits its answer is known in advance.
``early_route`` picks the replica from this process's last answer for the tenant-model
(``policy.early_dispatch_allowed``: every limit keeps a margin free, the answer is recent,
few requests are awaiting theirs), so the caller can send the upstream request at once
and ``admit`` then waits for the quota answer as before. The answer stays authoritative:
a refusal (429/503) withdraws the early request, whose replica aborts it and frees its KV;
an answer that changes the class (a reserved tenant crossing its floor) routes again.

``est_kv`` uses R1's ``tpot_est = clamp(fleet p95 TPOT over 30 s, target, 4 x target)``, or
2 x target when the measurement is older than 60 s. Every admitted request holds a lease
that this process renews every ``lease_renew_s`` in one pipelined call (R4); ``settle`` is
the single release for every ending, refunds the unused token estimate at once and bills
the actual. A request that failed before producing anything (error or timeout with no
completion tokens) is refunded entirely, its request included.

``is_retry`` comes from the gateway (R6's identity of retries): a request whose
``Idempotency-Key`` was seen before (an earlier attempt that failed), or one the official
openai SDK marks as its automatic retry (``x-stainless-retry-count`` > 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis

from gateway import schema
from gateway.config import GatewayConfig
from gateway.errors import ApiError, RateLimited, Unavailable
from gateway.limits import Grant, Limiter, QuotaDecision, QuotaRequest, connect
from gateway.metrics import GatewayMetrics
from gateway.policy import (
    KV_MILLI,
    VLLM_PRIORITY,
    AdmissionConfig,
    EffectiveClass,
    Headroom,
    Undecided,
    WindowCounts,
    best_effort_floor_allows,
    capacity_retry_after_ms,
    early_dispatch_allowed,
    effective_class,
    est_out_for_kv,
    expected_duration_ms,
    format_reset,
    kv_gib_seconds,
    quota_retry_after_ms,
    retry_headers,
    storm_retry_after_ms,
    to_milli,
    tokens_estimate,
    tpot_estimate,
)
from gateway.replicas import ReplicaRegistry
from gateway.router import Router

log = logging.getLogger("gateway.admission")

# Kept for callers of the first version; the policy module owns the mapping.
PRIORITY: dict[str, int] = VLLM_PRIORITY
TPOT_CACHE_S = 1.0  # the fleet p95 moves on the scrape's timescale, not per request

_LAYER_TEXT = {
    "requests": "requests per min (RPM)",
    "tokens": "tokens per min (TPM)",
    "kv_seconds": "concurrent KV·seconds (in-flight requests)",
}


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    request_id: str
    tenant: schema.TenantRecord
    limit: schema.LimitRecord
    version: schema.ModelVersionRecord
    prompt_tokens_est: int
    max_output: int  # effective max_tokens sent upstream
    is_retry: bool


@dataclass(slots=True)
class Ticket:
    request_id: str
    replica: schema.ReplicaRecord
    priority: int  # sent to vLLM as ``priority``
    admission_class: str  # the tenant's plan class (metrics label)
    est_kv_bytes: int  # KV this request lands on the replica at dispatch (prompt)
    headers: dict[str, str] = field(default_factory=dict)  # added to the response
    settled: bool = False
    effective_class: str = ""  # the class it was routed under (reserved above floor: standard)
    grant: Grant | None = None
    est_kv_milli: int = 0
    early: bool = False  # the early-dispatched upstream request stands (same replica, class)


@dataclass(slots=True)
class EarlyRoute:
    """A replica chosen before the quota answer; ``admit`` keeps or releases it."""

    replica: schema.ReplicaRecord
    cls: EffectiveClass
    priority: int
    dispatch_bytes: int
    quota: QuotaRequest
    released: bool = False


class AdmissionMetrics:
    """Admission's own series, registered on the gateway's registry (multiprocess-safe)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter(
            "fairway_admission_decisions",
            "Admission outcomes by plan class.",
            ["admission_class", "outcome"],
            registry=r,
        )
        self.redis_up_gauge = Gauge(
            "fairway_admission_limits_store_up",
            "1 while the limits store (Redis) answers; 0: rates fail open, KV fails closed.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.fail_open_total = Counter(
            "fairway_admission_fail_open",
            "Requests over a requests/tokens limit let through while Redis was unreachable.",
            ["layer"],
            registry=r,
        )
        self.fail_closed_total = Counter(
            "fairway_admission_fail_closed",
            "KV·seconds decisions taken on the conservative local cap (Redis unreachable).",
            ["result"],
            registry=r,
        )
        self.reclaimed = Counter(
            "fairway_admission_leases_reclaimed",
            "Unrenewed in-flight leases (a dead gateway's) reclaimed.",
            registry=r,
        )
        self.lost = Counter(
            "fairway_admission_leases_lost",
            "This gateway's leases found reclaimed at renewal (it was cut off > lease TTL).",
            registry=r,
        )
        self.inflight_leases = Gauge(
            "fairway_admission_inflight_leases",
            "Leases held by this gateway.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tpot_est = Gauge(
            "fairway_admission_tpot_estimate_seconds",
            "R1's TPOT estimate used in est_kv, per model version.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.early = Counter(
            "fairway_admission_early_dispatch",
            "Upstream requests sent before their quota answer, by what became of them: kept, "
            "cancelled (refused, or no answer), rerouted (the answer changed the class).",
            ["outcome"],
            registry=r,
        )
        self.redis_up_gauge.set(1)

    # gateway.limits.LimiterStats
    def redis_up(self, up: bool) -> None:
        self.redis_up_gauge.set(1 if up else 0)

    def fail_open(self, layer: str) -> None:
        self.fail_open_total.labels(layer).inc()

    def fail_closed(self, admitted: bool) -> None:
        self.fail_closed_total.labels("admitted" if admitted else "refused").inc()

    def leases_reclaimed(self, n: int) -> None:
        self.reclaimed.inc(n)

    def leases_lost(self, n: int) -> None:
        self.lost.inc(n)


class AdmissionController:
    def __init__(
        self,
        *,
        redis: Redis,
        registry: ReplicaRegistry,
        router: Router,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self._registry = registry
        self._router = router
        self._cfg: AdmissionConfig = config.admission
        self._rng = rng or random.Random()
        self.metrics = AdmissionMetrics(metrics.registry)
        # Its own client: short timeouts and no redis-py backoff, so that §8's fallback
        # answers in milliseconds when the store is gone (the shared client waits seconds).
        self._client = connect(config.redis_url, timeout_s=config.admission_redis_timeout_s)
        self._limiter = Limiter(self._client, self._cfg, stats=self.metrics)
        self._held: dict[str, Ticket] = {}  # lease id -> ticket, for the renewer
        self._tpot: dict[str, tuple[float, float]] = {}  # version -> (computed at, estimate)
        self._floors: dict[str, WindowCounts] = {}  # version -> (admitted, best-effort floor)
        # (tenant, family) -> the last quota answer's headroom / early requests awaiting one.
        self._headroom: dict[tuple[str, str], Headroom] = {}
        self._undecided: dict[tuple[str, str], Undecided] = {}
        self._renewer: asyncio.Task[None] | None = None
        del redis  # quota state uses the dedicated client above

    @property
    def limiter(self) -> Limiter:
        return self._limiter

    async def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_forever(), name="lease-renewer")

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self._limiter.aclose()
        await self._client.aclose()

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.lease_renew_s)
            try:
                await self._limiter.renew(
                    [t.grant for t in list(self._held.values()) if t.grant is not None]
                )
            except Exception:  # noqa: BLE001 - the renewer must outlive any one failure
                log.exception("lease renewal failed")

    # -- estimates -----------------------------------------------------------------------
    def tpot_estimate_s(self, version: schema.ModelVersionRecord) -> float:
        """R1, cached for a second per version."""
        now = time.monotonic()
        cached = self._tpot.get(version.version)
        if cached is not None and now - cached[0] < TPOT_CACHE_S:
            return cached[1]
        p95, age = self._registry.tpot_p95(version.version, window_s=self._cfg.tpot_window_s)
        est = tpot_estimate(
            p95,
            age,
            version.tpot_target_ms / 1000,
            max_factor=self._cfg.tpot_max_factor,
            stale_after_s=self._cfg.tpot_stale_after_s,
            stale_factor=self._cfg.tpot_stale_factor,
        )
        self._tpot[version.version] = (now, est)
        self.metrics.tpot_est.labels(version.version).set(est)
        return est

    def quota_request(self, req: AdmissionRequest) -> QuotaRequest:
        cfg, lim, version = self._cfg, req.limit, req.version
        tpot = self.tpot_estimate_s(version)
        est_out = est_out_for_kv(req.max_output, cfg.est_out_cap)
        est_kv = to_milli(
            kv_gib_seconds(req.prompt_tokens_est, est_out, version.kv_bytes_per_token, tpot)
        )
        return QuotaRequest(
            request_id=req.request_id,
            tenant_id=req.tenant.tenant_id,
            family=version.family,
            version=version.version,
            rpm=lim.rpm if cfg.enforces("requests") else 0,
            tpm=lim.tpm if cfg.enforces("tokens") else 0,
            est_tokens=tokens_estimate(req.prompt_tokens_est, None, req.max_output),
            est_kv_milli=est_kv,
            kv_cap_milli=lim.kv_seconds_cap * KV_MILLI if cfg.enforces("kv_seconds") else 0,
            expected_ms=expected_duration_ms(est_out, tpot),
            is_retry=req.is_retry and cfg.enforces("retry_budget"),
            retry_exempt=req.tenant.admission_class == "reserved",
        )

    # -- admit ---------------------------------------------------------------------------
    def early_route(self, req: AdmissionRequest) -> EarlyRoute | None:
        """A replica for sending the upstream request before the quota answer, or None
        (then ``admit`` routes after the answer, as it always may)."""
        cfg = self._cfg
        if req.is_retry:
            return None
        key = (req.tenant.tenant_id, req.version.family)
        headroom = self._headroom.get(key)
        if headroom is None:
            return None
        q = self.quota_request(req)
        undecided = self._undecided.get(key) or Undecided()
        if not early_dispatch_allowed(
            headroom,
            undecided,
            rpm=q.rpm,
            tpm=q.tpm,
            kv_cap_milli=q.kv_cap_milli,
            est_tokens=q.est_tokens,
            est_kv_milli=q.est_kv_milli,
            now=time.monotonic(),
            cfg=cfg,
        ):
            return None
        cls = effective_class(
            req.tenant.admission_class,
            headroom.inflight_kv_milli + undecided.kv_milli,
            req.limit.reserved_kv * KV_MILLI,
        )
        dispatch_bytes = max(0, req.prompt_tokens_est) * req.version.kv_bytes_per_token
        replica = self._router.choose(req.version, cls, dispatch_bytes)
        if replica is None:
            return None  # capacity is decided after the quota answer, as without this
        self._router.on_dispatch(replica, req.request_id, dispatch_bytes)
        undecided.requests += 1
        undecided.tokens += q.est_tokens
        undecided.kv_milli += q.est_kv_milli
        self._undecided[key] = undecided
        return EarlyRoute(replica, cls, VLLM_PRIORITY[cls], dispatch_bytes, q)

    def _decided(self, key: tuple[str, str], early: EarlyRoute) -> None:
        undecided = self._undecided.get(key)
        if undecided is None:
            return
        undecided.requests -= 1
        undecided.tokens -= early.quota.est_tokens
        undecided.kv_milli -= early.quota.est_kv_milli
        if undecided.requests <= 0:
            del self._undecided[key]

    def _remember(self, key: tuple[str, str], d: QuotaDecision, q: QuotaRequest) -> None:
        """Keep an admitted answer's headroom for early dispatch; anything else (a refusal,
        a decision taken without Redis) ends early dispatch for the tenant-model."""
        if not d.admitted or d.degraded:
            self._headroom.pop(key, None)
            return
        if len(self._headroom) > 50_000:
            self._headroom.clear()  # idle tenants' entries are stale anyway
        self._headroom[key] = Headroom(
            at=time.monotonic(),
            requests=d.state.remaining_requests,
            tokens=d.state.remaining_tokens,
            inflight_kv_milli=d.inflight_kv_milli + q.est_kv_milli,
        )

    def _release_early(self, early: EarlyRoute, request_id: str, outcome: str) -> None:
        if not early.released:
            early.released = True
            self._router.on_finish(early.replica, request_id)
            self.metrics.early.labels(outcome).inc()

    async def admit(self, req: AdmissionRequest, early: EarlyRoute | None = None) -> Ticket:
        """The quota answer and the route. With ``early``, the replica chosen before the
        answer is kept when the answer admits in the same class; otherwise it is released
        (the caller withdraws the early request unless ``Ticket.early``)."""
        try:
            return await self._admit(req, early)
        except BaseException:
            if early is not None:
                self._release_early(early, req.request_id, "cancelled")
            raise

    async def _admit(self, req: AdmissionRequest, early: EarlyRoute | None) -> Ticket:
        plan_class = req.tenant.admission_class
        key = (req.tenant.tenant_id, req.version.family)
        quota = early.quota if early is not None else self.quota_request(req)
        try:
            decision = await self._limiter.admit(quota)
        finally:
            if early is not None:
                self._decided(key, early)
        self._remember(key, decision, quota)
        headers = _rate_headers(decision)
        if not decision.admitted:
            raise self._refusal(req, decision, headers)
        grant = decision.grant
        assert grant is not None
        cls: EffectiveClass = effective_class(
            plan_class, decision.inflight_kv_milli, req.limit.reserved_kv * KV_MILLI
        )
        dispatch_bytes = max(0, req.prompt_tokens_est) * req.version.kv_bytes_per_token
        floor = False
        if early is not None and early.cls == cls:
            replica: schema.ReplicaRecord | None = early.replica
            early.released = True  # kept: the ticket's settle releases it
            self.metrics.early.labels("kept").inc()
        else:
            if early is not None:
                self._release_early(early, req.request_id, "rerouted")
                early = None
            replica = self._router.choose(req.version, cls, dispatch_bytes)
            if replica is None and cls == "best_effort" and self._cfg.enforces("capacity"):
                replica = self._best_effort_floor(req.version, dispatch_bytes)
                floor = replica is not None
            if replica is None:
                await self._limiter.settle(grant, actual_tokens=0, refund_request=True)
                self.metrics.decisions.labels(plan_class, "no_capacity").inc()
                raise self._no_capacity(req, cls, headers)
            self._router.on_dispatch(replica, req.request_id, dispatch_bytes)
        assert replica is not None  # refused above otherwise
        self._floor_window(req.version.version).record(time.monotonic(), flagged=floor)
        ticket = Ticket(
            request_id=req.request_id,
            replica=replica,
            priority=VLLM_PRIORITY[cls],
            admission_class=plan_class,
            est_kv_bytes=dispatch_bytes,
            headers=headers,
            effective_class=cls,
            grant=grant,
            est_kv_milli=grant.est_kv_milli,
            early=early is not None,
        )
        self._held[grant.lease_id] = ticket
        self.metrics.inflight_leases.inc()
        self.metrics.decisions.labels(plan_class, "admitted").inc()
        return ticket

    def _floor_window(self, version: str) -> WindowCounts:
        window = self._floors.get(version)
        if window is None:
            window = WindowCounts(self._cfg.best_effort_floor_window_s, slots=5)
            self._floors[version] = window
        return window

    def _best_effort_floor(
        self, version: schema.ModelVersionRecord, dispatch_bytes: int
    ) -> schema.ReplicaRecord | None:
        """§7 floors, not strict priority: a best-effort request over its ceiling may still
        use a replica under the standard ceiling, within its small share (vLLM priority
        stays best_effort, so the replica preempts it first)."""
        admitted, floored = self._floor_window(version.version).counts(time.monotonic())
        if not best_effort_floor_allows(admitted, floored, self._cfg):
            return None
        replica = self._router.choose(version, "standard", dispatch_bytes)
        if replica is not None:
            self.metrics.decisions.labels("best_effort", "floor").inc()
        return replica

    def _refusal(
        self, req: AdmissionRequest, d: QuotaDecision, headers: dict[str, str]
    ) -> ApiError:
        plan_class = req.tenant.admission_class
        if d.retry_storm:
            self.metrics.decisions.labels(plan_class, "retry_budget").inc()
            return Unavailable(
                "The fleet is shedding retries: retries exceed "
                f"{self._cfg.retry_budget_ratio:.0%} of admitted traffic over the last minute. "
                "This is our capacity, not your quota; retry after the indicated delay.",
                code="retry_budget_exhausted",
                headers={**headers, **retry_headers(storm_retry_after_ms(self._cfg, self._rng))},
            )
        layer = d.layer or "kv_seconds"
        self.metrics.decisions.labels(plan_class, f"rate_limited_{layer}").inc()
        wait_ms = quota_retry_after_ms(d.frees_in_ms, self._cfg, self._rng)
        lim = req.limit
        asked = tokens_estimate(req.prompt_tokens_est, None, req.max_output)
        detail = {
            "requests": f"Limit {lim.rpm}, Remaining {d.state.remaining_requests}.",
            "tokens": (
                f"Limit {lim.tpm}, Remaining {d.state.remaining_tokens}, Requested {asked}."
            ),
            "kv_seconds": (
                f"Limit {lim.kv_seconds_cap} GiB·s, In flight "
                f"{d.inflight_kv_milli / KV_MILLI:.1f} GiB·s."
            ),
        }[layer]
        note = " (decided locally: the limits store is unreachable)" if d.degraded else ""
        return RateLimited(
            f"Rate limit reached for {req.version.family} on {_LAYER_TEXT[layer]}: {detail} "
            f"Please try again in {format_reset(wait_ms)}.{note}",
            code="rate_limit_exceeded",
            type=layer,
            headers={**headers, **retry_headers(wait_ms)},
        )

    def _no_capacity(
        self, req: AdmissionRequest, cls: EffectiveClass, headers: dict[str, str]
    ) -> ApiError:
        if cls == "reserved":
            message = (
                f"Every replica of {req.version.version} is above "
                f"{self._cfg.reserved_max_occupancy:.0%} KV occupancy: this is a "
                "capacity incident on our side, not your quota."
            )
        else:
            message = (
                f"No replica of {req.version.version} has room for {cls} traffic right "
                "now. This is our capacity, not your quota; retry after the delay."
            )
        return Unavailable(
            message,
            code="capacity",
            headers={**headers, **retry_headers(capacity_retry_after_ms(self._cfg, self._rng))},
        )

    # -- settle --------------------------------------------------------------------------
    async def settle(
        self, ticket: Ticket, *, prompt_tokens: int, completion_tokens: int, outcome: str
    ) -> None:
        if ticket.settled:
            return
        ticket.settled = True
        try:
            self._router.on_finish(ticket.replica, ticket.request_id)
            grant = ticket.grant
            if grant is None:
                return
            if self._held.pop(grant.lease_id, None) is not None:
                self.metrics.inflight_leases.dec()
            # Nothing produced because of our failure: nothing counts against the quota.
            failed = outcome in ("error", "timeout") and completion_tokens <= 0
            actual = 0 if failed else max(0, prompt_tokens) + max(0, completion_tokens)
            await self._limiter.settle(grant, actual_tokens=actual, refund_request=failed)
        except Exception:  # noqa: BLE001 - settle must never raise into the terminal path
            log.exception("settle failed for %s", ticket.request_id)


def _rate_headers(d: QuotaDecision) -> dict[str, str]:
    """OpenAI's six headers; a layer with no limit (0) is left out rather than invented."""
    headers = d.state.headers()
    if d.state.limit_requests <= 0:
        for k in ("limit", "remaining", "reset"):
            headers.pop(f"x-ratelimit-{k}-requests")
    if d.state.limit_tokens <= 0:
        for k in ("limit", "remaining", "reset"):
            headers.pop(f"x-ratelimit-{k}-tokens")
    return headers
