"""Tenant isolation: another tenant's resources do not exist for you (404, not 403)."""

from __future__ import annotations

from typing import Any

import pytest

from tenants import services
from tenants.models import Tenant

from .helpers import error_of

pytestmark = pytest.mark.django_db


def test_user_of_tenant_a_gets_404_for_tenant_b(
    tenant_a: Tenant, tenant_b: Tenant, owner_a: Any, client_for: Any
) -> None:
    key_b, _ = services.api_key_create(tenant=tenant_b, name="b-key")
    member_b = tenant_b.memberships.get()
    key_a, _ = services.api_key_create(tenant=tenant_a, name="a-key")
    client = client_for(owner_a)
    b = f"/api/v1/tenants/{tenant_b.id}"
    a = f"/api/v1/tenants/{tenant_a.id}"

    attempts = [
        ("get", f"{b}/", None),
        ("patch", f"{b}/", {"name": "mine"}),
        ("get", f"{b}/keys/", None),
        ("post", f"{b}/keys/", {"name": "x"}),
        ("get", f"{b}/keys/{key_b.pk}/", None),
        ("post", f"{b}/keys/{key_b.pk}/revoke/", None),
        ("get", f"{b}/limits/", None),
        ("get", f"{b}/limits/llama-70b/", None),
        ("get", f"{b}/members/", None),
        ("post", f"{b}/members/", {"user": "owner-a", "role": "member"}),
        ("get", f"{b}/members/{member_b.pk}/", None),
        ("delete", f"{b}/members/{member_b.pk}/", None),
        # B's ids through A's own tenant URL must not resolve either.
        ("get", f"{a}/keys/{key_b.pk}/", None),
        ("post", f"{a}/keys/{key_b.pk}/revoke/", None),
        ("get", f"{a}/members/{member_b.pk}/", None),
    ]
    for method, url, body in attempts:
        response = getattr(client, method)(url, body, format="json")
        assert response.status_code == 404, (method, url, response.content)
        assert error_of(response)["type"] == "not_found_error"

    key_b.refresh_from_db()
    assert key_b.revoked_at is None
    assert tenant_b.memberships.count() == 1

    listed = client.get("/api/v1/tenants/").json()
    assert [t["id"] for t in listed] == [str(tenant_a.id)] and listed[0]["role"] == "owner"
    assert [k["id"] for k in client.get(f"{a}/keys/").json()] == [str(key_a.pk)]


def test_anonymous_callers_are_refused(tenant_a: Tenant) -> None:
    from rest_framework.test import APIClient

    response = APIClient().get(f"/api/v1/tenants/{tenant_a.id}/keys/")
    assert response.status_code == 401 and response["WWW-Authenticate"] == "Token"
    error = error_of(response)
    assert (error["type"], error["code"]) == ("authentication_error", "not_authenticated")


def test_operators_see_every_tenant(
    tenant_a: Tenant, tenant_b: Tenant, operator: Any, client_for: Any
) -> None:
    listed = client_for(operator).get("/api/v1/tenants/").json()
    assert {t["id"] for t in listed} == {str(tenant_a.id), str(tenant_b.id)}
