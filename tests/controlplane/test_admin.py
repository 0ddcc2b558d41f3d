"""Operator admin: the key hash is never shown, keys created there show the secret once,
and the revoke action reaches the read model."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.test import Client

from contracts import schema
from tenants import services
from tenants.models import ApiKey, Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_(make_user: Any) -> Client:
    client = Client()
    client.force_login(make_user("root", is_staff=True, is_superuser=True))
    return client


def test_admin_hides_hash_and_revokes(
    rm: Any, admin_client_: Client, tenant_a: Tenant, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        key, secret = services.api_key_create(tenant=tenant_a, name="ops")
    for url in ("/admin/tenants/apikey/", f"/admin/tenants/apikey/{key.pk}/change/"):
        page = admin_client_.get(url)
        assert page.status_code == 200
        assert key.key_hash.encode() not in page.content and secret.encode() not in page.content
        assert key.prefix.encode() in page.content

    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client_.post(
            "/admin/tenants/apikey/",
            {"action": "revoke", "_selected_action": [str(key.pk)]},
            follow=True,
        )
    assert response.status_code == 200
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert not rm.redis.exists(schema.key_redis_key(key.key_hash))


def test_admin_key_creation_shows_secret_once(
    rm: Any, admin_client_: Client, tenant_a: Tenant
) -> None:
    response = admin_client_.post(
        "/admin/tenants/apikey/add/",
        {
            "tenant": str(tenant_a.pk),
            "name": "from-admin",
            "scopes": '["chat"]',
            "expires_at_0": "",
            "expires_at_1": "",
        },
    )
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    created = ApiKey.objects.get(name="from-admin")
    found = re.search(rb'id="api-key-secret"[^>]*>(fw-[A-Za-z0-9_-]+)<', response.content)
    assert found is not None
    secret = found.group(1).decode()
    # Shown in this response only: in no message, so in no cookie or session.
    assert not [m for m in get_messages(response.wsgi_request) if secret in str(m)]
    assert all(secret not in c.value for c in response.cookies.values())
    assert created.key_hash == schema.hash_api_key(secret, services.key_pepper())
    assert created.scopes == ["chat"]
    assert (
        secret.encode()
        not in admin_client_.get(f"/admin/tenants/apikey/{created.pk}/change/").content
    )


def test_admin_pages_render(admin_client_: Client, tenant_a: Tenant) -> None:
    for url in (
        "/admin/tenants/tenant/",
        f"/admin/tenants/tenant/{tenant_a.pk}/change/",
        "/admin/tenants/plan/",
        "/admin/catalog/modelversion/",
        "/admin/catalog/modelfamily/",
        "/admin/catalog/replica/",
    ):
        assert admin_client_.get(url).status_code == 200, url
