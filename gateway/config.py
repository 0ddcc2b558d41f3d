"""Gateway configuration: one immutable object read from the environment once at startup.

Every knob the gateway has lives here, as small value objects. Nothing else in
``gateway/`` reads ``os.environ``.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from contracts.blockhash import HASH_ALGOS
from contracts.defaults import (
    DEFAULT_REDIS_URL,
    DEV_CACHE_SALT_KEY,
    DEV_KEY_PEPPER,
    MIN_SECRET_BYTES,
    is_redis_url,
)
from contracts.settings import model_paths
from gateway.admission.chat_template import TemplateCounter
from gateway.admission.config import AdmissionConfig
from gateway.admission.prefix import parse_endpoints
from gateway.admission.tokens import ExactCounter
from gateway.redis_client import TlsFiles

# Per-role Redis URLs; each defaults to REDIS_URL (``GatewayConfig.redis_urls``).
ROLE_URL_VARS = ("READMODEL_REDIS_URL", "LIMITS_REDIS_URL", "IDEMPOTENCY_REDIS_URL")


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
    # Each role may have its own Redis (READMODEL_REDIS_URL, LIMITS_REDIS_URL,
    # IDEMPOTENCY_REDIS_URL); unset, a role uses redis_url. Kept apart, an idempotency store
    # filling up cannot evict quota counters, nor a limits outage take the read model down
    # (docs/operations.md, "Redis roles").
    readmodel_redis_url: str | None = None
    limits_redis_url: str | None = None
    idempotency_redis_url: str | None = None
    # REDIS_CLUSTER=1: every role's URL is one node of a Redis Cluster (any; the rest are
    # discovered).
    redis_cluster: bool = False
    # For a rediss:// URL: REDIS_TLS_CA_FILE, REDIS_TLS_CERT_FILE, REDIS_TLS_KEY_FILE.
    redis_tls: TlsFiles = field(default_factory=TlsFiles)
    kafka_bootstrap: str | None = None
    key_pepper: bytes = DEV_KEY_PEPPER.encode()
    # During a pepper rotation, the pepper keys created before it were hashed with: a key
    # that does not match under the current pepper is looked up under this one too.
    key_pepper_previous: bytes | None = None
    cache_salt_key: bytes = DEV_CACHE_SALT_KEY.encode()
    environment: str = "development"
    upstream: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    pool: PoolLimits = field(default_factory=PoolLimits)
    # The shared Redis client (read model, idempotency, last-used stamps): every call is
    # bounded by this, with one immediate retry and no backoff (docs/design.md §8 fallbacks answer
    # fast).
    redis_timeout_s: float = 1.0
    # Its pool blocks (up to redis_timeout_s) for a free connection past this many.
    redis_max_connections: int = 100
    max_body_bytes: int = 1 << 20
    # Slow or greedy clients: a request head must be complete this long after the
    # connection (or the head's first byte), the body must arrive within body_timeout_s, and
    # no response streams longer than max_stream_s. Past limit_concurrency connections and
    # requests per process uvicorn answers 503; one tenant holds at most
    # tenant_max_concurrent requests per process (429 past it).
    # /metrics and /readyz's details need "Authorization: Bearer <metrics_token>" when it is
    # set; in production without one /metrics is not served at all (tenants' ids and
    # volumes are nobody else's business) and /readyz says ready or not, nothing more.
    metrics_token: str | None = None
    # A second listener for /metrics, /readyz (with its details) and /healthz, on the API's
    # host: with it set, the API port serves no /metrics and no readiness details at all.
    # The token still applies there when set; without one that listener serves them even
    # in production (the port is the boundary: keep it off the load balancer).
    metrics_port: int | None = None
    # Tenants with their own series in the request counter (the rest count as "other").
    metrics_tenant_labels: int = 1000
    # Answer a tenant+model refused on requests/min from memory until that limit frees
    # (before parsing the body or asking the limits store), while the store answered this
    # process within the last second (so an outage still fails requests/min open for it).
    refusal_memory: bool = True
    # Streams ask the replica for ``stream_options.continuous_usage_stats``: every chunk
    # carries the replica's running counts, kept by the relay and stripped before the
    # client sees them, so a stream cut off before its usage chunk bills exact counts.
    continuous_usage: bool = True
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_stream_s: float = 900.0
    limit_concurrency: int = 10_000
    tenant_max_concurrent: int = 1_000
    spool_dir: Path = Path("var/spool")
    # The spool is reported degraded while usage events wait unwritten (the disk refuses
    # them) longer than this, or while more than spool_unhealthy_events of them wait; the
    # process serves on and holds them in memory. Past spool_max_unwritten_events (about
    # 1 KiB each) it is not ready: its memory is at risk, so the balancer sends traffic
    # elsewhere until the disk takes the backlog.
    spool_unhealthy_s: float = 5.0
    spool_unhealthy_events: int = 10_000
    spool_max_unwritten_events: int = 200_000
    # A spool segment past this size is closed and a new one started.
    spool_segment_bytes: int = 64 << 20
    usage_topic: str = "usage.v1"
    drain_deadline_s: float = 30.0
    scrape_interval_s: float = 0.25
    scrape_timeout_s: float = 1.0
    # Consecutive failed scrapes before a replica leaves the routing set.
    scrape_failures_unhealthy: int = 3
    idempotency_ttl_s: int = 24 * 3600
    # How long an in-flight idempotency claim survives a crashed gateway.
    idempotency_inflight_ttl_s: int = 900
    # A claim refused before anything was generated keeps its tombstone only this long.
    idempotency_refused_ttl_s: int = 60
    # Per tenant, per record lifetime (idempotency_ttl_s): new records, and response bytes
    # stored (compressed). Past the first, new keys get 429; past the second, responses are
    # not kept for replay.
    idempotency_max_records: int = 100_000
    idempotency_max_bytes: int = 256 << 20
    last_used_flush_s: float = 5.0
    # A cached key or tenant is trusted this long while the change channel is subscribed;
    # the channel drops entries at once, this only bounds drift if a message is lost.
    cache_ttl_s: float = 30.0
    # Refreshing an expired entry (the TTL above ran out; nothing announced a change) waits
    # at most this long for Redis before the last known record answers (docs/design.md §8,
    # stale-if-error).
    stale_refresh_timeout_s: float = 0.25
    # While the change channel is down, entries are re-read this often (revocation < 1 s).
    cache_ttl_unsubscribed_s: float = 0.5
    # In-process key/tenant caches: records and remembered-unknown identifiers are LRUs of
    # at most this many entries each (unknown ones apart, so they cannot evict records).
    auth_cache_max_entries: int = 100_000
    auth_negative_cache_max: int = 10_000
    # Failed authentications per client address: a bucket of this many, refilled at this
    # rate; past it the address gets 429 with Retry-After and no store lookup. The map of
    # addresses is an LRU of at most auth_failure_addresses entries.
    auth_failure_burst: int = 20
    auth_failure_per_s: float = 2.0
    auth_failure_addresses: int = 10_000
    # Keys without the checksum (minted before it existed) are still looked up. Turn off
    # once every such key has been rotated: then a malformed key never reaches the store.
    legacy_api_keys: bool = True
    # Seconds between checks of the read-model version (catches missed pub/sub messages).
    version_poll_s: float = 1.0
    # Admission and fairness knobs (GATEWAY_ADMISSION_*; see gateway/README.md).
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # The limits store's own timeout: past it, the fallback of docs/design.md §8 decides
    # (fail open / closed).
    admission_redis_timeout_s: float = 0.5
    # Cache-aware routing (strategy cache_aware): the replicas' KV block size, the prefix
    # index's bound per replica and its entries' lifetime, and replicas' KV-event endpoints.
    prefix_block_size: int = 16
    prefix_max_blocks: int = 2048
    prefix_index_blocks: int = 200_000
    prefix_index_ttl_s: float = 600.0
    prefix_kv_events: Mapping[str, str] = field(default_factory=dict)
    # The replicas' block hash scheme (``contracts.blockhash.get_hasher``: emulator, sha256,
    # sha256_cbor) and, for vLLM's, their PYTHONHASHSEED (None: unset there, and vLLM >= 0.33
    # then derives the first block's parent from a fixed seed, which get_hasher uses too).
    prefix_hash: str = "emulator"
    prefix_hash_seed: str | None = None
    # GATEWAY_TOKENIZER_FILES: a model version's (or family's) own tokenizer.json, loaded
    # at start; its prompts are counted exactly (admission/tokens.py). Others: the rule.
    # GATEWAY_CHAT_TEMPLATES adds such a model's chat template: a TemplateCounter, whose
    # prompt token ids are the replicas' (admission/chat_template.py), counted and hashed.
    token_counters: Mapping[str, ExactCounter] = field(default_factory=dict)
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex}")

    def redis_urls(self) -> dict[str, str]:
        """The Redis URL of each role: ``readmodel``, ``limits``, ``idempotency``."""
        return {
            "readmodel": self.readmodel_redis_url or self.redis_url,
            "limits": self.limits_redis_url or self.redis_url,
            "idempotency": self.idempotency_redis_url or self.redis_url,
        }

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
            problems = _production_problems(env, pepper, salt_key)
            if problems:
                raise ConfigError("production refuses to start: " + "; ".join(problems))
        kv_events = _endpoints(env.get("GATEWAY_PREFIX_KV_EVENTS", ""))
        prefix_hash = env.get("GATEWAY_PREFIX_HASH", "").strip() or "emulator"
        prefix_seed = env.get("GATEWAY_PREFIX_HASH_SEED") or None
        if prefix_hash not in HASH_ALGOS:
            raise ConfigError(f"GATEWAY_PREFIX_HASH must be one of {', '.join(HASH_ALGOS)}")
        if prefix_seed is not None and not _valid_hash_seed(prefix_seed):
            # it is the replicas' PYTHONHASHSEED too: Python refuses any other value at start,
            # so a fleet given it would not run, and the gateway would hash for nobody
            raise ConfigError(
                "GATEWAY_PREFIX_HASH_SEED must be 'random' or an integer in [0, 4294967295]"
                " (the replicas' PYTHONHASHSEED)"
            )
        config = cls(
            redis_url=env.get("REDIS_URL") or DEFAULT_REDIS_URL,
            readmodel_redis_url=env.get("READMODEL_REDIS_URL") or None,
            limits_redis_url=env.get("LIMITS_REDIS_URL") or None,
            idempotency_redis_url=env.get("IDEMPOTENCY_REDIS_URL") or None,
            redis_cluster=_flag(env, "REDIS_CLUSTER"),
            redis_tls=TlsFiles(
                ca_file=env.get("REDIS_TLS_CA_FILE") or None,
                cert_file=env.get("REDIS_TLS_CERT_FILE") or None,
                key_file=env.get("REDIS_TLS_KEY_FILE") or None,
            ),
            kafka_bootstrap=env.get("KAFKA_BOOTSTRAP") or None,
            key_pepper=(pepper or DEV_KEY_PEPPER).encode(),
            key_pepper_previous=env.get("FAIRWAY_KEY_PEPPER_PREVIOUS", "").encode() or None,
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
            metrics_token=env.get("GATEWAY_METRICS_TOKEN", "").strip() or None,
            metrics_port=_int(env, "GATEWAY_METRICS_PORT", 0) or None,
            metrics_tenant_labels=_int(env, "GATEWAY_METRICS_TENANT_LABELS", 1000),
            refusal_memory=env.get("GATEWAY_REFUSAL_MEMORY", "1").strip().lower()
            not in ("0", "false", "no", "off"),
            continuous_usage=env.get("GATEWAY_CONTINUOUS_USAGE", "1").strip().lower()
            not in ("0", "false", "no", "off"),
            header_timeout_s=_float(env, "GATEWAY_HEADER_TIMEOUT_S", 10.0),
            body_timeout_s=_float(env, "GATEWAY_BODY_TIMEOUT_S", 30.0),
            max_stream_s=_float(env, "GATEWAY_MAX_STREAM_S", 900.0),
            limit_concurrency=_int(env, "GATEWAY_LIMIT_CONCURRENCY", 10_000),
            tenant_max_concurrent=_int(env, "GATEWAY_TENANT_MAX_CONCURRENT", 1_000),
            spool_dir=Path(env.get("GATEWAY_SPOOL_DIR") or "var/spool"),
            spool_unhealthy_s=_float(env, "GATEWAY_SPOOL_UNHEALTHY_S", 5.0),
            spool_unhealthy_events=_int(env, "GATEWAY_SPOOL_UNHEALTHY_EVENTS", 10_000),
            spool_max_unwritten_events=_int(env, "GATEWAY_SPOOL_MAX_UNWRITTEN_EVENTS", 200_000),
            spool_segment_bytes=_int(env, "GATEWAY_SPOOL_SEGMENT_BYTES", 64 << 20),
            usage_topic=env.get("GATEWAY_USAGE_TOPIC") or "usage.v1",
            drain_deadline_s=_float(env, "GATEWAY_DRAIN_DEADLINE_S", 30.0),
            scrape_interval_s=_float(env, "GATEWAY_SCRAPE_INTERVAL_S", 0.25),
            idempotency_ttl_s=_int(env, "GATEWAY_IDEMPOTENCY_TTL_S", 24 * 3600),
            idempotency_refused_ttl_s=_int(env, "GATEWAY_IDEMPOTENCY_REFUSED_TTL_S", 60),
            idempotency_max_records=_int(env, "GATEWAY_IDEMPOTENCY_MAX_RECORDS", 100_000),
            idempotency_max_bytes=_int(env, "GATEWAY_IDEMPOTENCY_MAX_BYTES", 256 << 20),
            last_used_flush_s=_float(env, "GATEWAY_LAST_USED_FLUSH_S", 5.0),
            auth_cache_max_entries=_int(env, "GATEWAY_AUTH_CACHE_MAX_ENTRIES", 100_000),
            auth_negative_cache_max=_int(env, "GATEWAY_AUTH_NEGATIVE_CACHE_MAX", 10_000),
            auth_failure_burst=_int(env, "GATEWAY_AUTH_FAILURE_BURST", 20),
            auth_failure_per_s=_float(env, "GATEWAY_AUTH_FAILURE_PER_S", 2.0),
            auth_failure_addresses=_int(env, "GATEWAY_AUTH_FAILURE_ADDRESSES", 10_000),
            legacy_api_keys=env.get("GATEWAY_LEGACY_API_KEYS", "1").strip().lower()
            not in ("0", "false", "no", "off"),
            admission=_admission(env, kv_events),
            admission_redis_timeout_s=_float(env, "GATEWAY_ADMISSION_REDIS_TIMEOUT_S", 0.5),
            prefix_block_size=_int(env, "GATEWAY_PREFIX_BLOCK_SIZE", 16),
            prefix_max_blocks=_int(env, "GATEWAY_PREFIX_MAX_BLOCKS", 2048),
            prefix_index_blocks=_int(env, "GATEWAY_PREFIX_INDEX_BLOCKS", 200_000),
            prefix_index_ttl_s=_float(env, "GATEWAY_PREFIX_INDEX_TTL_S", 600.0),
            prefix_kv_events=kv_events,
            prefix_hash=prefix_hash,
            prefix_hash_seed=prefix_seed,
            token_counters=_token_counters(
                env.get("GATEWAY_TOKENIZER_FILES", ""), env.get("GATEWAY_CHAT_TEMPLATES", "")
            ),
        )
        if config.admission.long_context_hold_s >= config.max_stream_s:
            # a held request's whole life counts against max_stream_s (the exchange's
            # deadline is what is left of it after the hold)
            raise ConfigError(
                "GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S must be under GATEWAY_MAX_STREAM_S"
            )
        return config

    def token_counter(self, version: str, family: str) -> ExactCounter | None:
        """The model's own tokenizer, configured by version or by family, or None."""
        return self.token_counters.get(version) or self.token_counters.get(family)


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _valid_hash_seed(seed: str) -> bool:
    """A value Python accepts as PYTHONHASHSEED: ``random`` or an integer in [0, 2**32 - 1]."""
    if seed == "random":
        return True
    return seed.isascii() and seed.isdigit() and int(seed) <= 4_294_967_295


def _endpoints(raw: str) -> dict[str, str]:
    try:
        return parse_endpoints(raw)
    except ValueError as exc:
        raise ConfigError(f"GATEWAY_PREFIX_KV_EVENTS: {exc}") from exc


def _model_paths(name: str, raw: str) -> dict[str, str]:
    """``{"model": "/path", ...}`` or ``model=/path,model2=/path2`` (setting ``name``)."""
    try:
        return model_paths(name, raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _token_counters(raw: str, templates: str = "") -> dict[str, ExactCounter]:
    """GATEWAY_TOKENIZER_FILES (``_model_paths``), and GATEWAY_CHAT_TEMPLATES: the same
    models' ``tokenizer_config.json`` (their chat template). Every file is loaded now, and
    every template renders a probe conversation, so a missing or unusable one stops the
    gateway at start."""
    name = "GATEWAY_TOKENIZER_FILES"
    counters: dict[str, ExactCounter] = {}
    for model, path in _model_paths(name, raw).items():
        try:
            counters[model] = ExactCounter.from_file(Path(path))
        except ValueError as exc:
            raise ConfigError(f"{name}: {model}: {exc}") from exc
    name = "GATEWAY_CHAT_TEMPLATES"
    for model, path in _model_paths(name, templates).items():
        counter = counters.get(model)
        if counter is None:
            raise ConfigError(f"{name}: {model}: GATEWAY_TOKENIZER_FILES has no tokenizer for it")
        try:
            counters[model] = TemplateCounter.from_file(Path(path), counter.tokenizer)
        except ValueError as exc:
            raise ConfigError(f"{name}: {model}: {exc}") from exc
    return counters


def _admission(env: Mapping[str, str], kv_events: Mapping[str, str]) -> AdmissionConfig:
    try:
        admission = AdmissionConfig.from_env(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not env.get("GATEWAY_ADMISSION_AFFINITY_RENDEZVOUS", "").strip():
        # KV events show this process every replica's blocks, whoever placed them: a new
        # prefix needs no rendezvous for gateway processes to meet on it (P2C's draw)
        admission = replace(admission, affinity_rendezvous=not kv_events)
    return admission


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


def _production_problems(env: Mapping[str, str], pepper: str, salt_key: str) -> list[str]:
    """Everything production refuses, all at once (so one restart fixes them all)."""
    problems = [
        f"production requires {name}"
        for name, value in (("FAIRWAY_KEY_PEPPER", pepper), ("FAIRWAY_CACHE_SALT_KEY", salt_key))
        if not value
    ]
    if pepper == DEV_KEY_PEPPER or salt_key == DEV_CACHE_SALT_KEY:
        problems.append("production refuses the development pepper or salt key")
    short = [
        name
        for name, value in (
            ("FAIRWAY_KEY_PEPPER", pepper),
            ("FAIRWAY_CACHE_SALT_KEY", salt_key),
            ("FAIRWAY_KEY_PEPPER_PREVIOUS", env.get("FAIRWAY_KEY_PEPPER_PREVIOUS", "")),
        )
        if value and len(value.encode()) < MIN_SECRET_BYTES
    ]
    if short:
        problems.append(
            f"production requires at least {MIN_SECRET_BYTES} bytes in " + ", ".join(short)
        )
    # The implicit localhost Redis is a development convenience: in production it would be
    # a private, empty store (no keys, no limits shared with the other gateways).
    if not env.get("REDIS_URL"):
        problems.append("production requires REDIS_URL")
    problems.extend(
        f"{name} must be a redis://, rediss:// or unix:// URL"
        for name in ("REDIS_URL", *ROLE_URL_VARS)
        if env.get(name) and not is_redis_url(env[name])
    )
    # Without a broker usage events only pile up in the spool: requests served, never billed.
    if not env.get("KAFKA_BOOTSTRAP"):
        problems.append("production requires KAFKA_BOOTSTRAP (usage events are billed from it)")
    return problems
