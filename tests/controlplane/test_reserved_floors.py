"""The reserved-floor over-subscription check runs in the services, so the management API
and the console both refuse a plan or limit save that over-sells a reserved pool."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

from catalog import services as catalog_services
from catalog.models import ModelFamily, ModelVersion
from gateway.admission.classes import reserved_pool_replicas_needed
from gateway.admission.config import AdmissionConfig
from tenants import services
from tenants.floors import floor_problem, reserved_floors
from tenants.models import Plan, Tenant

pytestmark = pytest.mark.django_db


def _add_reserved_replicas(version: ModelVersion, count: int) -> None:
    for i in range(count):
        catalog_services.replica_upsert(
            version=version,
            name=f"r70-res-{i}",
            base_url=f"http://127.0.0.1:{9300 + i}",
            pool="reserved",
        )


def _needed(version: ModelVersion, floors: list[int]) -> int:
    kv_gib = version.kv_capacity_tokens * version.kv_bytes_per_token / 1024**3
    return reserved_pool_replicas_needed(floors, replica_kv_gib=kv_gib, cfg=AdmissionConfig())


def test_plan_change_that_oversells_the_reserved_pool_is_refused_and_rolled_back(
    tenant_a: Tenant, tenant_b: Tenant, plans: dict[str, Plan], version_70b: ModelVersion
) -> None:
    floors = reserved_floors()["llama-70b"]
    assert len(floors) == 1  # tenant_b, enterprise
    with pytest.raises(ValidationError) as caught:
        services.tenant_change_plan(tenant=tenant_a, plan=plans["enterprise"])
    assert "reserved_kv" in caught.value.message_dict
    assert "reserved-pool replicas" in caught.value.message_dict["reserved_kv"][0]
    tenant_a.refresh_from_db()
    assert tenant_a.plan == plans["standard"]

    # With a pool big enough for both floors, the same change goes through.
    _add_reserved_replicas(version_70b, _needed(version_70b, floors * 2))
    assert floor_problem("llama-70b", floors * 2) is None
    services.tenant_change_plan(tenant=tenant_a, plan=plans["enterprise"])
    tenant_a.refresh_from_db()
    assert tenant_a.plan == plans["enterprise"]


def test_raising_a_floor_is_refused_but_lowering_one_is_allowed_while_oversold(
    tenant_b: Tenant, family_70b: ModelFamily, version_70b: ModelVersion
) -> None:
    (floor,) = reserved_floors()["llama-70b"]
    assert floor_problem("llama-70b", [floor]) is not None  # no reserved pool at all
    with pytest.raises(ValidationError):
        services.tenant_limit_set(tenant=tenant_b, family=family_70b, reserved_kv=floor + 1)
    assert reserved_floors()["llama-70b"] == [floor]
    row = services.tenant_limit_set(tenant=tenant_b, family=family_70b, reserved_kv=floor // 2)
    assert row.reserved_kv == floor // 2
    # The same values again do not add floor either.
    services.tenant_limit_set(tenant=tenant_b, family=family_70b, reserved_kv=floor // 2)


def test_the_management_api_answers_400_on_reserved_kv(
    tenant_a: Tenant, tenant_b: Tenant, operator: Any, client_for: Any
) -> None:
    response = client_for(operator).patch(
        f"/api/v1/tenants/{tenant_a.id}/", {"plan": "enterprise"}, format="json"
    )
    assert response.status_code == 400, response.content
    body = response.json()
    assert "reserved" in str(body).lower()
    tenant_a.refresh_from_db()
    assert tenant_a.plan.name == "standard"
