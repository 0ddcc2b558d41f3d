"""API keys: secret shown once, only the hash stored, revocation pushed to every gateway."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.forms.models import model_to_dict
from django.utils import timezone

from contracts import schema
from tenants import services
from tenants.models import ApiKey, Tenant
from tenants.tasks import api_key_last_used_flush

from .helpers import subscribe, wait_for_change

pytestmark = pytest.mark.django_db


def test_create_returns_secret_once_and_stores_only_its_hash(
    rm: Any,
    tenant_a: Tenant,
    owner_a: Any,
    client_for: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = client_for(owner_a)
    url = f"/api/v1/tenants/{tenant_a.id}/keys/"
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(url, {"name": "ci", "scopes": ["chat"]}, format="json")
    assert response.status_code == 201, response.content
    assert response["Cache-Control"] == "no-store"
    body = response.json()
    secret = body["secret"]
    assert secret.startswith("fw-") and len(secret) >= 3 + 43  # >= 32 random bytes
    assert body["prefix"] == secret[:11] and body["scopes"] == ["chat"]

    key = ApiKey.objects.get(pk=body["id"])
    assert key.key_hash == schema.hash_api_key(secret, services.key_pepper())
    stored = " ".join(str(v) for v in model_to_dict(key).values()) + key.key_hash
    assert secret not in stored and secret[11:] not in stored

    for listed in (client.get(url).json()[0], client.get(f"{url}{key.pk}/").json()):
        assert "secret" not in listed and listed["id"] == str(key.pk)
        assert listed["status"] == "active"

    record = schema.load_key(rm.redis.get(schema.key_redis_key(key.key_hash)))
    assert record == schema.KeyRecord(
        key_id=str(key.pk), tenant_id=str(tenant_a.id), scopes=("chat",), expires_at=None
    )


def test_revocation_reaches_read_model_and_changes_channel(
    rm: Any,
    tenant_a: Tenant,
    owner_a: Any,
    client_for: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        key, _ = services.api_key_create(tenant=tenant_a, name="doomed")
    redis_key = schema.key_redis_key(key.key_hash)
    assert rm.redis.exists(redis_key)
    version_before = rm.version()
    pubsub = subscribe(rm.redis)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            response = client_for(owner_a).post(
                f"/api/v1/tenants/{tenant_a.id}/keys/{key.pk}/revoke/"
            )
        assert response.status_code == 200 and response.json()["status"] == "revoked"
        change = wait_for_change(pubsub, kind="key", ident=key.key_hash)
    finally:
        pubsub.close()
    assert not rm.redis.exists(redis_key)
    assert change.version == rm.version() > version_before


def test_revoke_is_idempotent(rm: Any, tenant_a: Tenant) -> None:
    key, _ = services.api_key_create(tenant=tenant_a, name="k")
    first = services.api_key_revoke(api_key=key).revoked_at
    assert services.api_key_revoke(api_key=key).revoked_at == first


def test_expiring_key_carries_redis_expiry_and_is_dropped_once_expired(
    rm: Any, tenant_a: Tenant, django_capture_on_commit_callbacks: Any
) -> None:
    expires = timezone.now() + timedelta(hours=1)
    with django_capture_on_commit_callbacks(execute=True):
        key, _ = services.api_key_create(tenant=tenant_a, name="temp", expires_at=expires)
    redis_key = schema.key_redis_key(key.key_hash)
    assert 3500 < rm.redis.ttl(redis_key) <= 3600
    assert schema.load_key(rm.redis.get(redis_key)).expires_at == int(expires.timestamp())

    ApiKey.objects.filter(pk=key.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1),
        created_at=timezone.now() - timedelta(days=1),
    )
    rm.rebuild()
    assert not rm.redis.exists(redis_key)


def test_suspending_a_tenant_removes_its_keys_until_resumed(
    rm: Any, tenant_a: Tenant, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        key, _ = services.api_key_create(tenant=tenant_a, name="k")
    redis_key = schema.key_redis_key(key.key_hash)
    tenant_key = schema.tenant_redis_key(str(tenant_a.id))
    with django_capture_on_commit_callbacks(execute=True):
        services.tenant_set_suspended(tenant=tenant_a, suspended=True)
    assert not rm.redis.exists(redis_key)
    assert schema.load_tenant(rm.redis.get(tenant_key)).suspended is True
    with django_capture_on_commit_callbacks(execute=True):
        services.tenant_set_suspended(tenant=tenant_a, suspended=False)
    assert rm.redis.exists(redis_key)
    assert schema.load_tenant(rm.redis.get(tenant_key)).suspended is False


def test_last_used_flush_moves_stamps_forward_only(rm: Any, tenant_a: Tenant) -> None:
    key, _ = services.api_key_create(tenant=tenant_a, name="k")
    stamp = int(timezone.now().timestamp())
    rm.redis.hset(schema.KEY_LAST_USED_HASH, mapping={str(key.pk): stamp, "junk": "x"})
    assert api_key_last_used_flush() == 1
    key.refresh_from_db()
    assert int(key.last_used_at.timestamp()) == stamp
    assert not rm.redis.exists(schema.KEY_LAST_USED_HASH)

    rm.redis.hset(schema.KEY_LAST_USED_HASH, str(key.pk), stamp - 600)  # a late, older batch
    assert api_key_last_used_flush() == 0
    key.refresh_from_db()
    assert int(key.last_used_at.timestamp()) == stamp
