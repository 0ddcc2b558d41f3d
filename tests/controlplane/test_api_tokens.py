"""Management-API tokens (tenants.models.ApiToken): only a digest is stored, labelled apart
from API keys' digests, the token is shown once by POST /api/v1/auth/token/, it authenticates
as ``Token`` (and ``Bearer`` on the usage reports), expires, is revoked by DELETE on the same
URL, by its user's next tokens beyond the cap or by a change of its user's password, and
reaches no other tenant than its user's."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from datetime import timedelta
from hashlib import sha256
from typing import Any

import pytest
from django.core.cache import caches
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from contracts.schema import hash_api_key, hash_api_token
from tenants import selectors, services
from tenants.models import ApiToken, ApiTokenScheme, Tenant

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
    assert row["token_hash"] == hash_api_token(secret, services.key_pepper())
    assert row["token_hash"] != hash_api_key(secret, services.key_pepper())
    assert row["scheme"] == ApiTokenScheme.LABELLED
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


# -- digests: a label of their own ------------------------------------------------------


def test_a_token_digest_is_labelled_and_api_key_digests_are_unchanged() -> None:
    pepper, secret = b"a pepper", "fw-k1_the-same-plaintext"
    # The API keys' HMAC is the secret alone, as every issued key was stored (and as the
    # gateway computes it): pinned here, so a label cannot slip into it.
    assert hash_api_key(secret, pepper) == hmac.new(pepper, secret.encode(), sha256).hexdigest()
    labelled = hash_api_token(secret, pepper)
    assert labelled != hash_api_key(secret, pepper)
    assert labelled == hash_api_key("fairway/api-token\0" + secret, pepper)


def test_an_api_key_is_not_a_token_even_when_a_row_holds_its_digest(
    owner_a: Any, tenant_a: Tenant
) -> None:
    """A labelled row is looked up by the labelled HMAC only: the API keys' HMAC of whatever
    is presented never finds it."""
    _, key_secret = services.api_key_create(tenant=tenant_a, name="k")
    ApiToken.objects.create(
        user=owner_a,
        prefix="fw-",
        token_hash=hash_api_key(key_secret, services.key_pepper()),
        scheme=ApiTokenScheme.LABELLED,
    )
    assert _client("Token", key_secret).get("/api/v1/tenants/").status_code == 401


def test_unlabelled_tokens_issued_before_keep_working_under_their_own_scheme_only(
    owner_a: Any,
) -> None:
    secret = services.api_token_generate_secret()
    old = ApiToken.objects.create(
        user=owner_a,
        prefix=secret[:12],
        token_hash=services.api_token_hash_unlabelled(secret),
        scheme=ApiTokenScheme.UNLABELLED,
    )
    assert _client("Token", secret).get("/api/v1/tenants/").status_code == 200
    assert selectors.api_token_for_secret(secret=secret) == old
    # The scheme decides which digest a row is compared with, never both.
    ApiToken.objects.filter(pk=old.pk).update(scheme=ApiTokenScheme.LABELLED)
    assert _client("Token", secret).get("/api/v1/tenants/").status_code == 401
    ApiToken.objects.filter(pk=old.pk).update(
        token_hash=services.api_token_hash(secret), scheme=ApiTokenScheme.UNLABELLED
    )
    assert _client("Token", secret).get("/api/v1/tenants/").status_code == 401


# -- a password change revokes every token ------------------------------------------------

NEW_PASSWORD = "a-new-Secret-77"


def _signed_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _works(token: str) -> bool:
    return bool(_client("Token", token).get("/api/v1/tenants/").status_code == 200)


def test_a_console_password_change_revokes_the_tokens_and_signs_out_other_sessions(
    owner_a: Any,
    make_user: Callable[..., Any],
    django_capture_on_commit_callbacks: Any,
    caplog: Any,
) -> None:
    mine = [services.api_token_create(user=owner_a)[1] for _ in range(2)]
    _, theirs = services.api_token_create(user=make_user("someone"))
    here, elsewhere = _signed_in(owner_a), _signed_in(owner_a)
    form = {"old_password": "pw-12345", "new_password1": NEW_PASSWORD}

    wrong = here.post(
        "/password/", {**form, "old_password": "not-it", "new_password2": NEW_PASSWORD}
    )
    assert wrong.status_code == 200 and all(_works(token) for token in mine)

    caplog.set_level(logging.INFO, logger="tenants.services")
    with django_capture_on_commit_callbacks(execute=True):
        changed = here.post("/password/", {**form, "new_password2": NEW_PASSWORD})
    assert changed.status_code == 302 and changed["Location"] == "/password/done/"
    assert not any(_works(token) for token in mine)
    assert not ApiToken.objects.filter(user=owner_a).exists()
    assert _works(theirs)
    assert f"password of user {owner_a.pk} changed: 2 management-API token(s)" in caplog.text

    # This session is kept; the other one is signed out, in the console and on the API.
    assert here.get("/password/").status_code == 200
    assert elsewhere.get("/password/")["Location"].startswith("/login/")
    assert here.get("/api/v1/tenants/").status_code == 200
    assert elsewhere.get("/api/v1/tenants/").status_code == 401
    # New tokens are obtained with the new password only.
    assert _obtain(owner_a.username).status_code == 400
    obtained = APIClient().post(TOKEN_URL, {"username": owner_a.username, "password": NEW_PASSWORD})
    assert _works(obtained.json()["token"])


@pytest.mark.parametrize("usable", ["true", "false"])
def test_an_admin_setting_or_disabling_a_password_revokes_the_tokens(
    owner_a: Any, make_user: Callable[..., Any], usable: str
) -> None:
    _, secret = services.api_token_create(user=owner_a)
    admin_client = _signed_in(make_user("root", is_staff=True, is_superuser=True))
    form = {"usable_password": usable, "password1": NEW_PASSWORD, "password2": NEW_PASSWORD}
    # The admin page's two buttons: "set-password", or "unset-password" to disable it.
    form["unset-password" if usable == "false" else "set-password"] = "1"
    changed = admin_client.post(f"/admin/auth/user/{owner_a.pk}/password/", form)
    assert changed.status_code == 302, changed.content
    owner_a.refresh_from_db()
    assert owner_a.has_usable_password() == (usable == "true")
    assert not _works(secret)


def test_a_password_set_elsewhere_revokes_too_a_hash_upgrade_at_sign_in_does_not(
    settings: Any, owner_a: Any
) -> None:
    _, kept = services.api_token_create(user=owner_a)
    # Signing in under a newer preferred hasher re-hashes the same password: no change.
    settings.PASSWORD_HASHERS = [
        "django.contrib.auth.hashers.ScryptPasswordHasher",
        "django.contrib.auth.hashers.MD5PasswordHasher",
    ]
    assert _obtain(owner_a.username).status_code == 200
    owner_a.refresh_from_db()
    assert owner_a.password.startswith("scrypt$") and _works(kept)
    # Saves that do not write the password revoke nothing either.
    owner_a.first_name = "Ada"
    owner_a.save(update_fields=["first_name"])
    owner_a.save()
    assert _works(kept)

    # A password set outside any view (a shell, manage.py changepassword) revokes.
    owner_a.set_password(NEW_PASSWORD)
    owner_a.save()
    assert not ApiToken.objects.filter(user=owner_a).exists()
