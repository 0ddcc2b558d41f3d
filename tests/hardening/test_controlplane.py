"""Control-plane entry points and secrets: production settings whenever FAIRWAY_ENV says
production, secrets of a minimum length, and a new key's secret never stored in a message
(a cookie or the session)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.core.cache import caches
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from catalog import services as catalog_services
from catalog.models import ModelVersion, Replica
from gateway.config import ConfigError, GatewayConfig
from tenants import services
from tenants.models import ApiKey, ApiToken, Membership, Role, Tenant

ROOT = Path(__file__).resolve().parents[2]


def _run(code: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    base.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run(  # noqa: S603 - our own interpreter and files
        [sys.executable, *code], cwd=ROOT, env=base, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "entry",
    [
        ["manage.py", "check"],
        ["-c", "import fairway.celery, django; django.setup()"],
    ],
    ids=["manage.py", "celery"],
)
def test_entry_points_pick_production_settings_under_fairway_env_production(
    entry: list[str],
) -> None:
    # Production settings refuse the development secrets: reaching that refusal proves
    # they were the ones loaded (the development settings would start happily).
    done = _run(entry, FAIRWAY_ENV="production", SECRET_KEY="", FAIRWAY_KEY_PEPPER="")
    assert done.returncode != 0
    assert "Refusing to start with fairway.settings.production" in done.stderr
    # Without FAIRWAY_ENV they stay on development settings.
    assert _run(
        ["-c", "import fairway.celery, os; print(os.environ['DJANGO_SETTINGS_MODULE'])"]
    ).stdout.strip() == ("fairway.settings.local")


def test_gateway_refuses_short_secrets_in_production() -> None:
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        GatewayConfig.from_env(
            {
                "FAIRWAY_ENV": "production",
                "FAIRWAY_KEY_PEPPER": "short-pepper",
                "FAIRWAY_CACHE_SALT_KEY": "s" * 32,
            }
        )
    with pytest.raises(ConfigError, match="FAIRWAY_KEY_PEPPER_PREVIOUS"):
        GatewayConfig.from_env(
            {
                "FAIRWAY_ENV": "production",
                "FAIRWAY_KEY_PEPPER": "p" * 32,
                "FAIRWAY_CACHE_SALT_KEY": "s" * 32,
                "FAIRWAY_KEY_PEPPER_PREVIOUS": "old",
            }
        )


@pytest.mark.django_db
def test_admin_shows_a_new_secret_in_the_response_only(
    rm: Any, make_user: Any, tenant_a: Tenant
) -> None:
    client = Client()
    client.force_login(make_user("root", is_staff=True, is_superuser=True))
    response = client.post(
        "/admin/tenants/apikey/add/",
        {
            "tenant": str(tenant_a.pk),
            "name": "ops",
            "scopes": '["chat"]',
            "expires_at_0": "",
            "expires_at_1": "",
        },
    )
    assert response.status_code == 200, response.status_code
    assert "no-store" in response["Cache-Control"]
    found = re.search(rb"fw-[A-Za-z0-9_-]{40,}", response.content)
    assert found is not None
    secret = found.group(0).decode()
    assert ApiKey.objects.filter(name="ops", tenant=tenant_a).exists()
    assert not [m for m in get_messages(response.wsgi_request) if secret in str(m)]
    assert all(secret not in morsel.value for morsel in response.cookies.values())
    assert all(secret not in str(v) for v in client.session.values())
    # The next page does not show it again.
    assert secret.encode() not in client.get("/admin/tenants/apikey/").content


# -- management-API tokens -------------------------------------------------------------------

ADDRESSES = ("127.0.0.1", "198.51.100.23", "198.51.100.24")


def _reset_throttle() -> None:
    caches["throttle"].delete_many([f"throttle_auth-token_{a}" for a in ADDRESSES])


@pytest.mark.django_db
def test_the_token_endpoint_is_throttled_per_address(settings: Any, make_user: Any) -> None:
    settings.FAIRWAY_AUTH_TOKEN_RATE = "3/min"
    _reset_throttle()
    make_user("guessed")
    client = APIClient(REMOTE_ADDR="198.51.100.23")
    for attempt in range(3):
        wrong = client.post(
            "/api/v1/auth/token/", {"username": "guessed", "password": f"wrong-{attempt}"}
        )
        assert wrong.status_code == 400
    throttled = client.post("/api/v1/auth/token/", {"username": "guessed", "password": "pw-12345"})
    assert throttled.status_code == 429 and int(throttled["Retry-After"]) > 0
    assert throttled.json()["error"]["code"] == "throttled"
    # Another address still gets its answer.
    other = APIClient(REMOTE_ADDR="198.51.100.24").post(
        "/api/v1/auth/token/", {"username": "guessed", "password": "pw-12345"}
    )
    assert other.status_code == 200
    _reset_throttle()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("scheme", "path"),
    [
        ("Token", "/api/v1/tenants/"),
        # The usage reports also take the token as OpenAI's clients send it.
        ("Bearer", "/api/v1/organization/usage/completions?start_time=0"),
    ],
)
def test_tokens_expire_and_a_new_one_is_issued(
    settings: Any, make_user: Any, tenant_a: Tenant, scheme: str, path: str
) -> None:
    settings.FAIRWAY_API_TOKEN_MAX_AGE_H = 24
    _reset_throttle()
    user = make_user("scripted")
    Membership.objects.create(user=user, tenant=tenant_a, role=Role.MEMBER)
    obtained = APIClient().post(
        "/api/v1/auth/token/", {"username": "scripted", "password": "pw-12345"}
    )
    key = obtained.json()["token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{scheme} {key}")
    assert client.get(path).status_code == 200
    ApiToken.objects.filter(token_hash=services.api_token_hash(key)).update(
        created_at=timezone.now() - timedelta(hours=25)
    )
    expired = client.get(path)
    assert expired.status_code == 401
    assert expired.json()["error"]["code"] == "token_expired"
    again = APIClient().post(
        "/api/v1/auth/token/", {"username": "scripted", "password": "pw-12345"}
    )
    fresh = again.json()["token"]
    assert fresh != key
    client.credentials(HTTP_AUTHORIZATION=f"{scheme} {fresh}")
    assert client.get(path).status_code == 200
    _reset_throttle()


# -- replicas, keys --------------------------------------------------------------------------


@pytest.mark.django_db
def test_replica_urls_must_point_at_allowed_hosts(
    settings: Any, version_70b: ModelVersion, make_user: Any
) -> None:
    settings.FAIRWAY_REPLICA_ALLOWED_HOSTS = ["10.0.0.0/8", "localhost", "*.replicas.internal"]
    for url in (
        "http://10.2.3.4:8000",
        "http://localhost:8000",
        "http://a.replicas.internal:8000",
    ):
        catalog_services.replica_upsert(version=version_70b, name=f"ok-{len(url)}", base_url=url)
    for url in (
        "http://203.0.113.5:8000",  # someone's own server
        "http://evil.example.com:8000",
        "http://10.0.0.1.nip.io:8000",  # a public name that resolves to a private address
        "http://replicas.internal.evil.com",
        "http://[2001:db8::1]:8000",
    ):
        with pytest.raises(ValidationError) as refused:
            catalog_services.replica_upsert(version=version_70b, name="bad", base_url=url)
        assert "base_url" in refused.value.message_dict
    # The admin goes through the same model validation.
    client = Client()
    client.force_login(make_user("ops", is_staff=True, is_superuser=True))
    page = client.post(
        "/admin/catalog/replica/add/",
        {
            "version": str(version_70b.pk),
            "name": "sneaky",
            "base_url": "http://203.0.113.5:8000",
            "pool": "shared",
            "is_enabled": "on",
        },
    )
    assert page.status_code == 200 and b"not an allowed replica host" in page.content
    assert not Replica.objects.filter(name="sneaky").exists()


@pytest.mark.django_db
def test_keys_per_tenant_are_capped_and_the_list_is_paged(
    settings: Any, rm: Any, owner_a: Any, tenant_a: Tenant, client_for: Any
) -> None:
    settings.FAIRWAY_MAX_KEYS_PER_TENANT = 3
    client = client_for(owner_a)
    url = f"/api/v1/tenants/{tenant_a.id}/keys/"
    created = [client.post(url, {"name": f"k{i}"}, format="json") for i in range(3)]
    assert [r.status_code for r in created] == [201, 201, 201]
    refused = client.post(url, {"name": "one-too-many"}, format="json")
    assert refused.status_code == 400, refused.content
    assert refused.json()["error"]["code"] == "too_many_keys"
    revoke = f"{url}{created[0].json()['id']}/revoke/"
    assert client.post(revoke).status_code == 200
    assert client.post(url, {"name": "after-revoke"}, format="json").status_code == 201

    first = client.get(url, {"limit": 2})
    assert first.status_code == 200 and len(first.json()) == 2
    assert first["X-Total-Count"] == "4"
    assert 'rel="next"' in first["Link"] and "offset=2" in first["Link"]
    second = client.get(url, {"limit": 2, "offset": 2})
    assert len(second.json()) == 2 and "Link" not in second
    seen = {k["id"] for k in first.json()} | {k["id"] for k in second.json()}
    assert len(seen) == 4
    assert client.get(url, {"limit": 0}).status_code == 400
