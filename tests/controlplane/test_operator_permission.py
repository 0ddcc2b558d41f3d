"""Operators are staff holding ``tenants.operate``: being staff is not enough for any operator
write, in the management API or the Django admin. A staff account without the permission
gets 403 on each operator endpoint and nothing is written or pushed to the read model; it
sees only the tenants it is a member of, like any customer. Tenant owners keep managing
their own tenant's keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission
from django.test import Client

from catalog.models import ModelVersion, Replica
from tenants import services
from tenants.demo import MODELS
from tenants.models import ApiKey, Membership, Role, Tenant, TenantModelLimit
from tenants.permissions import OPERATE, is_operator

from .conftest import grant
from .helpers import error_of

pytestmark = pytest.mark.django_db

LIMIT = {"model": "llama-70b", "rpm": 5}


def _operator_requests(tenant: Tenant) -> list[tuple[str, str, dict[str, Any] | None]]:
    base = f"/api/v1/tenants/{tenant.id}"
    return [
        ("post", "/api/v1/tenants/", {"name": "sneaky", "plan": "enterprise"}),
        ("patch", f"{base}/", {"plan": "enterprise"}),
        ("patch", f"{base}/", {"suspended": True}),
        ("patch", f"{base}/", {"name": "renamed", "plan": "enterprise"}),
        ("post", f"{base}/limits/", LIMIT),
        ("delete", f"{base}/limits/llama-70b/", None),
    ]


@pytest.fixture
def finance_staff(make_user: Callable[..., Any]) -> Any:
    """Finance: staff with every billing permission, and no operator's."""
    return grant(
        make_user("clerk", is_staff=True),
        "billing.view_reconciliation",
        "billing.manage_invoices",
    )


@pytest.fixture
def staff_owner(tenant_a: Tenant, owner_a: Any, make_user: Callable[..., Any]) -> Any:
    """A staff account that is also an owner of tenant A (its second, after ``owner_a``),
    without the operator's permission."""
    user = make_user("staff-owner", is_staff=True)
    services.membership_add(tenant=tenant_a, user=user, role=Role.OWNER)
    return user


@pytest.mark.parametrize("who", ["plain_staff", "finance_staff", "staff_owner", "owner_a"])
def test_operator_endpoints_refuse_everyone_but_operators(
    request: pytest.FixtureRequest,
    who: str,
    tenant_a: Tenant,
    client_for: Any,
    family_70b: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    user = request.getfixturevalue(who)
    services.tenant_limit_set(tenant=tenant_a, family=family_70b, rpm=7)
    before = (Tenant.objects.count(), TenantModelLimit.objects.get(tenant=tenant_a).rpm)
    client = client_for(user)
    with django_capture_on_commit_callbacks(execute=False) as pushes:
        for method, url, body in _operator_requests(tenant_a):
            response = getattr(client, method)(url, body, format="json")
            assert response.status_code == 403, (who, method, url, response.content)
            error = error_of(response)
            assert error["type"] == "permission_error"
            assert "tenants.operate" in error["message"]
    assert pushes == []  # nothing for the read model: nothing was written
    tenant_a.refresh_from_db()
    assert (tenant_a.name, tenant_a.plan.name, tenant_a.suspended_at) == (
        "tenant-a",
        "standard",
        None,
    )
    assert (Tenant.objects.count(), TenantModelLimit.objects.get(tenant=tenant_a).rpm) == before


def test_the_refusal_does_not_depend_on_the_tenant_id(
    tenant_a: Tenant, plain_staff: Any, client_for: Any
) -> None:
    # Checked before the tenant is looked up: an unknown id gets the same 403, so the answer
    # says nothing about which tenants exist.
    client = client_for(plain_staff)
    unknown = "00000000-0000-4000-8000-000000000000"
    for tenant_id in (tenant_a.id, unknown):
        response = client.post(f"/api/v1/tenants/{tenant_id}/limits/", LIMIT, format="json")
        assert response.status_code == 403


def test_operators_do_each_operator_write(
    tenant_a: Tenant,
    operator: Any,
    client_for: Any,
    make_user: Callable[..., Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = client_for(operator)
    base = f"/api/v1/tenants/{tenant_a.id}"
    make_user("new-owner")
    with django_capture_on_commit_callbacks(execute=False) as pushes:
        created = client.post(
            "/api/v1/tenants/", {"name": "new", "plan": "free", "owner": "new-owner"}, format="json"
        )
        assert created.status_code == 201, created.content
        assert created.json()["plan"] == "free"
        changed = client.patch(f"{base}/", {"plan": "free"}, format="json")
        assert changed.status_code == 200, changed.content
        suspended = client.patch(f"{base}/", {"suspended": True}, format="json")
        assert suspended.status_code == 200 and suspended.json()["suspended"] is True
        assert suspended.json()["role"] == "operator"
        response = client.post(f"{base}/limits/", LIMIT, format="json")
        assert response.status_code == 200 and response.json()["rpm"] == 5
        assert client.delete(f"{base}/limits/llama-70b/").status_code == 204
    assert pushes  # each write reaches the read model
    tenant_a.refresh_from_db()
    assert tenant_a.plan.name == "free" and tenant_a.suspended_at is not None
    assert not TenantModelLimit.objects.filter(tenant=tenant_a).exists()
    new = Tenant.objects.get(name="new")
    assert new.memberships.get().user.username == "new-owner"


def test_operators_manage_any_tenants_keys_and_members(
    tenant_a: Tenant, tenant_b: Tenant, operator: Any, client_for: Any
) -> None:
    client = client_for(operator)
    listed = client.get("/api/v1/tenants/").json()
    assert {t["id"] for t in listed} == {str(tenant_a.id), str(tenant_b.id)}
    for tenant in (tenant_a, tenant_b):
        base = f"/api/v1/tenants/{tenant.id}"
        key = client.post(f"{base}/keys/", {"name": "ops"}, format="json")
        assert key.status_code == 201
        assert client.post(f"{base}/keys/{key.json()['id']}/revoke/").status_code == 200
        assert client.get(f"{base}/members/").status_code == 200


def test_staff_without_the_permission_is_an_ordinary_user(
    tenant_a: Tenant,
    tenant_b: Tenant,
    plain_staff: Any,
    finance_staff: Any,
    client_for: Any,
) -> None:
    # Not a member of any tenant: every tenant is absent (404), as for any customer; nothing
    # is created, revoked or joined.
    key_b, _ = services.api_key_create(tenant=tenant_b, name="b-key")
    member_b = tenant_b.memberships.get()
    b = f"/api/v1/tenants/{tenant_b.id}"
    for user in (plain_staff, finance_staff):
        client = client_for(user)
        assert client.get("/api/v1/tenants/").json() == []
        for method, url, body in [
            ("get", f"{b}/", None),
            ("patch", f"{b}/", {"name": "mine"}),
            ("get", f"{b}/keys/", None),
            ("post", f"{b}/keys/", {"name": "x"}),
            ("post", f"{b}/keys/{key_b.pk}/revoke/", None),
            ("post", f"{b}/keys/{key_b.pk}/limits/", {"model": "llama-70b", "rpm": 1}),
            ("get", f"{b}/limits/", None),
            ("post", f"{b}/members/", {"user": user.username, "role": "owner"}),
            ("delete", f"{b}/members/{member_b.pk}/", None),
            ("get", f"{b}/invoices/", None),
            ("get", f"/api/v1/tenants/{tenant_b.id}/costs", None),
        ]:
            response = getattr(client, method)(url, body, format="json")
            assert response.status_code == 404, (user.username, method, url, response.content)
    key_b.refresh_from_db()
    assert key_b.revoked_at is None and not key_b.model_limits.exists()
    assert ApiKey.objects.filter(tenant=tenant_b).count() == 1
    assert list(Membership.objects.filter(tenant=tenant_b)) == [member_b]
    assert tenant_b.name == Tenant.objects.get(pk=tenant_b.pk).name == "tenant-b"


def test_a_staff_owner_still_manages_their_own_tenants_keys(
    tenant_a: Tenant, tenant_b: Tenant, staff_owner: Any, owner_a: Any, client_for: Any
) -> None:
    for user in (owner_a, staff_owner):
        client = client_for(user)
        base = f"/api/v1/tenants/{tenant_a.id}"
        assert [t["id"] for t in client.get("/api/v1/tenants/").json()] == [str(tenant_a.id)]
        created = client.post(f"{base}/keys/", {"name": f"{user.username}-key"}, format="json")
        assert created.status_code == 201
        key_id = created.json()["id"]
        limit = {"model": "llama-70b", "rpm": 3}
        assert client.post(f"{base}/keys/{key_id}/limits/", limit, format="json").status_code == 200
        assert client.post(f"{base}/keys/{key_id}/revoke/").status_code == 200
        renamed = client.patch(f"{base}/", {"name": "tenant-a"}, format="json")
        assert renamed.status_code == 200 and renamed.json()["role"] == "owner"
        # Still nothing of tenant B.
        assert client.get(f"/api/v1/tenants/{tenant_b.id}/keys/").status_code == 404
    assert ApiKey.objects.filter(tenant=tenant_a, revoked_at__isnull=False).count() == 2


def test_the_permission_through_a_group_superusers_and_inactive_accounts(
    tenant_a: Tenant, make_user: Callable[..., Any], client_for: Any
) -> None:
    group = Group.objects.create(name="operators")
    group.permissions.add(
        Permission.objects.get(content_type__app_label="tenants", codename="operate")
    )
    via_group = make_user("grouped", is_staff=True)
    via_group.groups.add(group)
    root = make_user("root", is_staff=True, is_superuser=True)
    granted_not_staff = grant(make_user("not-staff"), OPERATE)
    inactive = grant(make_user("gone", is_staff=True), OPERATE)
    inactive.is_active = False
    inactive.save()
    assert is_operator(via_group) and is_operator(root)
    assert not is_operator(granted_not_staff) and not is_operator(inactive)

    url = f"/api/v1/tenants/{tenant_a.id}/limits/"
    for user, expected in (
        (via_group, 200),
        (root, 200),
        (granted_not_staff, 403),
        (inactive, 403),
    ):
        assert client_for(user).post(url, LIMIT, format="json").status_code == expected


# -- the Django admin ---------------------------------------------------------------------

MODEL_PERMS = [
    f"{app}.{action}_{model}"
    for app, model in [
        ("tenants", "tenant"),
        ("tenants", "apikey"),
        ("tenants", "plan"),
        ("tenants", "membership"),
        ("tenants", "tenantmodellimit"),
        ("catalog", "modelversion"),
        ("catalog", "replica"),
    ]
    for action in ("view", "add", "change", "delete")
]


@pytest.fixture
def admin_as(make_user: Callable[..., Any]) -> Callable[..., Client]:
    """A Django test client signed in as a new staff account holding ``perms``."""

    def make(username: str, *perms: str) -> Client:
        client = Client()
        client.force_login(grant(make_user(username, is_staff=True), *perms))
        return client

    return make


@dataclass(frozen=True)
class Targets:
    """What the admin writes below aim at: tenant A, one of its keys, a second (not current)
    70B version and the 70B replica."""

    tenant: Tenant
    key: ApiKey
    spare: ModelVersion
    replica: Replica

    def written(self) -> list[bool]:
        """Which of admin_writes' four changes are in the database."""
        for row in (self.tenant, self.key, self.spare, self.replica):
            row.refresh_from_db()
        return [
            self.tenant.suspended_at is not None,
            self.key.revoked_at is not None,
            self.spare.is_current,
            not self.replica.is_enabled,
        ]


@pytest.fixture
def targets(tenant_a: Tenant, family_70b: Any) -> Targets:
    spare = ModelVersion.objects.get(name=MODELS[0].version)
    spare.pk, spare.name, spare.is_current = None, "llama-70b-spare", False
    spare.save()
    key, _ = services.api_key_create(tenant=tenant_a, name="a-key")
    return Targets(tenant_a, key, spare, Replica.objects.get(name="r70-a"))


def _actions(page: Any) -> set[str]:
    form = page.context["action_form"] if page.context and "action_form" in page.context else None
    return {name for name, _ in form.fields["action"].choices if name} if form else set()


def admin_writes(client: Client, targets: Targets) -> list[int]:
    """Suspend the tenant, revoke the key, make the spare version current (the three admin
    actions) and disable the replica (its change form): each answer's status."""
    statuses = [
        client.post(url, {"action": action, "_selected_action": [str(pk)]}).status_code
        for url, action, pk in (
            ("/admin/tenants/tenant/", "suspend", targets.tenant.pk),
            ("/admin/tenants/apikey/", "revoke", targets.key.pk),
            ("/admin/catalog/modelversion/", "make_current", targets.spare.pk),
        )
    ]
    replica = targets.replica
    disable = {  # is_enabled left out: unchecked
        "name": replica.name,
        "version": replica.version_id,
        "base_url": replica.base_url,
        "pool": replica.pool,
    }
    changed = client.post(f"/admin/catalog/replica/{replica.pk}/change/", disable)
    return [*statuses, changed.status_code]


def test_admin_writes_need_an_operator_whatever_the_model_permissions(
    targets: Targets, admin_as: Callable[..., Client], django_capture_on_commit_callbacks: Any
) -> None:
    client = admin_as("clerk", *MODEL_PERMS)
    tenant = targets.tenant
    # It reads every page ...
    page = client.get("/admin/tenants/tenant/")
    assert page.status_code == 200 and tenant.name.encode() in page.content
    assert _actions(page) == set()  # ... and is offered no action.
    for url in (
        f"/admin/tenants/tenant/{tenant.pk}/change/",
        f"/admin/tenants/apikey/{targets.key.pk}/change/",
        f"/admin/catalog/replica/{targets.replica.pk}/change/",
    ):
        assert client.get(url).status_code == 200, url
    assert _actions(client.get("/admin/tenants/apikey/")) == set()
    assert _actions(client.get("/admin/catalog/modelversion/")) == set()

    with django_capture_on_commit_callbacks(execute=False) as pushes:
        # Actions posted anyway do nothing; the change form is refused.
        assert admin_writes(client, targets)[-1] == 403
        # So are adding and deleting.
        assert client.get("/admin/tenants/tenant/add/").status_code == 403
        add_key = {"tenant": str(tenant.pk), "name": "sneaky", "scopes": '["chat"]'}
        assert client.post("/admin/tenants/apikey/add/", add_key).status_code == 403
        delete = client.post(f"/admin/tenants/tenant/{tenant.pk}/delete/", {"post": "yes"})
        assert delete.status_code == 403
    assert pushes == []
    assert targets.written() == [False] * 4
    assert not ApiKey.objects.filter(name="sneaky").exists()


def test_admin_operator_runs_the_actions_and_edits(
    targets: Targets, admin_as: Callable[..., Client], django_capture_on_commit_callbacks: Any
) -> None:
    client = admin_as("ops-admin", OPERATE, *MODEL_PERMS)
    assert {"suspend", "resume"} <= _actions(client.get("/admin/tenants/tenant/"))
    with django_capture_on_commit_callbacks(execute=False):
        assert admin_writes(client, targets) == [302] * 4
    assert targets.written() == [True] * 4


def test_the_operator_permission_alone_does_not_open_admin_writes(
    tenant_a: Tenant, admin_as: Callable[..., Client]
) -> None:
    # The operator's permission adds to Django's model permissions; it does not replace them.
    client = admin_as("ops-only", OPERATE, "tenants.view_tenant")
    assert client.get("/admin/tenants/tenant/").status_code == 200
    assert client.get(f"/admin/tenants/tenant/{tenant_a.pk}/delete/").status_code == 403
    assert client.get("/admin/tenants/tenant/add/").status_code == 403
