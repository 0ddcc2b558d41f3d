"""Token buckets per minute and OpenAI's ``x-ratelimit-*`` headers. The quota scripts in
gateway/admission/quota.py keep the buckets in Redis with the same arithmetic (in Lua); these
are the in-process shadow used while Redis is unreachable, and the header values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MINUTE_MS = 60_000


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


def tighter_state(tenant: RateLimitState, key: RateLimitState | None) -> RateLimitState:
    """Per-key limits: what the ``x-ratelimit-*`` headers report when an API key has its own
    limits inside its tenant's. Requests and tokens each independently: the limit with less
    left (an unlimited one, 0, never binds; on a tie, the smaller limit)."""
    if key is None:
        return tenant

    def key_binds(t_limit: int, t_rem: int, k_limit: int, k_rem: int) -> bool:
        if k_limit <= 0:
            return False
        if t_limit <= 0:
            return True
        return (k_rem, k_limit) < (t_rem, t_limit)

    r = key_binds(
        tenant.limit_requests, tenant.remaining_requests, key.limit_requests, key.remaining_requests
    )
    t = key_binds(
        tenant.limit_tokens, tenant.remaining_tokens, key.limit_tokens, key.remaining_tokens
    )
    src_r, src_t = (key if r else tenant), (key if t else tenant)
    return RateLimitState(
        src_r.limit_requests,
        src_r.remaining_requests,
        src_r.reset_requests_ms,
        src_t.limit_tokens,
        src_t.remaining_tokens,
        src_t.reset_tokens_ms,
    )
