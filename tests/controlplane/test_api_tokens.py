"""Management-API tokens (tenants.models.ApiToken): only a digest is stored, the token is
shown once by POST /api/v1/auth/token/, it authenticates as ``Token`` (and ``Bearer`` on the
usage reports), expires, is revoked by DELETE on the same URL or by its user's next tokens
beyond the cap, and reaches no other tenant than its user's."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import caches
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from contracts.schema import hash_api_key
from tenants import selectors, services
from tenants.models import ApiToken, Tenant

from .helpers import error_of

pytestmark = pytest.mark.django_db

TOKEN_URL = "/api/v1/auth/token/"
USAGE = "/api/v1/organization/usage/completions?start_time=0"


@pytest.fixture(autouse=True)
def _no_throttle_left_over() -> Any:
    keys = ["throttle_auth-token_127.0.0.1"]
    caches["throttle"].delete_many(keys)
    yield
    caches["throttle"].delete_many(keys)


def _obtain(username: str) -> Any:
    return APIClient().post(TOKEN_URL, {"username": username, "password": "pw-12345"})


def _client(scheme: str, token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
    return client


def test_the_table_holds_a_digest_and_a_prefix_never_the_token(owner_a: Any) -> None:
    response = _obtain(owner_a.username)
    assert response.status_code == 200 and list(response.json()) == ["token"]
    assert "no-store" in response["Cache-Control"]  # shown once: no cache keeps it
    secret = response.json()["token"]
    assert secret.startswith(services.API_TOKEN_PREFIX) and len(secret) > 40

    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM tenants_apitoken")
        columns = [c.name for c in cursor.description]
        rows = cursor.fetchall()
    assert len(rows) == 1
    row = dict(zip(columns, rows[0], strict=True))
    assert all(secret not in str(value) for value in row.values()), row
    assert row["token_hash"] == hash_api_key(secret, services.key_pepper())
    assert row["prefix"] == secret[:12] and row["user_id"] == owner_a.pk
    assert row["last_used_at"] is None


def test_every_obtain_issues_a_new_token_and_all_of_them_work(owner_a: Any) -> None:
    first, second = (_obtain(owner_a.username).json()["token"] for _ in range(2))
    assert first != second
    for token in (first, second):
        assert _client("Token", token).get("/api/v1/tenants/").status_code == 200


@pytest.mark.parametrize(("scheme", "path"), [("Token", "/api/v1/tenants/"), ("Bearer", USAGE)])
def test_token_and_bearer_schemes_authenticate(owner_a: Any, scheme: str, path: str) -> None:
    _, secret = services.api_token_create(user=owner_a)
    assert _client(scheme, secret).get(path).status_code == 200
    refused = _client(scheme, secret[:-1] + ("A" if secret[-1] != "A" else "B")).get(path)
    assert refused.status_code == 401
    assert error_of(refused)["message"] == "Invalid token."


def test_an_inactive_users_token_is_refused(owner_a: Any) -> None:
    _, secret = services.api_token_create(user=owner_a)
    owner_a.is_active = False
    owner_a.save(update_fields=["is_active"])
    refused = _client("Token", secret).get("/api/v1/tenants/")
    assert refused.status_code == 401
    assert error_of(refused)["message"] == "User inactive or deleted."


@pytest.mark.parametrize(("scheme", "path"), [("Token", "/api/v1/tenants/"), ("Bearer", USAGE)])
def test_tokens_expire_after_the_max_age(
    settings: Any, owner_a: Any, scheme: str, path: str
) -> None:
    settings.FAIRWAY_API_TOKEN_MAX_AGE_H = 2
    token, secret = services.api_token_create(user=owner_a)
    client = _client(scheme, secret)
    ApiToken.objects.filter(pk=token.pk).update(created_at=timezone.now() - timedelta(hours=1))
    assert client.get(path).status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(created_at=timezone.now() - timedelta(hours=2))
    expired = client.get(path)
    assert expired.status_code == 401 and error_of(expired)["code"] == "token_expired"


def test_expired_rows_are_deleted_by_the_next_obtain_and_the_hourly_task(
    owner_a: Any, make_user: Callable[..., Any]
) -> None:
    from tenants.tasks import api_tokens_expired_delete

    old = timezone.now() - timedelta(hours=25)
    mine, _ = services.api_token_create(user=owner_a)
    other_user = make_user("other")
    theirs, _ = services.api_token_create(user=other_user)
    live, _ = services.api_token_create(user=other_user)
    ApiToken.objects.filter(pk__in=[mine.pk, theirs.pk]).update(created_at=old)

    fresh, _ = services.api_token_create(user=owner_a)
    assert set(ApiToken.objects.values_list("pk", flat=True)) == {fresh.pk, theirs.pk, live.pk}
    assert api_tokens_expired_delete() == 1
    assert set(ApiToken.objects.values_list("pk", flat=True)) == {fresh.pk, live.pk}


def test_a_user_holds_at_most_the_cap_the_oldest_go_first(settings: Any, owner_a: Any) -> None:
    settings.FAIRWAY_API_TOKENS_PER_USER = 3
    secrets = [services.api_token_create(user=owner_a)[1] for _ in range(4)]
    assert ApiToken.objects.filter(user=owner_a).count() == 3
    assert _client("Token", secrets[0]).get("/api/v1/tenants/").status_code == 401
    for secret in secrets[1:]:
        assert _client("Token", secret).get("/api/v1/tenants/").status_code == 200


def test_delete_revokes_the_token_sent_and_all_revokes_every_one(
    owner_a: Any, make_user: Callable[..., Any]
) -> None:
    one, two, three = (services.api_token_create(user=owner_a)[1] for _ in range(3))
    _, someone_elses = services.api_token_create(user=make_user("someone"))

    revoked = _client("Token", one).delete(TOKEN_URL)
    assert revoked.status_code == 200 and revoked.json() == {"revoked": 1}
    assert _client("Token", one).get("/api/v1/tenants/").status_code == 401
    assert _client("Token", two).get("/api/v1/tenants/").status_code == 200

    every = _client("Bearer", two).delete(f"{TOKEN_URL}?all=true")
    assert every.status_code == 401  # Bearer is the usage reports' scheme only
    every = _client("Token", two).delete(f"{TOKEN_URL}?all=true")
    assert every.status_code == 200 and every.json() == {"revoked": 2}
    for token in (two, three):
        assert _client("Token", token).get("/api/v1/tenants/").status_code == 401
    # Another user's token is untouched.
    assert _client("Token", someone_elses).get("/api/v1/tenants/").status_code == 200
    assert selectors.api_token_for_secret(secret=someone_elses) is not None


def test_delete_needs_a_caller_and_a_token_or_all(owner_a: Any) -> None:
    assert APIClient().delete(TOKEN_URL).status_code == 401
    services.api_token_create(user=owner_a)
    session = APIClient()
    session.force_login(owner_a)
    refused = session.delete(TOKEN_URL)
    assert refused.status_code == 400 and error_of(refused)["param"] == "all"
    assert ApiToken.objects.filter(user=owner_a).count() == 1
    # force_login skips CSRF checks, as a same-site browser request would pass them.
    assert session.delete(f"{TOKEN_URL}?all=true").json() == {"revoked": 1}


def test_a_token_reaches_only_its_users_tenants(
    owner_a: Any, tenant_a: Tenant, tenant_b: Tenant
) -> None:
    _, secret = services.api_token_create(user=owner_a)
    by_token = _client("Token", secret)
    assert [t["id"] for t in by_token.get("/api/v1/tenants/").json()] == [str(tenant_a.id)]
    for path in (f"/api/v1/tenants/{tenant_b.id}/", f"/api/v1/tenants/{tenant_b.id}/keys/"):
        assert by_token.get(path).status_code == 404, path
    by_bearer = _client("Bearer", secret)
    assert by_bearer.get(f"{USAGE}&tenant_id={tenant_a.id}").status_code == 200
    assert by_bearer.get(f"{USAGE}&tenant_id={tenant_b.id}").status_code == 404


def test_last_used_is_stamped_after_commit_at_most_once_a_minute(
    owner_a: Any, django_capture_on_commit_callbacks: Any
) -> None:
    token, secret = services.api_token_create(user=owner_a)
    client = _client("Token", secret)
    with django_capture_on_commit_callbacks(execute=True) as stamps:
        assert client.get("/api/v1/tenants/").status_code == 200
    assert len(stamps) == 1
    token.refresh_from_db()
    first = token.last_used_at
    assert first is not None
    with django_capture_on_commit_callbacks(execute=True) as stamps:
        assert client.get("/api/v1/tenants/").status_code == 200
    assert stamps == []  # stamped less than a minute ago: no write at all

    # The service moves the stamp forward only past the resolution, never back.
    later = first + services.API_TOKEN_LAST_USED_RESOLUTION
    assert not services.api_token_last_used_record(token=token, at=later - timedelta(seconds=1))
    assert not services.api_token_last_used_record(token=token, at=first - timedelta(hours=1))
    assert services.api_token_last_used_record(token=token, at=later)
    token.refresh_from_db()
    assert token.last_used_at == later
