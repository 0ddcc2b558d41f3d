"""Gateway configuration: one immutable object read from the environment once at startup.

Every knob the gateway has lives here, as small value objects. Nothing else in
``gateway/`` reads ``os.environ``.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gateway.policy import AdmissionConfig

# Development defaults. They must equal fairway/env.py's (the control plane hashes keys with
# the same pepper); tests/gateway/test_config.py checks that. Refused in production.
DEV_KEY_PEPPER = "fairway-dev-key-pepper-not-secret"  # noqa: S105 - public dev default
DEV_CACHE_SALT_KEY = "fairway-dev-cache-salt-key-not-secret"  # noqa: S105
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class ConfigError(ValueError):
    """The environment holds a value the gateway cannot run with."""


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Per-phase limits for calls to replicas, in seconds.

    ``read`` is the longest silence tolerated between two bytes of a response, so it is
    both the time-to-first-token ceiling and the inter-token stall limit.
    """

    connect: float = 2.0
    read: float = 30.0
    write: float = 5.0
    pool: float = 2.0


@dataclass(frozen=True, slots=True)
class PoolLimits:
    max_connections: int = 2000
    max_keepalive: int = 500
    # Below the replicas' own idle timeout (vLLM's uvicorn closes idle connections after
    # 5 s): a pooled connection the server is closing at the moment of reuse fails the
    # request, so the gateway must give connections up first.
    keepalive_expiry_s: float = 4.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str = DEFAULT_REDIS_URL
    kafka_bootstrap: str | None = None
    key_pepper: bytes = DEV_KEY_PEPPER.encode()
    cache_salt_key: bytes = DEV_CACHE_SALT_KEY.encode()
    environment: str = "development"
    upstream: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    pool: PoolLimits = field(default_factory=PoolLimits)
    # The shared Redis client (read model, idempotency, last-used stamps): every call is
    # bounded by this, with one immediate retry and no backoff (§8 fallbacks answer fast).
    redis_timeout_s: float = 1.0
    # Its pool blocks (up to redis_timeout_s) for a free connection past this many.
    redis_max_connections: int = 100
    max_body_bytes: int = 1 << 20
    spool_dir: Path = Path("var/spool")
    usage_topic: str = "usage.v1"
    drain_deadline_s: float = 30.0
    scrape_interval_s: float = 0.25
    scrape_timeout_s: float = 1.0
    # Consecutive failed scrapes before a replica leaves the routing set.
    scrape_failures_unhealthy: int = 3
    idempotency_ttl_s: int = 24 * 3600
    # How long an in-flight idempotency claim survives a crashed gateway.
    idempotency_inflight_ttl_s: int = 900
    last_used_flush_s: float = 5.0
    # A cached key or tenant is trusted this long while the change channel is subscribed;
    # the channel drops entries at once, this only bounds drift if a message is lost.
    cache_ttl_s: float = 30.0
    # Refreshing an expired entry (the TTL above ran out; nothing announced a change) waits
    # at most this long for Redis before the last known record answers (§8, stale-if-error).
    stale_refresh_timeout_s: float = 0.25
    # While the change channel is down, entries are re-read this often (revocation < 1 s).
    cache_ttl_unsubscribed_s: float = 0.5
    # Seconds between checks of the read-model version (catches missed pub/sub messages).
    version_poll_s: float = 1.0
    # Admission and fairness knobs (GATEWAY_ADMISSION_*; see gateway/README.md).
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # The limits store's own timeout: past it, §8's fallback decides (fail open / closed).
    admission_redis_timeout_s: float = 0.5
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex}")

    @property
    def production(self) -> bool:
        return self.environment == "production"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewayConfig:
        env = os.environ if env is None else env
        environment = env.get("FAIRWAY_ENV", "development").strip() or "development"
        pepper = env.get("FAIRWAY_KEY_PEPPER", "")
        salt_key = env.get("FAIRWAY_CACHE_SALT_KEY", "")
        if environment == "production":
            missing = [
                n
                for n, v in (("FAIRWAY_KEY_PEPPER", pepper), ("FAIRWAY_CACHE_SALT_KEY", salt_key))
                if not v
            ]
            if missing:
                raise ConfigError(f"production requires {', '.join(missing)}")
            if pepper == DEV_KEY_PEPPER or salt_key == DEV_CACHE_SALT_KEY:
                raise ConfigError("production refuses the development pepper or salt key")
        return cls(
            redis_url=env.get("REDIS_URL") or DEFAULT_REDIS_URL,
            kafka_bootstrap=env.get("KAFKA_BOOTSTRAP") or None,
            key_pepper=(pepper or DEV_KEY_PEPPER).encode(),
            cache_salt_key=(salt_key or DEV_CACHE_SALT_KEY).encode(),
            environment=environment,
            upstream=UpstreamTimeouts(
                connect=_float(env, "GATEWAY_UPSTREAM_CONNECT_TIMEOUT_S", 2.0),
                read=_float(env, "GATEWAY_UPSTREAM_READ_TIMEOUT_S", 30.0),
                write=_float(env, "GATEWAY_UPSTREAM_WRITE_TIMEOUT_S", 5.0),
                pool=_float(env, "GATEWAY_UPSTREAM_POOL_TIMEOUT_S", 2.0),
            ),
            redis_timeout_s=_float(env, "GATEWAY_REDIS_TIMEOUT_S", 1.0),
            redis_max_connections=_int(env, "GATEWAY_REDIS_MAX_CONNECTIONS", 100),
            cache_ttl_s=_float(env, "GATEWAY_CACHE_TTL_S", 30.0),
            stale_refresh_timeout_s=_float(env, "GATEWAY_STALE_REFRESH_TIMEOUT_S", 0.25),
            max_body_bytes=_int(env, "GATEWAY_MAX_BODY_BYTES", 1 << 20),
            spool_dir=Path(env.get("GATEWAY_SPOOL_DIR") or "var/spool"),
            usage_topic=env.get("GATEWAY_USAGE_TOPIC") or "usage.v1",
            drain_deadline_s=_float(env, "GATEWAY_DRAIN_DEADLINE_S", 30.0),
            scrape_interval_s=_float(env, "GATEWAY_SCRAPE_INTERVAL_S", 0.25),
            idempotency_ttl_s=_int(env, "GATEWAY_IDEMPOTENCY_TTL_S", 24 * 3600),
            last_used_flush_s=_float(env, "GATEWAY_LAST_USED_FLUSH_S", 5.0),
            admission=_admission(env),
            admission_redis_timeout_s=_float(env, "GATEWAY_ADMISSION_REDIS_TIMEOUT_S", 0.5),
        )


def _admission(env: Mapping[str, str]) -> AdmissionConfig:
    try:
        return AdmissionConfig.from_env(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


Number = TypeVar("Number", int, float)


def _positive(
    env: Mapping[str, str], name: str, default: Number, parse: Callable[[str], Number]
) -> Number:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a valid {parse.__name__}") from exc
    if value <= 0:
        raise ConfigError(f"{name} must be positive")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _positive(env, name, default, float)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return _positive(env, name, default, int)
