"""The gateway's read model: content, full rebuild, and pushes only after commit."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction

from bench.cluster import redis_url_with_db
from catalog import services as catalog_services
from catalog.models import ModelFamily, ModelVersion
from contracts import schema
from tenants import services
from tenants.demo import MODELS, PLANS, plan_limits
from tenants.models import Plan, Tenant
from tenants.readmodel import read_model
from tests.support import flushed_redis

from .helpers import subscribe, wait_for_change


def resolved(catalog: schema.Catalog, name: str) -> schema.ModelVersionRecord:
    """The version ``name`` (an alias or a pinned version) resolves to; it must resolve."""
    version = catalog.resolve(name)
    assert version is not None, name
    return version


def _push_config() -> str:
    out = io.StringIO()
    call_command("push_config", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_the_read_model_goes_to_its_own_redis_when_set(
    redis_url: str, settings: Any, tenant_a: Tenant
) -> None:
    """READMODEL_REDIS_URL set: the publisher writes there and nothing to REDIS_URL's DB."""
    settings.REDIS_URL = redis_url
    settings.READMODEL_REDIS_URL = redis_url_with_db(redis_url, 13)
    with flushed_redis(redis_url) as shared, flushed_redis(settings.READMODEL_REDIS_URL) as own:
        services.api_key_create(tenant=tenant_a, name="a1")
        assert "rebuilt" in _push_config()
        published = read_model().snapshot()
        assert published and all(own.get(k) == v for k, v in published.items())
        assert own.exists(schema.tenant_redis_key(str(tenant_a.id)), schema.VERSION_KEY) == 2
        assert list(shared.scan_iter(count=1000)) == []


@pytest.mark.django_db
def test_push_config_rebuilds_an_identical_read_model(
    rm: Any, tenant_a: Tenant, tenant_b: Tenant
) -> None:
    services.api_key_create(tenant=tenant_a, name="a1")
    services.api_key_create(tenant=tenant_b, name="b1", scopes=["models:read"])
    revoked, _ = services.api_key_create(tenant=tenant_b, name="b2")
    services.api_key_revoke(api_key=revoked)

    assert "rebuilt" in _push_config()
    first = rm.snapshot()
    version = rm.version()
    keys = [k for k in first if k.startswith(schema.key_redis_key(""))]
    assert len(keys) == 2 and schema.key_redis_key(revoked.key_hash) not in first
    assert len([k for k in first if k.startswith(schema.tenant_redis_key(""))]) == 2

    # Idempotent: nothing to change, no new version, nothing announced.
    assert "already up to date" in _push_config()
    assert rm.version() == version and rm.snapshot() == first

    # From an empty Redis, plus stale records that no longer exist in the database.
    rm.redis.delete(*first)
    rm.redis.set(schema.key_redis_key("f" * 64), b"{}")
    rm.redis.set(schema.tenant_redis_key("gone"), b"{}")
    pubsub = subscribe(rm.redis)
    try:
        _push_config()
        change = wait_for_change(pubsub, kind="all", ident="")
    finally:
        pubsub.close()
    assert rm.snapshot() == first
    assert change.version == rm.version() == version + 1


@pytest.mark.django_db
def test_tenant_record_embeds_plan_defaults_merged_with_overrides(
    rm: Any, tenant_a: Tenant, family_70b: ModelFamily, plans: dict[str, Plan]
) -> None:
    family_8b = catalog_services.family_upsert(name="llama-8b")
    services.plan_limit_set(
        plan=plans["standard"], family=family_8b, **plan_limits(PLANS[1], MODELS[1])
    )
    services.tenant_limit_set(tenant=tenant_a, family=family_70b, rpm=7, max_output=100)
    rm.rebuild()

    record = schema.load_tenant(rm.redis.get(schema.tenant_redis_key(str(tenant_a.id))))
    assert (record.name, record.plan, record.admission_class) == (
        "tenant-a",
        "standard",
        "standard",
    )
    assert set(record.limits) == {"llama-70b", "llama-8b"}
    default_70b = plan_limits(PLANS[1], MODELS[0])
    assert record.limits["llama-70b"] == schema.LimitRecord(
        **{**default_70b, "rpm": 7, "max_output": 100}
    )
    assert record.limits["llama-8b"] == schema.LimitRecord(**plan_limits(PLANS[1], MODELS[1]))


@pytest.mark.django_db
def test_reserved_floor_only_on_a_reserved_plan(
    rm: Any, tenant_b: Tenant, plans: dict[str, Plan], django_capture_on_commit_callbacks: Any
) -> None:
    tenant_key = schema.tenant_redis_key(str(tenant_b.id))
    with django_capture_on_commit_callbacks(execute=True):
        services.tenant_change_plan(tenant=tenant_b, plan=plans["enterprise"])
    assert schema.load_tenant(rm.redis.get(tenant_key)).limits["llama-70b"].reserved_kv > 0
    with django_capture_on_commit_callbacks(execute=True):
        services.tenant_change_plan(tenant=tenant_b, plan=plans["free"])
    record = schema.load_tenant(rm.redis.get(tenant_key))
    assert record.admission_class == "best_effort"
    assert record.limits["llama-70b"].reserved_kv == 0


@pytest.mark.django_db
def test_catalog_resolves_alias_to_current_version_and_keeps_pins(
    rm: Any, version_70b: ModelVersion, django_capture_on_commit_callbacks: Any
) -> None:
    demo = MODELS[0]
    with django_capture_on_commit_callbacks(execute=True):
        newer = catalog_services.version_upsert(
            family=version_70b.family,
            name="llama-70b-2026-09",
            context_length=demo.context_length,
            kv_bytes_per_token=demo.kv_bytes_per_token,
            tpot_target_ms=demo.tpot_target_ms,
            kv_capacity_tokens=demo.kv_capacity_tokens,
            price_prompt_per_mtok="0.5",
            price_cached_prompt_per_mtok="0.1",
            price_completion_per_mtok="0.7",
        )
        catalog_services.replica_upsert(
            version=newer, name="r70-new", base_url="http://127.0.0.1:9201", pool="reserved"
        )
    catalog = schema.load_catalog(rm.redis.get(schema.CATALOG_KEY))
    assert resolved(catalog, "llama-70b").version == version_70b.name
    assert resolved(catalog, version_70b.name).replicas == (
        schema.ReplicaRecord(replica_id="r70-a", base_url="http://127.0.0.1:9101", pool="shared"),
    )

    with django_capture_on_commit_callbacks(execute=True):
        catalog_services.version_make_current(version=newer)
    catalog = schema.load_catalog(rm.redis.get(schema.CATALOG_KEY))
    assert resolved(catalog, "llama-70b").version == "llama-70b-2026-09"
    assert resolved(catalog, "llama-70b").replicas[0].pool == "reserved"
    assert resolved(catalog, version_70b.name).version == version_70b.name  # pin kept
    assert resolved(catalog, "llama-70b").kv_capacity_tokens == 565_248
    # the replica profile's attention share, pushed with each version (0: not measured)
    assert resolved(catalog, version_70b.name).prefill_attention_share == 0.1043
    assert resolved(catalog, "llama-70b").prefill_attention_share == 0.0


@pytest.mark.django_db(transaction=True)
def test_side_effects_only_after_commit(rm: Any, plans: dict[str, Plan]) -> None:
    tenant = services.tenant_create(name="t-commit", plan=plans["free"])
    version = rm.version()

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        rolled_back, _ = services.api_key_create(tenant=tenant, name="never")
        services.tenant_set_suspended(tenant=tenant, suspended=True)
        raise Boom
    assert not rm.redis.exists(schema.key_redis_key(rolled_back.key_hash))
    assert rm.version() == version
    assert (
        schema.load_tenant(rm.redis.get(schema.tenant_redis_key(str(tenant.id)))).suspended is False
    )

    with transaction.atomic():
        committed, _ = services.api_key_create(tenant=tenant, name="kept")
        # Inside the transaction nothing is visible to gateways yet.
        assert not rm.redis.exists(schema.key_redis_key(committed.key_hash))
    assert rm.redis.exists(schema.key_redis_key(committed.key_hash))
    assert rm.version() == version + 1
