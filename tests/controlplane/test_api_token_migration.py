"""DRF's plaintext tokens become digests (tenants/migrations/0005): every token issued
before keeps working (and expiring) as an ApiToken, DRF's table is dropped with its content
types, permissions and migration records. Run on the real PostgreSQL test database, migrating
the tenants app back one step, recreating DRF's table as its migrations left it, and forward
again."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from contracts.schema import hash_api_key
from tenants.models import ApiToken, ApiTokenScheme
from tenants.services import key_pepper

from .helpers import migrate_tenants

BEFORE = ("tenants", "0004_operate_permission")
# DRF's authtoken_token after its migrations 0001-0004 (rest_framework/authtoken/migrations).
DRF_TABLE = """
CREATE TABLE authtoken_token (
    key varchar(40) NOT NULL PRIMARY KEY,
    created timestamp with time zone NOT NULL,
    user_id integer NOT NULL UNIQUE
        REFERENCES auth_user (id) DEFERRABLE INITIALLY DEFERRED
)
"""


@pytest.fixture
def drf_tokens(transactional_db: None) -> Iterator[None]:
    migrate_tenants(BEFORE)
    try:
        with connection.cursor() as cursor:
            cursor.execute(DRF_TABLE)
            cursor.execute(
                "INSERT INTO django_migrations (app, name, applied) VALUES "
                "('authtoken', '0001_initial', now()), "
                "('authtoken', '0004_alter_tokenproxy_options', now())"
            )
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS authtoken_token")
            cursor.execute("DELETE FROM django_migrations WHERE app = 'authtoken'")
        migrate_tenants()  # whatever happened, the database ends on the latest state


def _tables() -> set[str]:
    return set(connection.introspection.table_names())


def test_drf_tokens_become_digests_and_keep_working(drf_tokens: None) -> None:
    assert "authtoken_token" in _tables() and "tenants_apitoken" not in _tables()
    users = get_user_model().objects
    fresh_user = users.create_user("scripted", password="pw-12345")
    stale_user = users.create_user("stale", password="pw-12345")
    fresh_key, stale_key = "0123456789abcdef" * 2 + "01234567", "fedcba9876543210" * 2 + "76543210"
    fresh_at = timezone.now() - timedelta(hours=1)
    stale_at = timezone.now() - timedelta(hours=30)
    with connection.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO authtoken_token (key, created, user_id) VALUES (%s, %s, %s)",
            [(fresh_key, fresh_at, fresh_user.pk), (stale_key, stale_at, stale_user.pk)],
        )
    # DRF's admin permission, granted to a group: it goes with DRF's content type.
    token_type = ContentType.objects.create(app_label="authtoken", model="tokenproxy")
    permission = Permission.objects.create(
        content_type=token_type, codename="view_tokenproxy", name="Can view Token"
    )
    group = Group.objects.create(name="account managers")
    group.permissions.add(permission)

    migrate_tenants()

    assert "authtoken_token" not in _tables()
    ContentType.objects.clear_cache()
    assert not ContentType.objects.filter(app_label="authtoken").exists()
    assert not Permission.objects.filter(pk=permission.pk).exists()
    assert Group.objects.filter(pk=group.pk).exists() and not group.permissions.exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_migrations WHERE app = 'authtoken'")
        assert cursor.fetchone() == (0,)
        cursor.execute("SELECT * FROM tenants_apitoken")
        rows = cursor.fetchall()
    assert len(rows) == 2
    assert not [v for row in rows for v in row for key in (fresh_key, stale_key) if key in str(v)]

    by_user = {t.user_id: t for t in ApiToken.objects.all()}
    for user, key, created in (
        (fresh_user, fresh_key, fresh_at),
        (stale_user, stale_key, stale_at),
    ):
        token = by_user[user.pk]
        assert token.token_hash == hash_api_key(key, key_pepper())
        assert token.prefix == key[:8] and token.created_at == created
        assert token.scheme == ApiTokenScheme.UNLABELLED  # tenants 0006: verified as stored

    # Issued tokens keep working, and expire when they would have.
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {fresh_key}")
    assert client.get("/api/v1/tenants/").status_code == 200
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {fresh_key}")
    assert client.get("/api/v1/organization/usage/completions?start_time=0").status_code != 401
    client.credentials(HTTP_AUTHORIZATION=f"Token {stale_key}")
    expired: Any = client.get("/api/v1/tenants/")
    assert expired.status_code == 401 and expired.json()["error"]["code"] == "token_expired"


def test_a_database_without_drf_tokens_migrates_too(drf_tokens: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE authtoken_token")
    migrate_tenants()
    assert "tenants_apitoken" in _tables() and not ApiToken.objects.exists()
