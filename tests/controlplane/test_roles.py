"""Role checks: owner/admin manage keys and members; member reads keys and limits; billing
sees neither keys, limits nor members (invoices only, served by billing/); only operators write
limits and plans; only owners touch the owner role; a tenant keeps at least one owner."""

from __future__ import annotations

from typing import Any

import pytest

from tenants import services
from tenants.models import Role, Tenant

from .helpers import error_of

pytestmark = pytest.mark.django_db

LIMIT = {"model": "llama-70b", "rpm": 5}


def _status(client: Any, method: str, url: str, body: Any = None) -> int:
    return int(getattr(client, method)(url, body, format="json").status_code)


@pytest.mark.parametrize(
    ("role", "read_keys", "write_keys", "read_limits", "manage_members"),
    [
        (Role.OWNER, 200, 201, 200, 200),
        (Role.ADMIN, 200, 201, 200, 200),
        (Role.MEMBER, 200, 403, 200, 403),
        (Role.BILLING, 403, 403, 403, 403),
    ],
)
def test_role_matrix(
    tenant_a: Tenant,
    member_of: Any,
    client_for: Any,
    role: str,
    read_keys: int,
    write_keys: int,
    read_limits: int,
    manage_members: int,
) -> None:
    user = (
        tenant_a.memberships.get(role=Role.OWNER).user
        if role == Role.OWNER
        else member_of(tenant_a, role)
    )
    client = client_for(user)
    base = f"/api/v1/tenants/{tenant_a.id}"
    key, _ = services.api_key_create(tenant=tenant_a, name="existing")

    assert _status(client, "get", f"{base}/keys/") == read_keys
    assert _status(client, "get", f"{base}/keys/{key.pk}/") == read_keys
    assert _status(client, "post", f"{base}/keys/", {"name": "new"}) == write_keys
    revoke = _status(client, "post", f"{base}/keys/{key.pk}/revoke/")
    assert revoke == (200 if write_keys == 201 else 403)
    key.refresh_from_db()
    assert (key.revoked_at is not None) == (revoke == 200)

    assert _status(client, "get", f"{base}/limits/") == read_limits
    assert _status(client, "get", f"{base}/members/") == manage_members
    # Every role sees its own tenant (billing needs it for invoices); nobody but operators
    # changes limits.
    assert _status(client, "get", f"{base}/") == 200
    assert _status(client, "post", f"{base}/limits/", LIMIT) == 403

    if write_keys == 403:
        response = client.post(f"{base}/keys/", {"name": "new"}, format="json")
        error = error_of(response)
        assert error["type"] == "permission_error" and role in error["message"]


def test_only_operators_write_limits_plans_and_suspension(
    tenant_a: Tenant, owner_a: Any, operator: Any, client_for: Any
) -> None:
    base = f"/api/v1/tenants/{tenant_a.id}"
    assert _status(client_for(owner_a), "patch", f"{base}/", {"plan": "enterprise"}) == 403
    assert _status(client_for(owner_a), "patch", f"{base}/", {"suspended": True}) == 403
    assert _status(client_for(owner_a), "patch", f"{base}/", {"name": "renamed"}) == 200

    as_operator = client_for(operator)
    response = as_operator.post(f"{base}/limits/", LIMIT, format="json")
    assert response.status_code == 200 and response.json()["rpm"] == 5
    assert response.json()["source"] == "override"
    assert _status(as_operator, "patch", f"{base}/", {"plan": "enterprise"}) == 200
    assert _status(as_operator, "delete", f"{base}/limits/llama-70b/") == 204
    assert client_for(owner_a).get(f"{base}/limits/llama-70b/").json()["source"] == "plan"
    assert _status(as_operator, "delete", f"{base}/limits/llama-70b/") == 404


def test_owner_role_rules(
    tenant_a: Tenant, owner_a: Any, member_of: Any, make_user: Any, client_for: Any
) -> None:
    admin = member_of(tenant_a, Role.ADMIN)
    make_user("newcomer")
    base = f"/api/v1/tenants/{tenant_a.id}/members/"
    owner_membership = tenant_a.memberships.get(user=owner_a)

    as_admin = client_for(admin)
    assert _status(as_admin, "post", base, {"user": "newcomer", "role": "owner"}) == 403
    assert _status(as_admin, "delete", f"{base}{owner_membership.pk}/") == 403
    response = as_admin.post(
        base, {"user": "newcomer@example.com", "role": "member"}, format="json"
    )
    assert response.status_code == 201 and response.json()["username"] == "newcomer"
    newcomer = response.json()["id"]
    assert _status(as_admin, "patch", f"{base}{newcomer}/", {"role": "owner"}) == 403
    assert _status(as_admin, "patch", f"{base}{newcomer}/", {"role": "billing"}) == 200

    as_owner = client_for(owner_a)
    response = as_owner.patch(f"{base}{owner_membership.pk}/", {"role": "admin"}, format="json")
    assert response.status_code == 400
    assert error_of(response)["param"] == "role"  # the last owner stays
    assert _status(as_owner, "delete", f"{base}{owner_membership.pk}/") == 400
    assert _status(as_owner, "patch", f"{base}{newcomer}/", {"role": "owner"}) == 200
    assert _status(as_owner, "patch", f"{base}{owner_membership.pk}/", {"role": "admin"}) == 200

    response = as_owner.post(base, {"user": "newcomer", "role": "member"}, format="json")
    assert response.status_code == 400  # already a member: a clear error, not a 500
    error = error_of(response)
    assert error["param"] is None and "already a member" in error["message"]
    assert _status(as_owner, "post", base, {"user": "nobody", "role": "member"}) == 400
