"""Admission: the one stage between validation and the upstream call.

Quota first (the edge, docs/design.md §5 decision 1; 429, the customer can fix it), then capacity
(the router; 503, they cannot) — never mixed up (§3):

1. One atomic Redis round trip (``gateway.admission.quota``): requests/min, tokens/min charged on
   the estimate, concurrent KV·seconds as a lease, the retry budget (R6). Refused → 429
   ``rate_limit_exceeded`` whose ``type`` names the layer (``requests`` | ``tokens`` |
   ``kv_seconds``, as OpenAI's own 429 bodies name ``requests`` / ``tokens``), with
   ``retry-after`` / ``retry-after-ms`` from when that limit frees, jittered; a retry shed
   during a storm → 503 ``retry_budget_exhausted`` with 30–60 s. The API key's own limits
   (per-key limits, inside the tenant's) are checked in the same call; refused by them →
   429 ``key_rate_limit_exceeded`` (``type``: ``requests`` | ``tokens`` | ``concurrency``),
   and the ``x-ratelimit-*`` headers report the tighter of the key's and the tenant's.
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
(``early.early_dispatch_allowed``: every limit keeps a margin free, the answer is recent,
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

``is_retry`` comes from the gateway (R6's identity of retries,
gateway/admission/retrymemory.py): a request whose ``Idempotency-Key`` was seen before (an
earlier attempt that failed), or the same tenant-key body again shortly after a retryable
failure. The client's ``x-stainless-retry-count`` never counts by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from contracts import schema
from contracts.formulas import kv_gib_seconds
from gateway.admission.classes import best_effort_floor_allows, effective_class
from gateway.admission.config import VLLM_PRIORITY, AdmissionConfig, EffectiveClass
from gateway.admission.early import Headroom, Undecided, early_dispatch_allowed
from gateway.admission.estimates import (
    KV_MILLI,
    est_out_for_kv,
    expected_duration_ms,
    long_context_threshold,
    to_milli,
    tokens_estimate,
    tpot_estimate,
)
from gateway.admission.hold import HoldPlaces, LongContextHold, LongContextRefusal
from gateway.admission.long_context import (
    REFUSAL_CLAUSE_HEADER,
    long_context_budget,
    long_context_lane_slots,
    long_context_tier,
)
from gateway.admission.prefix import PrefixQuery
from gateway.admission.quota import (
    Grant,
    Limiter,
    LongContextAsk,
    QuotaDecision,
    QuotaRequest,
)
from gateway.admission.ratelimit import format_reset, tighter_state
from gateway.admission.replicas import ReplicaRegistry
from gateway.admission.retry import (
    WindowCounts,
    capacity_retry_after_ms,
    long_context_retry_after_ms,
    quota_retry_after_ms,
    retry_headers,
    storm_retry_after_ms,
)
from gateway.admission.router import Router
from gateway.config import GatewayConfig
from gateway.errors import ApiError, RateLimited, Unavailable
from gateway.metrics import AdmissionMetrics, GatewayMetrics

log = logging.getLogger("gateway.admission")

TPOT_CACHE_S = 1.0  # the fleet p95 moves on the scrape's timescale, not per request

_LAYER_TEXT = {
    "requests": "requests per min (RPM)",
    "tokens": "tokens per min (TPM)",
    "kv_seconds": "concurrent KV·seconds (in-flight requests)",
    "concurrency": "concurrent requests",
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
    prefix: PrefixQuery | None = None  # for cache-aware routing
    key: schema.KeyRecord | None = None  # the API key: its own limits apply inside the tenant's
    # Sequences generated (``n``, times the prompts of a completions request), each up to
    # ``max_output`` tokens: they multiply the output in the estimates.
    sequences: int = 1

    @property
    def output_est(self) -> int:
        """Output tokens charged to tokens/min: every sequence at its maximum."""
        return self.max_output * max(1, self.sequences)


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


class AdmissionController:
    def __init__(
        self,
        *,
        registry: ReplicaRegistry,
        router: Router,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        client: Redis,
        rng: random.Random | None = None,
    ) -> None:
        self._registry = registry
        self._router = router
        self._cfg: AdmissionConfig = config.admission
        self._rng = rng or random.Random()
        self.metrics = AdmissionMetrics(metrics.registry)
        # The limits store's client (LIMITS_REDIS_URL), built by the server with admission's
        # short timeouts; closed by stop().
        self._client = client
        self._limiter = Limiter(self._client, self._cfg, stats=self.metrics)
        self._held: dict[str, Ticket] = {}  # lease id -> ticket, for the renewer
        self._tpot: dict[str, tuple[float, float]] = {}  # version -> (computed at, estimate)
        self._floors: dict[str, WindowCounts] = {}  # version -> (admitted, best-effort floor)
        # (tenant, family) -> the last quota answer's headroom / early requests awaiting one.
        self._headroom: dict[tuple[str, str], Headroom] = {}
        self._undecided: dict[tuple[str, str], Undecided] = {}
        self._renewer: asyncio.Task[None] | None = None
        # The long-context hold (off unless long_context_hold_s > 0): the request pipeline
        # runs it around ``admit`` (gateway/admission/hold.py).
        self.hold = LongContextHold(
            self._cfg.long_context_hold_s,
            HoldPlaces(self._cfg.long_context_hold_per_tenant, self._cfg.long_context_hold_max),
            self.metrics,
        )

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
        """docs/design.md R1, cached for a second per version."""
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

    def is_long_context(self, req: AdmissionRequest) -> bool:
        return req.prompt_tokens_est >= long_context_threshold(req.version)

    def long_context_ask(self, req: AdmissionRequest) -> LongContextAsk | None:
        """The claim a long-context request makes on its version's budget, or None (a short
        request, the layer off, or a reserved tenant: floor traffic has its own pool and
        above its floor an enterprise tenant is bounded by its KV·seconds and the
        ceilings)."""
        cfg, version = self._cfg, req.version
        plan = req.tenant.admission_class
        if not cfg.enforces("long_context") or plan == "reserved" or not self.is_long_context(req):
            return None
        shared = sum(1 for r in version.replicas if r.pool != "reserved")
        # what the ceiling check reserves on its replica: the prompt and the output growth
        # (gateway/admission/placement.py's ``request_bytes``), so the budget and the
        # ceilings count the same KV
        need = max(0, req.prompt_tokens_est) * version.kv_bytes_per_token
        need += self.output_growth_bytes(req)
        # with long_context_fit, the budget this ask's size is judged against (fit_budget)
        budget, slots = long_context_budget(version, max(1, shared), plan, cfg, need)
        tier = long_context_tier(req.prompt_tokens_est, version, cfg)
        return LongContextAsk(
            cls=plan,
            kv_bytes=need,
            budget_bytes=budget,
            prefill_slots=slots,
            # its expected first token (attention included), recorded in its lease: what a
            # refusal for a full prefill slot is told to wait for while this one runs
            prefill_ms=tier.prefill_ms,
            demand_window_ms=int(cfg.long_context_demand_window_s * 1000),
            # held until the first token (``prefill_done``); this only bounds a lost release
            prefill_hold_ms=tier.hold_ms,
            # its tier: a prompt that is not very long may also use the lane's slots, and
            # beside a very long prefill it runs in what that one leaves of each step
            very_long=tier.very_long,
            lane_slots=long_context_lane_slots(max(1, shared), cfg),
            prefill_beside_ms=tier.beside_ms,
        )

    def output_growth_bytes(self, req: AdmissionRequest) -> int:
        """The decode KV a request adds after admission, as its KV·seconds charge assumes
        it: the estimated output (``est_out_for_kv``) of each of its sequences."""
        est_out = est_out_for_kv(req.max_output, self._cfg.est_out_cap)
        return max(1, req.sequences) * est_out * req.version.kv_bytes_per_token

    def quota_request(self, req: AdmissionRequest) -> QuotaRequest:
        cfg, lim, version = self._cfg, req.limit, req.version
        tpot = self.tpot_estimate_s(version)
        est_out = est_out_for_kv(req.max_output, cfg.est_out_cap)
        kv_bytes = version.kv_bytes_per_token
        # n sequences share the prompt's KV blocks (vLLM forks them after prefill), so the
        # prompt is held once and each further sequence adds only its own decode KV.
        est_kv = to_milli(
            kv_gib_seconds(req.prompt_tokens_est, est_out, kv_bytes, tpot)
            + (max(1, req.sequences) - 1) * kv_gib_seconds(0, est_out, kv_bytes, tpot)
        )
        return QuotaRequest(
            request_id=req.request_id,
            tenant_id=req.tenant.tenant_id,
            family=version.family,
            version=version.version,
            rpm=lim.rpm if cfg.enforces("requests") else 0,
            tpm=lim.tpm if cfg.enforces("tokens") else 0,
            est_tokens=tokens_estimate(req.prompt_tokens_est, None, req.output_est),
            est_kv_milli=est_kv,
            kv_cap_milli=lim.kv_seconds_cap * KV_MILLI if cfg.enforces("kv_seconds") else 0,
            expected_ms=expected_duration_ms(est_out, tpot),
            is_retry=req.is_retry and cfg.enforces("retry_budget"),
            retry_exempt=req.tenant.admission_class == "reserved",
            long=(long := self.long_context_ask(req)),
            read_long=long is None and cfg.context_placement,
            **self._key_limits(req),
        )

    def _key_limits(self, req: AdmissionRequest) -> dict[str, Any]:
        """Per-key limits: the key's own for this family, switched off with the tenant's
        layer of the same kind (its concurrency cap has no switch: it is the key's own)."""
        if req.key is None:
            return {}
        cfg = self._cfg
        own = req.key.limits.get(req.version.family) or schema.KeyLimitRecord()
        return {
            "key_id": req.key.key_id,
            "key_rpm": own.rpm if cfg.enforces("requests") else 0,
            "key_tpm": own.tpm if cfg.enforces("tokens") else 0,
            "key_concurrency": own.max_concurrency,
        }

    # -- admit ---------------------------------------------------------------------------
    def early_route(self, req: AdmissionRequest) -> EarlyRoute | None:
        """A replica for sending the upstream request before the quota answer, or None
        (then ``admit`` routes after the answer, as it always may)."""
        cfg = self._cfg
        if req.is_retry or self.is_long_context(req):
            return None  # a long context waits for its budget answer (and is rare)
        if req.key is not None and req.version.family in req.key.limits:
            # The headroom is the tenant's: it cannot tell whether a key's own limit has
            # room, and a key at its limit would send (and withdraw) a request per refusal.
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
        replica = self._router.choose(req.version, cls, dispatch_bytes, prefix=req.prefix)
        if replica is None:
            return None  # capacity is decided after the quota answer, as without this
        self._router.on_dispatch(replica, req.request_id, dispatch_bytes, prefix=req.prefix)
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
        if decision.long_inflight_bytes >= 0:
            own = quota.long.kv_bytes if quota.long is not None and decision.admitted else 0
            self._router.note_fleet_long(
                req.version.version, max(0, decision.long_inflight_bytes - own)
            )
        headers = _rate_headers(decision)
        if not decision.admitted:
            raise self._refusal(req, decision, headers)
        long_context = self.is_long_context(req)
        grant = decision.grant
        assert grant is not None
        cls: EffectiveClass = effective_class(
            plan_class, decision.inflight_kv_milli, req.limit.reserved_kv * KV_MILLI
        )
        dispatch_bytes = max(0, req.prompt_tokens_est) * req.version.kv_bytes_per_token
        growth = self.output_growth_bytes(req) if long_context else 0
        # its tier, as the budget's ask has it when the budget is on (once per request)
        very_long = long_context and (
            quota.long.very_long
            if quota.long is not None
            else self._router.very_long(req.version, dispatch_bytes)
        )
        shared = long_context and self._cfg.long_prefill_placement and grant.long_tag is not None
        if shared and quota.long is not None:
            await self._note_placements(req.version.version, quota.long.kv_bytes)
        floor = False
        if early is not None and early.cls == cls:
            replica: schema.ReplicaRecord | None = early.replica
            early.released = True  # kept: the ticket's settle releases it
            self.metrics.early.labels("kept").inc()
        else:
            if early is not None:
                self._release_early(early, req.request_id, "rerouted")
                early = None
            replica = self._router.choose(
                req.version,
                cls,
                dispatch_bytes,
                long_context=long_context,
                prefix=req.prefix,
                growth_bytes=growth,
                very_long=very_long,
            )
            if replica is None and cls == "best_effort" and self._cfg.enforces("capacity"):
                replica = self._best_effort_floor(
                    req.version, dispatch_bytes, long_context, req.prefix, growth
                )
                floor = replica is not None
            if replica is None:
                await self._limiter.settle(grant, actual_tokens=0, refund_request=True)
                self.metrics.decisions.labels(plan_class, "no_capacity").inc()
                raise self._no_capacity(req, cls, headers)
            self._router.on_dispatch(
                replica,
                req.request_id,
                dispatch_bytes,
                long_context=long_context,
                prefix=req.prefix,
                growth_bytes=growth,
                very_long=very_long,
            )
        assert replica is not None  # refused above otherwise
        if shared:
            # where it runs, for every gateway process's placement (one write)
            await self._limiter.placed(grant, replica.replica_id)
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

    async def charge_replay(self, req: AdmissionRequest) -> dict[str, str]:
        """An idempotent replay costs one request of requests/min and no tokens (nothing is
        generated, no KV is held): a client replaying a stored response must not get
        unlimited free requests, and must not pay tokens twice for one generation. Returns
        the rate headers; a 429 like admission's when requests/min is spent."""
        rpm = req.limit.rpm if self._cfg.enforces("requests") else 0
        key = self._key_limits(req)
        key_rpm = int(key.get("key_rpm", 0))
        if rpm <= 0 and key_rpm <= 0:
            return {}
        d = await self._limiter.charge_request(
            req.tenant.tenant_id,
            req.version.family,
            rpm,
            key_id=str(key.get("key_id", "")),
            key_rpm=key_rpm,
        )
        headers = _rate_headers(d)
        if not d.admitted:
            raise self._refusal(req, d, headers)
        return headers

    async def _note_placements(self, version: str, own_bytes: int) -> None:
        """With ``long_prefill_placement``, before a long context is placed: every gateway
        process's long contexts per replica from the ledger (``Limiter.placements``, one
        read, long contexts only), for the router's prefill slots
        (``Router.note_long_prefills``) and long-context floor (``Router.note_placed_long``);
        the request's own lease, admitted but not placed yet, is taken off the total.
        Without the ledger each process knows its own."""
        got = await self._limiter.placements(version)
        if got is None:
            return
        self._router.note_fleet_long(version, max(0, got.inflight_bytes - own_bytes))
        self._router.note_placed_long(version, {r: x[0] for r, x in got.by_replica.items()})
        self._router.note_long_prefills(
            version, {r: (x[1], x[2]) for r, x in got.by_replica.items()}
        )

    def _floor_window(self, version: str) -> WindowCounts:
        window = self._floors.get(version)
        if window is None:
            window = WindowCounts(self._cfg.best_effort_floor_window_s, slots=5)
            self._floors[version] = window
        return window

    def _best_effort_floor(
        self,
        version: schema.ModelVersionRecord,
        dispatch_bytes: int,
        long_context: bool,
        prefix: PrefixQuery | None = None,
        growth_bytes: int = 0,
    ) -> schema.ReplicaRecord | None:
        """docs/design.md §7 floors, not strict priority: a best-effort request over its ceiling may
        still use a replica under the standard ceiling, within its small share (vLLM priority
        stays best_effort, so the replica preempts it first)."""
        admitted, floored = self._floor_window(version.version).counts(time.monotonic())
        if not best_effort_floor_allows(admitted, floored, self._cfg):
            return None
        replica = self._router.choose(
            version,
            "standard",
            dispatch_bytes,
            long_context=long_context,
            prefix=prefix,
            growth_bytes=growth_bytes,
        )
        if replica is not None:
            self.metrics.decisions.labels("best_effort", "floor").inc()
        return replica

    def _refusal(
        self, req: AdmissionRequest, d: QuotaDecision, headers: dict[str, str]
    ) -> ApiError:
        plan_class = req.tenant.admission_class
        if d.long_context_full:
            self.metrics.decisions.labels(plan_class, "long_context_budget").inc()
            wait_ms = long_context_retry_after_ms(d.frees_in_ms, self._rng)
            clause = d.long_context_clause.label if d.long_context_clause else "unknown"
            self.metrics.long_context_refusals.labels(req.version.version, clause).inc()
            log.debug(
                "long-context refusal tenant=%s model=%s prompt=%d clause=%s wait_ms=%d",
                req.tenant.tenant_id,
                req.version.version,
                req.prompt_tokens_est,
                clause,
                d.frees_in_ms,
            )
            return LongContextRefusal(
                f"The fleet's long-context capacity for {req.version.version} is in use: "
                f"a prompt of {req.prompt_tokens_est} tokens needs a long-context slot, and "
                "they are shared fairly among the tenants asking for them. This is our "
                "capacity, not your quota; retry after the delay.",
                wait_ms=wait_ms,
                headers={
                    **headers,
                    **retry_headers(wait_ms),
                    REFUSAL_CLAUSE_HEADER: clause,
                },
            )
        if d.retry_storm and d.retry_scope == "tenant":
            # 503 like the fleet's: retries follow failures, mostly ours (a replica's 503).
            self.metrics.decisions.labels(plan_class, "retry_budget_tenant").inc()
            return Unavailable(
                "Your organization's retries exceed "
                f"{self._cfg.retry_budget_ratio:.0%} of its admitted requests for "
                f"{req.version.family} over the last minute, so further retries are shed "
                "for now; first attempts are not affected. Retry after the indicated delay.",
                code="retry_budget_exhausted",
                headers={**headers, **retry_headers(storm_retry_after_ms(self._cfg, self._rng))},
            )
        if d.retry_storm:
            self.metrics.decisions.labels(plan_class, "retry_budget").inc()
            return Unavailable(
                "The fleet is shedding retries: retries exceed "
                f"{self._cfg.retry_budget_ratio:.0%} of admitted traffic over the last minute. "
                "This is our capacity, not your quota; retry after the indicated delay.",
                code="retry_budget_exhausted",
                headers={**headers, **retry_headers(storm_retry_after_ms(self._cfg, self._rng))},
            )
        if d.key_limited:
            return self._key_refusal(req, d, headers)
        layer = d.layer or "kv_seconds"
        self.metrics.decisions.labels(plan_class, f"rate_limited_{layer}").inc()
        wait_ms = quota_retry_after_ms(d.frees_in_ms, self._cfg, self._rng)
        lim = req.limit
        asked = tokens_estimate(req.prompt_tokens_est, None, req.output_est)
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
        refusal = RateLimited(
            f"Rate limit reached for {req.version.family} on {_LAYER_TEXT[layer]}: {detail} "
            f"Please try again in {format_reset(wait_ms)}.{note}",
            code="rate_limit_exceeded",
            type=layer,
            headers={**headers, **retry_headers(wait_ms)},
        )
        refusal.frees_in_s = d.frees_in_ms / 1000
        return refusal

    def _key_refusal(
        self, req: AdmissionRequest, d: QuotaDecision, headers: dict[str, str]
    ) -> ApiError:
        """Per-key limits: 429 for the API key's own limit, told apart from the tenant's by
        its code, so a client (and the refusal memory, which is per tenant) knows that its
        sibling keys are not limited."""
        layer = d.layer or "concurrency"
        self.metrics.decisions.labels(req.tenant.admission_class, f"key_limited_{layer}").inc()
        wait_ms = quota_retry_after_ms(d.frees_in_ms, self._cfg, self._rng)
        own = (req.key.limits.get(req.version.family) if req.key else None) or (
            schema.KeyLimitRecord()
        )
        ks = d.key_state
        detail = {
            "requests": f"Limit {own.rpm}, Remaining {ks.remaining_requests if ks else 0}.",
            "tokens": (
                f"Limit {own.tpm}, Remaining {ks.remaining_tokens if ks else 0}, Requested "
                f"{tokens_estimate(req.prompt_tokens_est, None, req.output_est)}."
            ),
            "concurrency": f"Limit {own.max_concurrency}, In flight {d.key_inflight}.",
            "kv_seconds": "",
        }[layer]
        note = " (decided locally: the limits store is unreachable)" if d.degraded else ""
        return RateLimited(
            f"Rate limit reached for this API key on {req.version.family} on "
            f"{_LAYER_TEXT[layer]}: {detail} The key's own limit binds; other keys of the "
            f"organization are not affected. Please try again in {format_reset(wait_ms)}."
            f"{note}",
            code="key_rate_limit_exceeded",
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

    # -- first token ---------------------------------------------------------------------
    async def prefill_done(self, ticket: Ticket) -> None:
        """The request's first token arrived, so its prefill is over: a long-context
        request gives its prefill slot back to the budget now (its KV stays held until
        ``settle``). Other requests hold no slot: nothing to do, no round trip."""
        grant = ticket.grant
        if grant is None or grant.long_tag is None or ticket.settled:
            return
        try:
            await self._limiter.prefill_done(grant)
        except Exception:  # noqa: BLE001 - never into the relay; the expiry bounds the slot
            log.exception("prefill release failed for %s", ticket.request_id)

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
    """OpenAI's six headers; a layer with no limit (0) is left out rather than invented.
    With an API key's own limits, each reports the tighter of the key's and the tenant's."""
    state = tighter_state(d.state, d.key_state)
    headers = state.headers()
    if state.limit_requests <= 0:
        for k in ("limit", "remaining", "reset"):
            headers.pop(f"x-ratelimit-{k}-requests")
    if state.limit_tokens <= 0:
        for k in ("limit", "remaining", "reset"):
            headers.pop(f"x-ratelimit-{k}-tokens")
    return headers
