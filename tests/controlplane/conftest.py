"""Control-plane fixtures: real PostgreSQL (pytest-django), real Redis (the suite's
``redis_url``), plain fixtures for plans, models, tenants and users.

The read model lives under fixed Redis keys (fw:cfg:*), so each test that touches it starts
and ends by deleting fw:* keys in its Redis database (run with REDIS_URL=.../<db> to keep
concurrent runs apart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from rest_framework.test import APIClient

from catalog import services as catalog_services
from catalog.models import ModelFamily, ModelVersion
from tenants import services
from tenants.demo import MODELS, PLANS, plan_limits
from tenants.models import Plan, Role, Tenant
from tenants.readmodel import ReadModelPublisher, read_model


def _clear(client: redis.Redis) -> None:
    keys = list(client.scan_iter(match="fw:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def rm(redis_url: str, settings: Any) -> Iterator[ReadModelPublisher]:
    """The publisher the app uses, pointed at the suite's Redis, cleared around the test."""
    settings.REDIS_URL = settings.READMODEL_REDIS_URL = redis_url
    model = read_model()
    _clear(model.redis)
    yield model
    _clear(model.redis)


@pytest.fixture
def family_70b(db: None) -> ModelFamily:
    version = MODELS[0].upsert(make_current=True)
    family = version.family
    catalog_services.replica_upsert(version=version, name="r70-a", base_url="http://127.0.0.1:9101")
    return family


@pytest.fixture
def version_70b(family_70b: ModelFamily) -> ModelVersion:
    return ModelVersion.objects.get(name=MODELS[0].version)


@pytest.fixture
def plans(family_70b: ModelFamily) -> dict[str, Plan]:
    out = {}
    for demo in PLANS:
        plan = services.plan_create(name=demo.name, admission_class=demo.admission_class)
        services.plan_limit_set(plan=plan, family=family_70b, **plan_limits(demo, MODELS[0]))
        out[demo.name] = plan
    return out


@pytest.fixture
def make_user(db: None) -> Callable[..., Any]:
    def make(username: str, **extra: Any) -> Any:
        return get_user_model().objects.create_user(
            username=username, password="pw-12345", email=f"{username}@example.com", **extra
        )

    return make


@pytest.fixture
def tenant_a(plans: dict[str, Plan], make_user: Callable[..., Any]) -> Tenant:
    return services.tenant_create(
        name="tenant-a", plan=plans["standard"], owner=make_user("owner-a")
    )


@pytest.fixture
def tenant_b(plans: dict[str, Plan], make_user: Callable[..., Any]) -> Tenant:
    return services.tenant_create(
        name="tenant-b", plan=plans["enterprise"], owner=make_user("owner-b")
    )


@pytest.fixture
def member_of(make_user: Callable[..., Any]) -> Callable[[Tenant, str], Any]:
    """A new user holding ``role`` in ``tenant``."""

    def make(tenant: Tenant, role: str) -> Any:
        user = make_user(f"{role}-{tenant.name}")
        services.membership_add(tenant=tenant, user=user, role=role)
        return user

    return make


@pytest.fixture
def client_for() -> Callable[[Any], APIClient]:
    def make(user: Any) -> APIClient:
        client = APIClient()
        client.force_authenticate(user=user)
        return client

    return make


@pytest.fixture
def owner_a(tenant_a: Tenant) -> Any:
    return tenant_a.memberships.get(role=Role.OWNER).user


def grant(user: Any, *perms: str) -> Any:
    """``user`` holding each ``app_label.codename`` permission, reloaded (Django caches a
    user's permissions on the instance)."""
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label=app_label)
        )
    return type(user).objects.get(pk=user.pk)


@pytest.fixture
def operator(make_user: Callable[..., Any]) -> Any:
    """An operator: a staff account holding tenants.operate (tenants.permissions)."""
    return grant(make_user("operator", is_staff=True), "tenants.operate")


@pytest.fixture
def plain_staff(make_user: Callable[..., Any]) -> Any:
    """A staff account with no permission: it may sign in to the admin, and operates nothing."""
    return make_user("staff-only", is_staff=True)
