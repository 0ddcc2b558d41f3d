"""Constraints hold in the database itself, and the API turns bad input into 400s with field
errors (never a 500)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError, transaction
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from catalog.models import ModelFamily, ModelVersion
from tenants.models import Membership, PlanModelLimit, Role, Tenant, TenantModelLimit

from .helpers import error_of

pytestmark = pytest.mark.django_db

GOOD = {
    "rpm": 10,
    "tpm": 1000,
    "max_context": 4096,
    "max_output": 1024,
    "kv_seconds_cap": 100,
    "reserved_kv": 0,
}


@pytest.mark.parametrize(
    "bad",
    [
        {"rpm": -1},
        {"tpm": -1},
        {"max_context": -1},
        {"kv_seconds_cap": -5},
        {"reserved_kv": -1},
        {"max_context": 100, "max_output": 101},  # max_output > max_context
        {"kv_seconds_cap": 10, "reserved_kv": 11},  # floor above the cap
    ],
)
def test_database_rejects_invalid_limits(
    tenant_a: Tenant, family_70b: ModelFamily, bad: dict[str, int]
) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        TenantModelLimit.objects.create(tenant=tenant_a, family=family_70b, **{**GOOD, **bad})
    with pytest.raises(IntegrityError), transaction.atomic():
        PlanModelLimit.objects.create(plan=tenant_a.plan, family=family_70b, **{**GOOD, **bad})


def test_database_rejects_duplicates(
    tenant_a: Tenant, family_70b: ModelFamily, version_70b: ModelVersion
) -> None:
    TenantModelLimit.objects.create(tenant=tenant_a, family=family_70b, **GOOD)
    with pytest.raises(IntegrityError), transaction.atomic():
        TenantModelLimit.objects.create(tenant=tenant_a, family=family_70b, **GOOD)
    owner = tenant_a.memberships.get().user
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(tenant=tenant_a, user=owner, role=Role.MEMBER)
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.filter(tenant=tenant_a).update(role="superuser")
    with pytest.raises(IntegrityError), transaction.atomic():  # two current versions
        ModelVersion.objects.create(
            family=family_70b,
            name="llama-70b-2027-01",
            is_current=True,
            context_length=1,
            kv_bytes_per_token=1,
            tpot_target_ms=1,
            kv_capacity_tokens=1,
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "llama-70b", "rpm": -1}, "rpm"),
        ({"model": "llama-70b", "max_context": 100, "max_output": 200}, "max_output"),
        ({"model": "llama-70b", "max_output": 10**6}, "max_output"),  # above plan max_context
        ({"model": "llama-70b", "max_context": 10**6}, "max_context"),  # above the model's
        ({"model": "llama-70b", "reserved_kv": 5}, "reserved_kv"),  # not a reserved plan
        ({"model": "llama-70b", "tpm": 2**70}, "tpm"),
        ({"model": "llama-70b", "rpm": "many"}, "rpm"),
        ({"model": "gpt-9"}, "model"),  # unknown model
        ({"model": "llama-70b-2026-05"}, "model"),  # a version, not a family
        ({"rpm": 5}, "model"),
    ],
)
def test_limit_api_rejects_bad_input_with_field_errors(
    tenant_a: Tenant, operator: Any, client_for: Any, body: dict[str, Any], param: str
) -> None:
    response = client_for(operator).post(
        f"/api/v1/tenants/{tenant_a.id}/limits/", body, format="json"
    )
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["fields"]
    assert not TenantModelLimit.objects.filter(tenant=tenant_a).exists()


def test_limit_api_upserts_one_row_per_model(
    tenant_a: Tenant, operator: Any, client_for: Any
) -> None:
    client = client_for(operator)
    url = f"/api/v1/tenants/{tenant_a.id}/limits/"
    for rpm in (5, 6):
        assert (
            client.post(url, {"model": "llama-70b", "rpm": rpm}, format="json").json()["rpm"] == rpm
        )
    assert TenantModelLimit.objects.filter(tenant=tenant_a).count() == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": "k", "scopes": ["chat", "admin"]}, "scopes.1"),  # unknown scope
        ({"name": "k", "scopes": []}, "scopes"),
        ({"name": "k", "scopes": "chat"}, "scopes"),
        ({"name": "k", "scopes": ["chat", "chat"]}, "scopes"),
        ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "k", "expires_at": "soon"}, "expires_at"),
        ({"name": "x" * 101}, "name"),
        ({}, "name"),
    ],
)
def test_key_api_rejects_bad_input_with_field_errors(
    tenant_a: Tenant, owner_a: Any, client_for: Any, body: dict[str, Any], param: str
) -> None:
    response = client_for(owner_a).post(f"/api/v1/tenants/{tenant_a.id}/keys/", body, format="json")
    assert response.status_code == 400, response.content
    assert error_of(response)["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"null", b'"text"'])
def test_malformed_bodies_are_400(
    tenant_a: Tenant, owner_a: Any, client_for: Any, raw: bytes
) -> None:
    response = client_for(owner_a).post(
        f"/api/v1/tenants/{tenant_a.id}/keys/", raw, content_type="application/json"
    )
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


def test_unknown_api_paths_answer_json_404(owner_a: Any, client_for: Any) -> None:
    for url in ("/api/v1/nope/", "/api/v1/tenants/not-a-uuid/keys/"):
        response = client_for(owner_a).get(url)
        assert response.status_code == 404
        assert error_of(response)["code"] == "not_found"


def test_unknown_scope_message_names_it_and_the_known_ones(
    tenant_a: Tenant, owner_a: Any, client_for: Any
) -> None:
    response = client_for(owner_a).post(
        f"/api/v1/tenants/{tenant_a.id}/keys/", {"name": "k", "scopes": ["admin"]}, format="json"
    )
    error = error_of(response)
    assert error["code"] == "invalid_choice"
    assert 'Unknown scope "admin"; known: chat, models:read.' in error["message"]


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3)
    ),
    max_leaves=8,
)
LIMIT_KEYS = ["model", "rpm", "tpm", "max_context", "max_output", "kv_seconds_cap", "reserved_kv"]
KEY_KEYS = ["name", "scopes", "expires_at"]


@hyp_settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    limit_body=st.dictionaries(st.sampled_from(LIMIT_KEYS) | st.text(max_size=8), JSON, max_size=5),
    key_body=st.dictionaries(st.sampled_from(KEY_KEYS) | st.text(max_size=8), JSON, max_size=4),
)
def test_fuzzed_bodies_never_cause_a_server_error(
    tenant_a: Tenant,
    operator: Any,
    client_for: Any,
    limit_body: dict[str, Any],
    key_body: dict[str, Any],
) -> None:
    client = client_for(operator)
    for url, body in (
        (f"/api/v1/tenants/{tenant_a.id}/limits/", limit_body),
        (f"/api/v1/tenants/{tenant_a.id}/keys/", key_body),
        (f"/api/v1/tenants/{tenant_a.id}/", key_body),
    ):
        method = client.patch if url.endswith(f"{tenant_a.id}/") else client.post
        response = method(url, body, format="json")
        assert response.status_code < 500, (url, body, response.content)
        if response.status_code >= 400:
            error_of(response)


def test_override_for_a_family_without_plan_default_needs_every_limit(
    tenant_a: Tenant, operator: Any, client_for: Any
) -> None:
    from catalog import services as catalog_services

    catalog_services.family_upsert(name="llama-8b")
    url = f"/api/v1/tenants/{tenant_a.id}/limits/"
    client = client_for(operator)
    response = client.post(url, {"model": "llama-8b", "rpm": 5}, format="json")
    assert response.status_code == 400
    assert set(error_of(response)["fields"]) == {
        "tpm",
        "max_context",
        "max_output",
        "kv_seconds_cap",
    }
    response = client.post(url, {"model": "llama-8b", **GOOD}, format="json")
    assert response.status_code == 200 and response.json()["source"] == "override"
    assert {lim["model"] for lim in client.get(url).json()} == {"llama-70b", "llama-8b"}
