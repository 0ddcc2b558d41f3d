"""Early dispatch: when the quota answer is all but certain to be yes, the upstream request
is sent before it arrives, so the two round trips overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.config import AdmissionConfig


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
