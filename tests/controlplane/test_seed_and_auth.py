"""seed_demo is idempotent and what it writes works: the demo key is in the read model and
the owner's management-API token and session authenticate against the management API."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.http import HttpRequest
from rest_framework.test import APIClient

from catalog.models import Replica
from contracts import schema
from tenants.models import ApiKey, Tenant
from tenants.services import key_pepper

pytestmark = pytest.mark.django_db

REPLICAS = [
    "--replicas",
    "llama-70b-2026-05=http://127.0.0.1:9101,http://127.0.0.1:9102",
    "--reserved-replicas",
    "llama-70b-2026-05=http://127.0.0.1:9103",
    "--replicas",
    "llama-8b-2026-05=http://127.0.0.1:9111",
]


def _seed(keys_out: Path, *replicas: str) -> dict[str, Any]:
    call_command(
        "seed_demo", *(replicas or REPLICAS), "--keys-out", str(keys_out), stdout=io.StringIO()
    )
    return dict(json.loads(keys_out.read_text()))


def test_seed_demo_is_idempotent_and_feeds_the_read_model(rm: Any, tmp_path: Path) -> None:
    keys_out = tmp_path / "demo-keys.json"
    first = _seed(keys_out)
    assert keys_out.stat().st_mode & 0o777 == 0o600
    assert {k: v["plan"] for k, v in first.items() if "key" in v} == {
        "demo-free": "free",
        "demo-standard": "standard",
        "demo-enterprise": "enterprise",
    }
    second = _seed(keys_out)
    assert second == first
    assert ApiKey.objects.count() == 3 and Tenant.objects.count() == 3
    assert Replica.objects.filter(pool="reserved").count() == 1

    call_command("push_config", stdout=io.StringIO())
    snapshot = rm.snapshot()
    for info in (v for v in first.values() if "key" in v):
        # Hashed as the gateway hashes a presented key, with the configured pepper.
        key_hash = schema.hash_api_key(info["key"], key_pepper())
        record = schema.load_key(snapshot[schema.key_redis_key(key_hash)])
        assert record.tenant_id == info["tenant_id"]
        tenant = schema.load_tenant(snapshot[schema.tenant_redis_key(info["tenant_id"])])
        assert tenant.plan == info["plan"] and set(tenant.limits) == {"llama-70b", "llama-8b"}
    enterprise = schema.load_tenant(
        snapshot[schema.tenant_redis_key(first["demo-enterprise"]["tenant_id"])]
    )
    assert enterprise.admission_class == "reserved"
    assert enterprise.limits["llama-70b"].max_context == 131072
    assert enterprise.limits["llama-70b"].reserved_kv > 0
    free = schema.load_tenant(snapshot[schema.tenant_redis_key(first["demo-free"]["tenant_id"])])
    assert free.limits["llama-70b"].max_context == 8192
    catalog = schema.load_catalog(snapshot[schema.CATALOG_KEY])
    llama = catalog.resolve("llama-70b")
    assert llama is not None and llama.kv_bytes_per_token == 327680
    assert len(llama.replicas) == 3

    # A lost keys file means new keys (secrets cannot be recovered); replicas follow flags.
    keys_out.unlink()
    third = _seed(keys_out, "--replicas", "llama-8b-2026-05=http://127.0.0.1:9112")
    assert third["demo-free"]["key"] != first["demo-free"]["key"]
    assert ApiKey.objects.count() == 6
    assert list(
        Replica.objects.filter(version__name="llama-8b-2026-05").values_list("base_url", flat=True)
    ) == ["http://127.0.0.1:9112"]


def test_token_and_session_auth_work_for_the_demo_owner(rm: Any, tmp_path: Path) -> None:
    info = _seed(tmp_path / "keys.json")["demo-standard"]
    by_token = APIClient()
    by_token.credentials(HTTP_AUTHORIZATION=f"Token {info['owner_token']}")
    listed = by_token.get("/api/v1/tenants/").json()
    assert [t["id"] for t in listed] == [info["tenant_id"]]
    assert by_token.get("/api/v1/models/").json()[0]["current_version"] == "llama-70b-2026-05"

    obtained = APIClient().post(
        "/api/v1/auth/token/",
        {"username": info["owner"], "password": info["owner_password"]},
        format="json",
    )
    # A new token each time (only digests are stored); the seeded one keeps working.
    assert obtained.status_code == 200 and obtained.json()["token"] != info["owner_token"]
    by_obtained = APIClient()
    by_obtained.credentials(HTTP_AUTHORIZATION=f"Token {obtained.json()['token']}")
    assert [t["id"] for t in by_obtained.get("/api/v1/tenants/").json()] == [info["tenant_id"]]
    assert by_token.get("/api/v1/tenants/").status_code == 200

    session = APIClient(enforce_csrf_checks=True)
    # django-axes checks every password sign-in against its lockouts, so it needs the request.
    assert session.login(
        request=HttpRequest(), username=info["owner"], password=info["owner_password"]
    )
    keys_url = f"/api/v1/tenants/{info['tenant_id']}/keys/"
    assert session.get(keys_url).status_code == 200
    assert session.post(keys_url, {"name": "no-csrf"}, format="json").status_code == 403


def test_openapi_schema_is_served_and_valid(tmp_path: Path) -> None:
    response = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    paths = json.loads(response.content)["paths"]
    assert "/api/v1/tenants/{tenant_id}/keys/" in paths and "/api/v1/models/" in paths
    # Every view documented, no component name clashes: warnings fail the command.
    call_command(
        "spectacular",
        "--validate",
        "--fail-on-warn",
        "--file",
        str(tmp_path / "schema.yaml"),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
