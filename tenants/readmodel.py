"""The gateway's read model in Redis: build records with contracts.schema, diff, write, announce.

Writes happen after the database transaction commits (see ``readmodel_hooks``), always
re-reading committed state, under one Redis lock so that two concurrent pushes cannot leave
an older state on top of a newer one. Only records whose bytes differ are written; every
write bumps ``VERSION_KEY`` and is announced on ``CHANGES_CHANNEL`` so gateways drop their
cached copies. A key is present only while it is usable: revoked, expired or suspended-tenant
keys are deleted (and a key with an expiry carries a Redis expiry, so it also vanishes on
time without a push).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import redis
from django.conf import settings
from django.db.models import Prefetch, Q
from django.utils import timezone

from catalog.models import ModelVersion, Replica
from contracts import schema
from contracts.publish import publish_change
from tenants.limits import effective_limits_for_tenants
from tenants.models import ApiKey, ApiKeyModelLimit, Tenant

log = logging.getLogger("fairway.readmodel")

LOCK_KEY = "fw:lock:cfg"
LOCK_TIMEOUT_S = 60
LOCK_WAIT_S = 30
KEY_PATTERN = schema.key_redis_key("*")
TENANT_PATTERN = schema.tenant_redis_key("*")


@dataclass(frozen=True, slots=True)
class Desired:
    """Wanted value for one Redis key; ``value`` None means the key must not exist."""

    value: bytes | None
    expires_at: int | None = None  # unix seconds


@dataclass(frozen=True, slots=True)
class PushResult:
    changed: tuple[str, ...]  # Redis keys written or deleted
    version: int | None  # new read-model version, None when nothing changed


# -- record builders (pure given rows) ----------------------------------------------------


def _unix(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def key_record(
    *,
    key_id: Any,
    tenant_id: Any,
    scopes: Iterable[str],
    expires_at: datetime | None,
    limits: dict[str, schema.KeyLimitRecord] | None = None,
) -> schema.KeyRecord:
    return schema.KeyRecord(
        key_id=str(key_id),
        tenant_id=str(tenant_id),
        scopes=tuple(sorted(scopes)),
        expires_at=_unix(expires_at),
        limits=dict(sorted((limits or {}).items())),
    )


def key_limits_by_key(key_ids: Iterable[Any]) -> dict[Any, dict[str, schema.KeyLimitRecord]]:
    """Each key's own limits per family (0: no key limit of that kind), in one query. The
    key's record carries them, so the gateway has the key's and the tenant's limits from
    the two records it already reads, and checks both in one admission round trip."""
    out: dict[Any, dict[str, schema.KeyLimitRecord]] = {}
    rows = ApiKeyModelLimit.objects.filter(api_key_id__in=list(key_ids)).values(
        "api_key_id", "family__name", "rpm", "tpm", "max_concurrency"
    )
    for row in rows:
        out.setdefault(row["api_key_id"], {})[row["family__name"]] = schema.KeyLimitRecord(
            rpm=row["rpm"] or 0, tpm=row["tpm"] or 0, max_concurrency=row["max_concurrency"] or 0
        )
    return out


def tenant_record(tenant: Tenant, limits: dict[str, Any]) -> schema.TenantRecord:
    return schema.TenantRecord(
        tenant_id=str(tenant.id),
        name=tenant.name,
        plan=tenant.plan.name,
        admission_class=tenant.plan.admission_class,
        suspended=tenant.is_suspended,
        limits={
            family: schema.LimitRecord(
                rpm=lim.rpm,
                tpm=lim.tpm,
                max_context=lim.max_context,
                max_output=lim.max_output,
                kv_seconds_cap=lim.kv_seconds_cap,
                reserved_kv=lim.reserved_kv,
            )
            for family, lim in limits.items()
        },
    )


def catalog_record() -> schema.Catalog:
    replicas = Prefetch(
        "replicas", queryset=Replica.objects.filter(is_enabled=True).order_by("name")
    )
    versions = list(
        ModelVersion.objects.filter(is_active=True)
        .select_related("family")
        .prefetch_related(replicas)
        .order_by("name")
    )
    families = {
        v.family.name: v.name for v in sorted(versions, key=lambda v: v.family.name) if v.is_current
    }
    records = {
        v.name: schema.ModelVersionRecord(
            version=v.name,
            family=v.family.name,
            context_length=v.context_length,
            kv_bytes_per_token=v.kv_bytes_per_token,
            tpot_target_ms=v.tpot_target_ms,
            kv_capacity_tokens=v.kv_capacity_tokens,
            prefill_tokens_per_s=float(v.prefill_tokens_per_s),
            ttft_target_ms=v.ttft_target_ms,
            prefill_attention_share=v.prefill_attention_share,
            supports_tools=v.supports_tools,
            tool_call_parser=v.tool_call_parser,
            supports_structured_output=v.supports_structured_output,
            max_n=v.max_n,
            supports_logprobs=v.supports_logprobs,
            max_top_logprobs=v.max_top_logprobs,
            replicas=tuple(
                schema.ReplicaRecord(replica_id=r.name, base_url=r.base_url, pool=r.pool)
                for r in v.replicas.all()
            ),
        )
        for v in versions
    }
    return schema.Catalog(families=families, versions=records)


# -- desired state from the database ------------------------------------------------------


def _usable_keys() -> Any:
    now = timezone.now()
    return ApiKey.objects.filter(revoked_at__isnull=True, tenant__suspended_at__isnull=True).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now)
    )


def desired_keys(
    *, key_hashes: Iterable[str] | None = None, tenant_id: Any = None
) -> dict[str, Desired]:
    """Desired key records; with filters, also the explicit absence of unusable keys."""
    wanted: dict[str, Desired] = {}
    scope = ApiKey.objects.all()
    if key_hashes is not None:
        hashes = list(key_hashes)
        scope = scope.filter(key_hash__in=hashes)
        wanted.update({schema.key_redis_key(h): Desired(None) for h in hashes})
    if tenant_id is not None:
        scope = scope.filter(tenant_id=tenant_id)
        wanted.update(
            {
                schema.key_redis_key(h): Desired(None)
                for h in scope.values_list("key_hash", flat=True)
            }
        )
    usable = (
        _usable_keys().filter(pk__in=scope.values("pk"))
        if (key_hashes is not None or tenant_id is not None)
        else _usable_keys()
    )
    rows = list(usable.values("id", "tenant_id", "key_hash", "scopes", "expires_at"))
    limits = key_limits_by_key(row["id"] for row in rows)
    for row in rows:
        record = key_record(
            key_id=row["id"],
            tenant_id=row["tenant_id"],
            scopes=row["scopes"],
            expires_at=row["expires_at"],
            limits=limits.get(row["id"]),
        )
        wanted[schema.key_redis_key(row["key_hash"])] = Desired(
            schema.dumps(record), record.expires_at
        )
    return wanted


def desired_tenants(*, tenant_ids: Iterable[Any] | None = None) -> dict[str, Desired]:
    wanted: dict[str, Desired] = {}
    tenants = Tenant.objects.select_related("plan").order_by("id")
    if tenant_ids is not None:
        ids = [str(t) for t in tenant_ids]
        wanted.update({schema.tenant_redis_key(t): Desired(None) for t in ids})
        tenants = tenants.filter(id__in=ids)
    tenants = list(tenants)
    limits = effective_limits_for_tenants(tenants)
    for tenant in tenants:
        record = tenant_record(tenant, limits[tenant.id])
        wanted[schema.tenant_redis_key(str(tenant.id))] = Desired(schema.dumps(record))
    return wanted


def desired_catalog() -> dict[str, Desired]:
    return {schema.CATALOG_KEY: Desired(schema.dumps(catalog_record()))}


def desired_all() -> dict[str, Desired]:
    return {**desired_catalog(), **desired_tenants(), **desired_keys()}


# -- the Redis side ------------------------------------------------------------------------


def text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _change_for(redis_key: str, version: int) -> schema.Change:
    if redis_key == schema.CATALOG_KEY:
        return schema.Change(kind="catalog", ident="", version=version)
    kind, _, ident = redis_key.removeprefix(schema.PREFIX).partition(":")
    if kind == "key":
        return schema.Change(kind="key", ident=ident, version=version)
    return schema.Change(kind="tenant", ident=ident, version=version)


class ReadModelPublisher:
    """Writes the read model to one Redis; one instance per Redis URL (see ``read_model``)."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self.cluster = isinstance(client, redis.RedisCluster)

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False) -> ReadModelPublisher:
        timeout = float(getattr(settings, "REDIS_SOCKET_TIMEOUT", 5.0))
        if cluster:
            node: Any = redis.RedisCluster.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
            return cls(node)
        return cls(
            redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        )

    def _mget(self, keys: list[str]) -> list[Any]:
        # On a cluster the records live in many slots: one MGET per slot.
        if self.cluster:
            return list(self.redis.mget_nonatomic(keys))  # type: ignore[attr-defined]
        return list(self.redis.mget(keys))

    # Targeted pushes re-read committed state for the named entities only.
    def push_keys(self, key_hashes: Iterable[str]) -> PushResult:
        hashes = sorted(set(key_hashes))
        return self._push(lambda: desired_keys(key_hashes=hashes))

    def push_tenant(self, tenant_id: Any) -> PushResult:
        # A tenant's suspension decides whether its keys are usable, so both move together.
        return self._push(
            lambda: {**desired_tenants(tenant_ids=[tenant_id]), **desired_keys(tenant_id=tenant_id)}
        )

    def push_plan(self, plan_id: Any) -> PushResult:
        def build() -> dict[str, Desired]:
            ids = list(Tenant.objects.filter(plan_id=plan_id).values_list("id", flat=True))
            return desired_tenants(tenant_ids=ids) if ids else {}

        return self._push(build)

    def push_catalog(self) -> PushResult:
        return self._push(desired_catalog)

    def rebuild(self) -> PushResult:
        """Make Redis equal to the database: write what differs, delete what is stale.

        Then mark the model loaded: gateways answer "retry" (503) rather than "revoked"
        (401) for unknown keys while the marker is absent (a restarted or flushed Redis).
        """
        result = self._push(desired_all, full=True)
        self.redis.set(schema.LOADED_KEY, str(int(time.time())))
        self.redis.delete(schema.REBUILD_REQUEST_KEY)
        return result

    def needs_rebuild(self) -> bool:
        """The marker is gone (store restarted, flushed, evicted) or a gateway asked."""
        return not self.redis.exists(schema.LOADED_KEY) or bool(
            self.redis.exists(schema.REBUILD_REQUEST_KEY)
        )

    def snapshot(self) -> dict[str, bytes]:
        """Every read-model record (not the version), for comparisons and debugging."""
        keys = [schema.CATALOG_KEY, *self._scan(KEY_PATTERN), *self._scan(TENANT_PATTERN)]
        values = self._mget(keys)
        return {
            k: v.encode() if isinstance(v, str) else v
            for k, v in zip(keys, values, strict=True)
            if v is not None
        }

    def version(self) -> int:
        raw = self.redis.get(schema.VERSION_KEY)
        return int(raw) if raw is not None else 0

    # -- internals -----------------------------------------------------------------------
    def _scan(self, pattern: str) -> list[str]:
        return sorted(text(k) for k in self.redis.scan_iter(match=pattern, count=1000))

    def _push(self, build: Any, *, full: bool = False) -> PushResult:
        with self.redis.lock(LOCK_KEY, timeout=LOCK_TIMEOUT_S, blocking_timeout=LOCK_WAIT_S):
            wanted: dict[str, Desired] = build()  # read the DB inside the lock: see module doc
            if full:
                stale = set(self._scan(KEY_PATTERN)) | set(self._scan(TENANT_PATTERN))
                for key in stale - wanted.keys():
                    wanted[key] = Desired(None)
            changed = self._diff(wanted)
            if not changed:
                return PushResult(changed=(), version=None)
            version = self._write(wanted, changed)
        self._announce(changed, version, full=full)
        log.info("read model v%s: %d record(s) changed", version, len(changed))
        return PushResult(changed=tuple(changed), version=version)

    def _diff(self, wanted: dict[str, Desired]) -> list[str]:
        keys = sorted(wanted)
        current = self._mget(keys) if keys else []
        return [k for k, cur in zip(keys, current, strict=True) if cur != wanted[k].value]

    def _write(self, wanted: dict[str, Desired], changed: list[str]) -> int:
        # One transaction on a single Redis; on a cluster (no MULTI across slots) the
        # records first, then the version: the announcement follows both (layout rule 3).
        pipe = self.redis.pipeline(transaction=not self.cluster)
        for key in changed:
            desired = wanted[key]
            if desired.value is None:
                pipe.delete(key)
            elif desired.expires_at is not None:
                pipe.set(key, desired.value, exat=desired.expires_at)
            else:
                pipe.set(key, desired.value)
        if self.cluster:
            pipe.execute()
            return int(self.redis.incr(schema.VERSION_KEY))
        pipe.incr(schema.VERSION_KEY)
        return int(pipe.execute()[-1])

    def _announce(self, changed: list[str], version: int, *, full: bool) -> None:
        if full:
            changes = [schema.Change(kind="all", ident="", version=version)]
        else:
            changes = [_change_for(key, version) for key in changed]
        if self.cluster:  # a cluster pipeline refuses PUBLISH: one call each (rule 4)
            for change in changes:
                publish_change(self.redis, change.kind, change.ident, change.version)
            return
        pipe = self.redis.pipeline(transaction=False)
        for change in changes:
            publish_change(pipe, change.kind, change.ident, change.version)
        pipe.execute()


@lru_cache(maxsize=4)
def _read_model_for(url: str, cluster: bool) -> ReadModelPublisher:
    return ReadModelPublisher.from_url(url, cluster=cluster)


def read_model() -> ReadModelPublisher:
    """The ReadModelPublisher for the configured READMODEL_REDIS_URL (cached per URL: tests
    switch URLs)."""
    return _read_model_for(
        settings.READMODEL_REDIS_URL, bool(getattr(settings, "REDIS_CLUSTER", False))
    )
