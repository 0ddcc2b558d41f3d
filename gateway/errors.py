"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the gateway makes is an ``ApiError``; the app turns it into a response
(or, once a stream has started, into an in-stream ``data: {"error": ...}`` event).
The status codes are what the official ``openai`` client maps to its exception classes.
"""

from __future__ import annotations

import math
import random

import orjson

# The openai Python SDK honours ``retry-after-ms`` / ``retry-after`` only up to a bound: 60 s in
# its 1.x releases (a longer one it ignores and retries on its own 0.5-8 s backoff, sooner than
# told, to be refused again), 120 s in the release bench/loadgen.py models (a longer one is not
# retried at all). No retry-after the gateway sends is longer than the lower of the two.
RETRY_AFTER_CAP_MS = 60_000


def retry_after_headers(wait_ms: float) -> dict[str, str]:
    """``retry-after`` (whole seconds, rounded up) and OpenAI's ``retry-after-ms``, saying the
    same wait: at least 1 ms, at most ``RETRY_AFTER_CAP_MS``."""
    told = min(RETRY_AFTER_CAP_MS, max(1, math.ceil(wait_ms)))
    return {"retry-after": str(math.ceil(told / 1000)), "retry-after-ms": str(told)}


def _consistent_retry_after(headers: dict[str, str]) -> dict[str, str]:
    """A refusal's headers with its retry-after written as ``retry_after_headers`` writes
    it (both headers, capped), from ``retry-after-ms`` when given, else ``retry-after``:
    whichever refusal sets one, the response says one capped wait in both."""
    ms, secs = headers.get("retry-after-ms"), headers.get("retry-after")
    try:
        wait = float(ms) if ms is not None else float(secs) * 1000 if secs is not None else None
    except ValueError:
        return headers
    if wait is None or not math.isfinite(wait):
        return headers
    return {**headers, **retry_after_headers(wait)}


class ApiError(Exception):
    status: int = 500
    type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.headers: dict[str, str] = _consistent_retry_after(dict(headers or {}))
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def payload(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code!r}, {self.message!r})"


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str, *, code: str = "invalid_api_key") -> None:
        super().__init__(message, code=code)


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class Unprocessable(ApiError):
    status = 422
    type = "invalid_request_error"


class RateLimited(ApiError):
    """429: the tenant's quota. The customer can fix it by slowing down (docs/design.md §3)."""

    status = 429
    type = "rate_limit_error"
    # When the limit itself frees, in seconds, without the Retry-After's jitter (None: not
    # known). What the recently-refused memory may rely on: past it the store would admit.
    frees_in_s: float | None = None


class UpstreamError(ApiError):
    """502: the replica answered with something the gateway cannot relay."""

    status = 502
    type = "server_error"


class Unavailable(ApiError):
    """503: our capacity, not the customer's quota; always with a jittered Retry-After
    (docs/design.md R6)."""

    status = 503
    type = "server_error"


class GatewayTimeout(ApiError):
    status = 504
    type = "server_error"


def jittered_retry_after(
    base_s: float, spread_s: float, rng: random.Random | None = None
) -> dict[str, str]:
    """``retry-after`` / ``retry-after-ms`` drawn uniformly from [base, base + spread].

    Every response gets its own draw so that clients told to wait do not return at one
    instant (docs/design.md R6: an unjittered Retry-After creates the herd it was meant to prevent).
    """
    delay = base_s + (rng or random).uniform(0.0, spread_s)
    return retry_after_headers(delay * 1000)


def capacity_unavailable(
    message: str, *, code: str = "capacity", base_s: float = 1.0, spread_s: float = 4.0
) -> Unavailable:
    return Unavailable(message, code=code, headers=jittered_retry_after(base_s, spread_s))


def config_store_unavailable() -> Unavailable:
    """The read model (Redis) is unreachable and the record was never cached: refuse."""
    return Unavailable(
        "The gateway's configuration store is unreachable; retry shortly.",
        code="config_store_unavailable",
        headers=jittered_retry_after(1, 4),
    )
