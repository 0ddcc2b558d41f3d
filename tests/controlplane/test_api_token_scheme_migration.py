"""Token digests get a label (tenants/migrations/0006): every token stored before keeps
working (and expiring) under its unlabelled digest, tokens issued after are labelled, a row
written without the new column (by the release before, during a rolling deploy) counts as
unlabelled, and migrating back deletes only the labelled tokens. Run on the real PostgreSQL
test database, migrating the tenants app back one step and forward again."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from contracts.schema import hash_api_key, hash_api_token
from tenants import services
from tenants.models import ApiToken, ApiTokenScheme

from .helpers import migrate_tenants

BEFORE = ("tenants", "0005_api_token")
PW = "pw-12345"


@pytest.fixture
def before_labels(transactional_db: None) -> Iterator[None]:
    migrate_tenants(BEFORE)
    try:
        yield
    finally:
        migrate_tenants()  # whatever happened, the database ends on the latest state


def _insert_unlabelled(user: Any, secret: str, created: datetime) -> None:
    """As the release before writes a token: no scheme column, the API keys' HMAC."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tenants_apitoken (user_id, prefix, token_hash, created_at) "
            "VALUES (%s, %s, %s, %s)",
            [user.pk, secret[:12], hash_api_key(secret, services.key_pepper()), created],
        )


def _status(secret: str) -> tuple[int, Any]:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    response = client.get("/api/v1/tenants/")
    return response.status_code, response.json()


def test_tokens_stored_before_keep_working_and_new_ones_are_labelled(before_labels: None) -> None:
    users = get_user_model().objects
    scripted, stale = users.create_user("scripted", password=PW), users.create_user("stale")
    fresh_secret, stale_secret = "fwt-fresh-" + "a" * 33, "fwt-stale-" + "b" * 33
    _insert_unlabelled(scripted, fresh_secret, timezone.now() - timedelta(hours=1))
    _insert_unlabelled(stale, stale_secret, timezone.now() - timedelta(hours=30))

    migrate_tenants()

    assert set(ApiToken.objects.values_list("scheme", flat=True)) == {ApiTokenScheme.UNLABELLED}
    assert _status(fresh_secret)[0] == 200
    expired = _status(stale_secret)
    assert expired[0] == 401 and expired[1]["error"]["code"] == "token_expired"

    # Tokens issued now are labelled, beside the old ones, and both work.
    obtained = APIClient().post("/api/v1/auth/token/", {"username": "scripted", "password": PW})
    new_secret = obtained.json()["token"]
    new = ApiToken.objects.get(token_hash=hash_api_token(new_secret, services.key_pepper()))
    assert new.scheme == ApiTokenScheme.LABELLED
    assert _status(new_secret)[0] == 200 and _status(fresh_secret)[0] == 200

    # A process of the release before, still running during the rollout, writes a row
    # without the column: the database default marks it unlabelled, and it works.
    late_secret = "fwt-late-" + "c" * 34
    _insert_unlabelled(scripted, late_secret, timezone.now())
    late = ApiToken.objects.get(prefix=late_secret[:12])
    assert late.scheme == ApiTokenScheme.UNLABELLED and _status(late_secret)[0] == 200


def test_migrating_back_deletes_only_the_labelled_tokens(before_labels: None) -> None:
    user = get_user_model().objects.create_user("scripted", password=PW)
    old_secret = "fwt-old-" + "d" * 35
    _insert_unlabelled(user, old_secret, timezone.now())
    migrate_tenants()
    _, labelled = services.api_token_create(user=user)

    migrate_tenants(BEFORE)  # the release before cannot verify a labelled digest
    with connection.cursor() as cursor:
        cursor.execute("SELECT token_hash FROM tenants_apitoken")
        assert cursor.fetchall() == [(hash_api_key(old_secret, services.key_pepper()),)]

    migrate_tenants()
    assert _status(old_secret)[0] == 200 and _status(labelled)[0] == 401
