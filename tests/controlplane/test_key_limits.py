"""Per-key limits (inside the tenant's), model capabilities, and what the gateway is pushed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from django.core.exceptions import ValidationError

from catalog import services as catalog_services
from catalog.models import ModelFamily, ModelVersion
from contracts import schema
from tenants import selectors, services
from tenants.demo import MODELS, PLANS, plan_limits
from tenants.models import ApiKey, ApiKeyModelLimit, Role, Tenant

from .helpers import error_of, subscribe, wait_for_change

pytestmark = pytest.mark.django_db

STANDARD_70B = plan_limits(PLANS[1], MODELS[0])  # tenant_a's plan: rpm 600, tpm 1,000,000


@pytest.fixture
def key_a(tenant_a: Tenant) -> ApiKey:
    key, _ = services.api_key_create(tenant=tenant_a, name="ci")
    return key


def _url(tenant: Tenant, key: ApiKey, model: str = "") -> str:
    tail = f"{model}/" if model else ""
    return f"/api/v1/tenants/{tenant.id}/keys/{key.pk}/limits/{tail}"


def test_key_limits_must_fit_inside_the_tenant(
    key_a: ApiKey, family_70b: ModelFamily, tenant_a: Tenant
) -> None:
    with pytest.raises(ValidationError) as above:
        services.api_key_limit_set(
            api_key=key_a, family=family_70b, rpm=STANDARD_70B["rpm"] + 1, tpm=5
        )
    assert set(above.value.message_dict) == {"rpm"}
    assert str(STANDARD_70B["rpm"]) in above.value.message_dict["rpm"][0]
    with pytest.raises(ValidationError) as tpm:
        services.api_key_limit_set(api_key=key_a, family=family_70b, tpm=STANDARD_70B["tpm"] + 1)
    assert set(tpm.value.message_dict) == {"tpm"}
    with pytest.raises(ValidationError):
        services.api_key_limit_set(api_key=key_a, family=family_70b)  # nothing to set
    other = catalog_services.family_upsert(name="llama-8b")
    with pytest.raises(ValidationError) as no_access:
        services.api_key_limit_set(api_key=key_a, family=other, rpm=1)
    assert set(no_access.value.message_dict) == {"model"}
    assert not ApiKeyModelLimit.objects.exists()  # nothing half-written

    row = services.api_key_limit_set(
        api_key=key_a, family=family_70b, rpm=STANDARD_70B["rpm"], max_concurrency=3
    )
    assert (row.rpm, row.tpm, row.max_concurrency) == (STANDARD_70B["rpm"], None, 3)
    # Setting again replaces the row (a field not given is cleared, not kept).
    row = services.api_key_limit_set(api_key=key_a, family=family_70b, tpm=1000)
    assert (row.rpm, row.tpm, row.max_concurrency) == (None, 1000, None)
    assert ApiKeyModelLimit.objects.count() == 1

    services.api_key_revoke(api_key=key_a)
    with pytest.raises(ValidationError):
        services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=1)


def test_an_unlimited_tenant_dimension_allows_any_key_value(
    key_a: ApiKey, family_70b: ModelFamily, tenant_a: Tenant
) -> None:
    services.tenant_limit_set(tenant=tenant_a, family=family_70b, rpm=0)  # 0: unlimited
    row = services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=10**6)
    assert row.rpm == 10**6
    limit = selectors.api_key_limit_get(api_key=key_a, family="llama-70b")
    assert limit.effective_rpm == 10**6


def test_lowering_the_tenant_limit_makes_the_key_limit_the_minimum(
    rm: Any,
    key_a: ApiKey,
    family_70b: ModelFamily,
    tenant_a: Tenant,
    django_capture_on_commit_callbacks: Any,
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=500, tpm=900_000)
        services.tenant_limit_set(tenant=tenant_a, family=family_70b, rpm=100)
    limit = selectors.api_key_limit_get(api_key=key_a, family="llama-70b")
    assert (limit.rpm, limit.effective_rpm) == (500, 100)  # stored value kept, tenant binds
    assert (limit.tpm, limit.effective_tpm) == (900_000, 900_000)
    # The gateway gets both: the key's own value and the tenant's lower one.
    key_record = schema.load_key(rm.redis.get(schema.key_redis_key(key_a.key_hash)))
    tenant_record = schema.load_tenant(rm.redis.get(schema.tenant_redis_key(str(tenant_a.id))))
    assert key_record.limits["llama-70b"].rpm == 500
    assert tenant_record.limits["llama-70b"].rpm == 100
    # Raised again above the key's value: the key's own limit binds again.
    with django_capture_on_commit_callbacks(execute=True):
        services.tenant_limit_set(tenant=tenant_a, family=family_70b, rpm=STANDARD_70B["rpm"])
    assert selectors.api_key_limit_get(api_key=key_a, family="llama-70b").effective_rpm == 500


def test_push_carries_key_limits_and_announces_the_key(
    rm: Any, key_a: ApiKey, family_70b: ModelFamily, django_capture_on_commit_callbacks: Any
) -> None:
    redis_key = schema.key_redis_key(key_a.key_hash)
    rm.rebuild()
    assert schema.load_key(rm.redis.get(redis_key)).limits == {}
    pubsub = subscribe(rm.redis)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=5, max_concurrency=2)
        wait_for_change(pubsub, kind="key", ident=key_a.key_hash)
    finally:
        pubsub.close()
    record = schema.load_key(rm.redis.get(redis_key))
    assert record.limits == {"llama-70b": schema.KeyLimitRecord(rpm=5, tpm=0, max_concurrency=2)}
    assert orjson.loads(rm.redis.get(redis_key))["limits"] == {
        "llama-70b": {"rpm": 5, "tpm": 0, "max_concurrency": 2}
    }
    # A full rebuild produces the same bytes as the targeted push.
    before = rm.snapshot()
    assert rm.rebuild().changed == () and rm.snapshot() == before

    with django_capture_on_commit_callbacks(execute=True):
        assert services.api_key_limit_clear(api_key=key_a, family=family_70b)
    assert schema.load_key(rm.redis.get(redis_key)).limits == {}
    with django_capture_on_commit_callbacks(execute=True):
        services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=5)
        services.api_key_revoke(api_key=key_a)
    assert not rm.redis.exists(redis_key)


def test_old_records_load_with_the_new_fields_defaulted() -> None:
    key = schema.load_key(b'{"key_id":"k","tenant_id":"t","scopes":["chat"],"expires_at":null}')
    assert key.limits == {}
    catalog = schema.load_catalog(
        orjson.dumps(
            {
                "families": {"m": "m-1"},
                "versions": {
                    "m-1": {
                        "version": "m-1",
                        "family": "m",
                        "context_length": 10,
                        "kv_bytes_per_token": 1,
                        "tpot_target_ms": 50,
                        "kv_capacity_tokens": 100,
                        "replicas": [],
                    }
                },
                "schema": 1,
            }
        )
    )
    version = catalog.versions["m-1"]
    assert (version.supports_tools, version.max_n, version.max_top_logprobs) == (False, 1, 0)


def test_key_limit_api_roles_validation_and_isolation(
    key_a: ApiKey,
    family_70b: ModelFamily,
    tenant_a: Tenant,
    tenant_b: Tenant,
    owner_a: Any,
    member_of: Any,
    client_for: Any,
) -> None:
    owner = client_for(owner_a)
    response = owner.post(
        _url(tenant_a, key_a), {"model": "llama-70b", "rpm": 50, "tpm": 2000}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json() == {
        "model": "llama-70b",
        "rpm": 50,
        "tpm": 2000,
        "max_concurrency": None,
        "effective_rpm": 50,
        "effective_tpm": 2000,
    }
    assert [row["model"] for row in owner.get(_url(tenant_a, key_a)).json()] == ["llama-70b"]
    assert owner.get(_url(tenant_a, key_a, "llama-70b")).json()["rpm"] == 50

    for body, param in (
        ({"model": "llama-70b", "rpm": STANDARD_70B["rpm"] + 1}, "rpm"),
        ({"model": "llama-70b", "rpm": 0}, "rpm"),
        ({"model": "llama-70b", "max_concurrency": -1}, "max_concurrency"),
        ({"model": "nope", "rpm": 1}, "model"),
        ({"model": MODELS[0].version, "rpm": 1}, "model"),  # a version, not a family
    ):
        bad = owner.post(_url(tenant_a, key_a), body, format="json")
        assert bad.status_code == 400, (body, bad.content)
        assert error_of(bad)["param"] == param
    assert owner.get(_url(tenant_a, key_a, "llama-70b")).json()["rpm"] == 50  # unchanged

    admin = client_for(member_of(tenant_a, Role.ADMIN))
    assert admin.get(_url(tenant_a, key_a)).status_code == 200
    member = client_for(member_of(tenant_a, Role.MEMBER))
    assert member.get(_url(tenant_a, key_a)).status_code == 200  # reads, as on the console
    assert member.get(_url(tenant_a, key_a, "llama-70b")).json()["rpm"] == 50
    assert (
        member.post(_url(tenant_a, key_a), {"model": "llama-70b"}, format="json").status_code == 403
    )
    assert member.delete(_url(tenant_a, key_a, "llama-70b")).status_code == 403

    # Across tenants: another tenant's owner sees nothing, and a key of tenant B under
    # tenant A's URL (or the reverse) does not exist.
    owner_b = client_for(tenant_b.memberships.get(role=Role.OWNER).user)
    key_b, _ = services.api_key_create(tenant=tenant_b, name="b")
    assert owner_b.get(_url(tenant_a, key_a)).status_code == 404
    assert owner_b.post(_url(tenant_a, key_a), {"model": "llama-70b", "rpm": 1},
                        format="json").status_code == 404  # fmt: skip
    assert owner_b.get(_url(tenant_b, key_a)).status_code == 404
    assert owner.get(_url(tenant_a, key_b)).status_code == 404
    assert owner_b.delete(_url(tenant_b, key_a, "llama-70b")).status_code == 404
    assert ApiKeyModelLimit.objects.get(api_key=key_a).rpm == 50

    assert owner.delete(_url(tenant_a, key_a, "llama-70b")).status_code == 204
    assert owner.delete(_url(tenant_a, key_a, "llama-70b")).status_code == 404
    assert owner.get(_url(tenant_a, key_a)).json() == []


def test_capabilities_reach_the_catalog_api_and_the_read_model(
    rm: Any,
    version_70b: ModelVersion,
    owner_a: Any,
    client_for: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    with pytest.raises(ValidationError) as no_parser:
        catalog_services.version_upsert(
            family=version_70b.family, name=version_70b.name, supports_tools=True,
            tool_call_parser="",
        )  # fmt: skip
    assert set(no_parser.value.message_dict) == {"tool_call_parser"}
    with pytest.raises(ValidationError):
        catalog_services.version_upsert(
            family=version_70b.family, name=version_70b.name, supports_logprobs=False,
            max_top_logprobs=5,
        )  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        catalog_services.version_upsert(
            family=version_70b.family, name=version_70b.name, supports_tools=False, max_n=1
        )
    record = schema.load_catalog(rm.redis.get(schema.CATALOG_KEY)).resolve("llama-70b")
    assert record is not None and (record.supports_tools, record.max_n) == (False, 1)
    with django_capture_on_commit_callbacks(execute=True):
        catalog_services.version_upsert(
            family=version_70b.family, name=version_70b.name, **MODELS[0].capabilities()
        )
    record = schema.load_catalog(rm.redis.get(schema.CATALOG_KEY)).resolve("llama-70b")
    assert record is not None
    assert (record.supports_tools, record.tool_call_parser) == (True, "llama3_json")
    assert (record.supports_structured_output, record.max_n) == (True, 8)
    assert (record.supports_logprobs, record.max_top_logprobs) == (True, 20)
    listed = client_for(owner_a).get("/api/v1/models/").json()
    assert listed[0]["versions"][0]["capabilities"] == {
        "tools": True,
        "tool_call_parser": "llama3_json",
        "structured_output": True,
        "max_n": 8,
        "logprobs": True,
        "max_top_logprobs": 20,
    }
