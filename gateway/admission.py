"""Admission: the one stage between validation and the upstream call.

FIRST VERSION: routing only. ``admit`` picks a healthy replica through the router or
refuses with 503 ``capacity`` (jittered Retry-After, R6). Issue 5 replaces the internals
with the quota layers (requests/min, tokens/min, KV·seconds with estimate-then-reconcile),
plan classes with reserved floors, leases and the retry budget, keeping this interface:

- ``await start()`` / ``await stop()`` with the server's lifecycle;
- ``await admit(AdmissionRequest) -> Ticket``, raising an ``ApiError`` (429 quota, 503
  capacity) to refuse;
- ``await settle(ticket, prompt_tokens=, completion_tokens=, outcome=)`` once per admitted
  request from the request's single terminal handler, whatever the ending; ``outcome`` is
  the usage event's finish_reason (stop | length | cancelled | error | timeout). It never
  raises and a second call for the same ticket does nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway import schema
from gateway.config import GatewayConfig
from gateway.errors import capacity_unavailable
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaRegistry
from gateway.router import Router

log = logging.getLogger("gateway.admission")

# vLLM's priority scheduling runs lower values first; the replica agrees with our classes.
PRIORITY: dict[str, int] = {"reserved": 0, "standard": 1, "best_effort": 2}


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
    admission_class: str
    est_kv_bytes: int
    headers: dict[str, str] = field(default_factory=dict)  # added to the response
    settled: bool = False


class AdmissionController:
    def __init__(self, *, redis: Redis, registry: ReplicaRegistry, router: Router,
                 config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self._redis = redis
        self._registry = registry
        self._router = router
        self._config = config
        self._metrics = metrics

    async def start(self) -> None:
        """Nothing to start in the routing-only version."""

    async def stop(self) -> None:
        """Nothing to stop in the routing-only version."""

    async def admit(self, req: AdmissionRequest) -> Ticket:
        cls = req.tenant.admission_class
        est_kv_bytes = (req.prompt_tokens_est + req.max_output) * req.version.kv_bytes_per_token
        replica = self._router.choose(req.version, cls, est_kv_bytes)
        if replica is None:
            raise capacity_unavailable(
                f"No replica of {req.version.version} is available right now; retry later.")
        self._router.on_dispatch(replica, req.request_id, est_kv_bytes)
        return Ticket(request_id=req.request_id, replica=replica,
                      priority=PRIORITY.get(cls, PRIORITY["best_effort"]),
                      admission_class=cls, est_kv_bytes=est_kv_bytes)

    async def settle(self, ticket: Ticket, *, prompt_tokens: int, completion_tokens: int,
                     outcome: str) -> None:
        if ticket.settled:
            return
        ticket.settled = True
        try:
            self._router.on_finish(ticket.replica, ticket.request_id)
        except Exception:  # noqa: BLE001 - settle must never raise into the terminal path
            log.exception("settle failed for %s", ticket.request_id)
