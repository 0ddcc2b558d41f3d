"""The console's customer and operator pages: rendering, roles, writes through the services,
and the one-time display of a key secret."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from metering.models import Usage
from tenants.models import ApiKey, Membership, Role, Tenant

pytestmark = pytest.mark.django_db


def _url(tenant: Tenant, page: str = "") -> str:
    return f"/t/{tenant.id}/{page}"


def test_root_is_the_console_and_sends_anonymous_users_to_sign_in() -> None:
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    page = Client().get("/login/")
    assert page.status_code == 200
    assert b'<label for="id_username"' in page.content and b"csrfmiddlewaretoken" in page.content


def test_api_docs_are_served_without_a_cdn() -> None:
    for path in ("/api/docs/", "/api/redoc/"):
        body = Client().get(path).content.decode()
        assert "cdn.jsdelivr" not in body and "unpkg" not in body
        assert "/static/drf_spectacular_sidecar/" in body
    asset = Client().get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert asset.status_code == 200


def test_static_assets_are_served_by_the_app() -> None:
    for path in (
        "/static/console/console.css",
        "/static/console/vendor/htmx.min.js",
        "/static/console/vendor/chart.umd.min.js",
    ):
        response = Client().get(path)
        assert response.status_code == 200, path
        assert b"".join(response.streaming_content)


def test_home_redirects_to_the_first_tenant(
    tenant_a: Tenant, owner_a: Any, browser_for: Any
) -> None:
    response = browser_for(owner_a).get("/")
    assert response.status_code == 302 and response["Location"] == _url(tenant_a)


def test_overview_shows_month_usage_with_separators_and_spend(
    tenant_a: Tenant, owner_a: Any, version_70b: Any, browser_for: Any
) -> None:
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    Usage.objects.create(
        tenant=tenant_a,
        api_key_id="00000000-0000-0000-0000-000000000001",
        model_version=version_70b,
        hour=hour,
        requests=3,
        prompt_tokens=1_234_567,
        cached_tokens=200_000,
        completion_tokens=45_678,
    )
    body = browser_for(owner_a).get(_url(tenant_a)).content.decode()
    assert "1,234,567" in body and "200,000" in body and "45,678" in body
    # 1,034,567 x 0.60 + 200,000 x 0.15 + 45,678 x 0.80 per million = 0.6207402 + 0.03 + 0.0365424
    assert "$0.69" in body
    assert "No data yet" in body  # no request log rows, no gateway running
    assert 'datetime="' in body and "data-local" in body


def test_spend_is_hidden_from_plain_members(
    tenant_a: Tenant, member_of: Callable[..., Any], browser_for: Any
) -> None:
    body = browser_for(member_of(tenant_a, Role.MEMBER)).get(_url(tenant_a)).content.decode()
    assert "owners, admins and billing members see spend" in body


def test_create_key_shows_the_secret_exactly_once(
    tenant_a: Tenant, owner_a: Any, browser_for: Any, rm: Any
) -> None:
    client = browser_for(owner_a)
    response = client.post(
        _url(tenant_a, "keys/"),
        {"form_id": "f1", "name": "ci", "scopes": ["chat"], "expires_on": ""},
    )
    assert response.status_code == 200
    assert (
        response["Cache-Control"].startswith("no-store") or "no-store" in response["Cache-Control"]
    )
    body = response.content.decode()
    secrets = set(re.findall(r"fw-[A-Za-z0-9_-]{40,}", body))
    assert len(secrets) == 1
    secret = secrets.pop()
    key = ApiKey.objects.get(tenant=tenant_a, name="ci")
    assert key.scopes == ["chat"] and key.created_by == owner_a and secret.startswith(key.prefix)
    # Not in a cookie, the session or any later page.
    assert secret not in str(response.cookies)
    assert secret not in str(dict(client.session))
    for page in ("", "keys/", "usage/", "limits/", "members/"):
        assert secret not in client.get(_url(tenant_a, page)).content.decode()
    # The same form sent again (a reload): no second key, no secret, a clear message.
    again = client.post(
        _url(tenant_a, "keys/"), {"form_id": "f1", "name": "ci", "scopes": ["chat"]}, follow=True
    )
    assert ApiKey.objects.filter(tenant=tenant_a).count() == 1
    assert "already sent" in again.content.decode()
    assert not re.findall(r"fw-[A-Za-z0-9_-]{40,}", again.content.decode())


def test_key_form_errors_are_shown_next_to_the_field(
    tenant_a: Tenant, owner_a: Any, browser_for: Any
) -> None:
    yesterday = (timezone.now() - timedelta(days=1)).date().isoformat()
    response = browser_for(owner_a).post(
        _url(tenant_a, "keys/"), {"name": "", "scopes": [], "expires_on": yesterday}
    )
    assert response.status_code == 400
    body = response.content.decode()
    for field in ("name", "scopes", "expires_on"):
        assert re.search(rf'id="id_{field}_error"', body), field
    assert "Pick a day after today." in body
    assert not ApiKey.objects.filter(tenant=tenant_a).exists()


def test_revoke_asks_first_then_revokes(
    tenant_a: Tenant, owner_a: Any, browser_for: Any, rm: Any
) -> None:
    from tenants import services

    key, _ = services.api_key_create(tenant=tenant_a, name="old")
    client = browser_for(owner_a)
    confirm = client.get(_url(tenant_a, f"keys/{key.id}/revoke/"))
    assert confirm.status_code == 200 and b"Revoke key" in confirm.content
    key.refresh_from_db()
    assert key.revoked_at is None
    done = client.post(_url(tenant_a, f"keys/{key.id}/revoke/"))
    assert done.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None and key.revoked_by == owner_a


def test_members_cannot_create_or_revoke_keys(
    tenant_a: Tenant, member_of: Callable[..., Any], browser_for: Any
) -> None:
    from tenants import services

    key, _ = services.api_key_create(tenant=tenant_a, name="k")
    client = browser_for(member_of(tenant_a, Role.MEMBER))
    assert client.get(_url(tenant_a, "keys/")).status_code == 200
    assert (
        client.post(_url(tenant_a, "keys/"), {"name": "x", "scopes": ["chat"]}).status_code == 403
    )
    assert client.post(_url(tenant_a, f"keys/{key.id}/revoke/")).status_code == 403
    assert client.get(_url(tenant_a, "members/")).status_code == 403
    billing = browser_for(member_of(tenant_a, Role.BILLING))
    assert billing.get(_url(tenant_a, "keys/")).status_code == 403
    assert billing.get(_url(tenant_a, "usage/")).status_code == 200


def test_members_page_adds_changes_and_removes(
    tenant_a: Tenant,
    owner_a: Any,
    make_user: Callable[..., Any],
    browser_for: Any,
    member_of: Callable[..., Any],
) -> None:
    make_user("newbie")
    client = browser_for(owner_a)
    page = client.get(_url(tenant_a, "members/")).content.decode()
    assert "A tenant always keeps at least one owner" in page
    assert (
        client.post(
            _url(tenant_a, "members/"), {"user": "newbie@example.com", "role": "member"}
        ).status_code
        == 302
    )
    membership = Membership.objects.get(tenant=tenant_a, user__username="newbie")
    twice = client.post(_url(tenant_a, "members/"), {"user": "newbie", "role": "admin"})
    assert twice.status_code == 400
    assert re.search(r'id="id_user_error".*already a member', twice.content.decode(), re.S)
    assert (
        client.post(_url(tenant_a, f"members/{membership.id}/role/"), {"role": "admin"}).status_code
        == 302
    )
    membership.refresh_from_db()
    assert membership.role == Role.ADMIN
    assert client.post(_url(tenant_a, f"members/{membership.id}/remove/")).status_code == 302
    assert not Membership.objects.filter(pk=membership.pk).exists()
    # Unknown user: the error is on the field.
    bad = client.post(_url(tenant_a, "members/"), {"user": "nobody", "role": "member"})
    assert bad.status_code == 400 and 'id="id_user_error"' in bad.content.decode()
    # The last owner cannot be demoted.
    own = Membership.objects.get(tenant=tenant_a, user=owner_a)
    client.post(_url(tenant_a, f"members/{own.id}/role/"), {"role": "member"})
    own.refresh_from_db()
    assert own.role == Role.OWNER
    # An admin may not touch the owner role.
    admin = browser_for(member_of(tenant_a, Role.ADMIN))
    assert admin.post(_url(tenant_a, f"members/{own.id}/remove/")).status_code == 403
    assert (
        admin.post(_url(tenant_a, "members/"), {"user": "newbie", "role": "owner"}).status_code
        == 403
    )


def test_usage_page_and_csv_match_the_usage_api(
    tenant_a: Tenant, owner_a: Any, version_70b: Any, browser_for: Any
) -> None:
    from rest_framework.test import APIClient

    day = datetime(2026, 3, 1, tzinfo=UTC)
    key_id = "00000000-0000-0000-0000-0000000000aa"
    for h in range(0, 72, 5):
        Usage.objects.create(
            tenant=tenant_a,
            api_key_id=key_id,
            model_version=version_70b,
            hour=day + timedelta(hours=h),
            requests=h + 1,
            prompt_tokens=1000 * (h + 1),
            cached_tokens=100 * h,
            completion_tokens=7 * h,
        )
    client = browser_for(owner_a)
    params = {"start": "2026-03-01", "end": "2026-03-03", "granularity": "day"}
    page = client.get(_url(tenant_a, "usage/"), params)
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="usage-data"' in body and "usage-chart" in body
    total_prompt = sum(1000 * (h + 1) for h in range(0, 72, 5))
    assert f"{total_prompt:,}" in body

    csv_console = client.get(_url(tenant_a, "usage.csv"), params)
    assert csv_console["Content-Type"].startswith("text/csv")
    api = APIClient()
    api.force_authenticate(owner_a)
    start = int(day.timestamp())
    csv_api = api.get(
        f"/api/v1/tenants/{tenant_a.id}/usage/completions.csv",
        {
            "start_time": start,
            "end_time": start + 3 * 86400,
            "bucket_width": "1d",
            "group_by": "model,api_key_id",
        },
    )
    assert csv_api.status_code == 200
    assert csv_console.content == csv_api.content
    assert csv_console.content.count(b"\r\n") == 4  # header + 3 days

    hourly = client.get(_url(tenant_a, "usage.csv"), {**params, "granularity": "hour"})
    csv_api_h = api.get(
        f"/api/v1/tenants/{tenant_a.id}/usage/completions.csv",
        {
            "start_time": start,
            "end_time": start + 3 * 86400,
            "bucket_width": "1h",
            "group_by": "model,api_key_id",
            "limit": 72,
        },
    )
    assert hourly.content == csv_api_h.content


def test_usage_range_errors_are_a_400_next_to_the_field(
    tenant_a: Tenant, owner_a: Any, browser_for: Any
) -> None:
    client = browser_for(owner_a)
    bad = client.get(_url(tenant_a, "usage/"), {"start": "2026-03-05", "end": "2026-03-01"})
    assert bad.status_code == 400 and "The end is before the start." in bad.content.decode()
    long = client.get(
        _url(tenant_a, "usage/"),
        {"start": "2026-01-01", "end": "2026-03-01", "granularity": "hour"},
    )
    assert long.status_code == 400
    assert client.get(_url(tenant_a, "usage.csv"), {"start": "x"}).status_code == 400


def test_limits_page_explains_each_limit(tenant_b: Tenant, browser_for: Any) -> None:
    owner = tenant_b.memberships.get(role=Role.OWNER).user
    body = browser_for(owner).get(_url(tenant_b, "limits/")).content.decode()
    for words in (
        "Requests per minute",
        "Tokens per minute",
        "Max context",
        "Max output",
        "Concurrent work cap",
        "Reserved floor",
        "always admitted",
    ):
        assert words in body


def test_operator_pages_need_the_permission(
    tenant_a: Tenant,
    operator: Any,
    finance: Any,
    make_user: Callable[..., Any],
    browser_for: Any,
) -> None:
    plain_staff = make_user("staff-only", is_staff=True)
    for user, expected in ((plain_staff, 403), (finance, 403), (operator, 200)):
        client = browser_for(user)
        assert client.get("/ops/tenants/").status_code == expected
        assert client.get(f"/ops/tenants/{tenant_a.id}/").status_code == expected
    # Operators are not members: customer pages of a tenant are not theirs.
    assert browser_for(operator).get(_url(tenant_a)).status_code == 404


def test_fleet_page_shows_unreachable_replicas_and_gateway(
    tenant_a: Tenant, operator: Any, browser_for: Any, settings: Any
) -> None:
    from metering.events import REASONS
    from metering.models import DeadLetter

    settings.FAIRWAY_GATEWAY_METRICS_URLS = ["http://127.0.0.1:9/metrics"]
    settings.FAIRWAY_INGEST_METRICS_URLS = ["http://127.0.0.1:9/metrics"]
    now = timezone.now()
    for offset, ago in ((1, 1), (2, 2), (3, 30)):
        DeadLetter.objects.create(
            topic="usage.v1", partition=0, offset=offset, payload=b"{", reason=REASONS[0],
            received_at=now - timedelta(hours=ago),
        )  # fmt: skip
    body = browser_for(operator).get("/ops/fleet/").content.decode()
    assert re.search(rf"{REASONS[0]} 2\b", body)  # the one 30 hours old is not counted
    assert "No data: the usage consumer's metrics could not be read." in body
    assert "r70-a" in body and "unreachable" in body
    assert "the gateway&#x27;s metrics could not be read" in body or "could not be read" in body


def test_operator_saves_plan_and_limits_through_the_services(
    tenant_a: Tenant, operator: Any, plans: Any, browser_for: Any, rm: Any
) -> None:
    client = browser_for(operator)
    url = f"/ops/tenants/{tenant_a.id}/"
    # Enterprise carries a reserved floor and the model has no reserved pool: refused by the
    # service's over-subscription check, shown next to the plan field, nothing saved.
    refused = client.post(url, {"plan": plans["enterprise"].pk})
    assert refused.status_code == 400
    assert re.search(r'id="id_plan_error".*reserved-pool replicas', refused.content.decode(), re.S)
    tenant_a.refresh_from_db()
    assert tenant_a.plan == plans["standard"]
    response = client.post(url, {"plan": plans["free"].pk, "suspended": "on"})
    assert response.status_code == 302
    tenant_a.refresh_from_db()
    assert tenant_a.plan == plans["free"] and tenant_a.is_suspended
    limit = {
        f"llama-70b-{k}": v
        for k, v in {
            "rpm": 7,
            "tpm": 1000,
            "max_context": 4096,
            "max_output": 9999,
            "kv_seconds_cap": 10,
            "reserved_kv": 0,
        }.items()
    }
    bad = client.post(f"{url}limits/llama-70b/", limit)
    assert bad.status_code == 400 and "max_output cannot exceed max_context" in bad.content.decode()
    limit["llama-70b-max_output"] = 1024
    assert client.post(f"{url}limits/llama-70b/", limit).status_code == 302
    assert tenant_a.model_limits.get().rpm == 7
    assert client.post(f"{url}limits/llama-70b/", {"action": "clear"}).status_code == 302
    assert not tenant_a.model_limits.exists()


def test_overview_shows_p95_latency_from_the_request_log(
    tenant_a: Tenant, tenant_b: Tenant, owner_a: Any, version_70b: Any, browser_for: Any
) -> None:
    import uuid

    from metering.models import RequestLog
    from tests.billing.conftest import request_log_partition

    now = timezone.now()

    def log(tenant: Tenant, ttft: float, tpot: float, status: int = 200, ago_s: int = 60) -> None:
        at = now - timedelta(seconds=ago_s)
        request_log_partition(at)  # its own day's: two hours back may be yesterday (UTC)
        RequestLog.objects.create(
            request_id=uuid.uuid4().hex, started_at=at, tenant_id=tenant.pk,
            api_key_id=uuid.UUID(int=1), model="llama-70b", model_version_id=version_70b.pk,
            replica_id="r", prompt_tokens=10, cached_tokens=0, completion_tokens=5,
            ttft_ms=ttft, tpot_ms=tpot, finish_reason="stop", status=status, is_retry=False,
            ingested_at=at,
        )  # fmt: skip

    for i in range(1, 21):
        log(tenant_a, ttft=10.0 * i, tpot=1.0 * i)  # p95, interpolated: 190.5 ms, 19.05 ms
    log(tenant_a, ttft=99_999, tpot=999, status=503)  # failed requests do not count
    log(tenant_a, ttft=99_999, tpot=999, ago_s=7200)  # older than an hour
    log(tenant_b, ttft=50_000, tpot=500)  # another tenant's
    body = browser_for(owner_a).get(f"/t/{tenant_a.id}/").content.decode()
    assert re.search(r'data-testid="ttft-p95">190.5 ms<', body)
    assert re.search(r'data-testid="tpot-p95">19\.1 ms<', body)
    assert "No data yet: no request of yours" not in body


def test_a_user_in_two_tenants_gets_a_switcher(
    tenant_a: Tenant, tenant_b: Tenant, owner_a: Any, browser_for: Any
) -> None:
    from tenants import services

    services.membership_add(tenant=tenant_b, user=owner_a, role=Role.BILLING)
    body = browser_for(owner_a).get(f"/t/{tenant_b.id}/").content.decode()
    assert '<select id="tenant-switch"' in body
    assert f'value="/t/{tenant_a.id}/"' in body and f'value="/t/{tenant_b.id}/" selected' in body
    # The billing role in tenant B: no keys, limits or members in the navigation.
    assert f"/t/{tenant_b.id}/keys/" not in body and f"/t/{tenant_b.id}/invoices/" in body


def test_a_new_tenant_sees_empty_states_not_blank_pages(
    tenant_a: Tenant, owner_a: Any, browser_for: Any
) -> None:
    """Keys, usage and invoices of a tenant with none say so, and what to do next."""
    client = browser_for(owner_a)
    ApiKey.objects.filter(tenant=tenant_a).delete()
    for page, says in (
        ("keys/", "No keys yet. Create one below to start calling the API."),
        ("usage/", "No usage in this range yet."),
        ("invoices/", "No invoices yet."),
    ):
        response = client.get(_url(tenant_a, page))
        assert response.status_code == 200, page
        assert says in response.content.decode(), page


def _quickstarts(client: Client, tenant: Tenant) -> list[str]:
    """The quick-start panel of the overview, and of the keys page showing a new key."""
    created = client.post(
        _url(tenant, "keys/"), {"form_id": f"qs-{tenant.name}", "name": "qs", "scopes": ["chat"]}
    )
    panels = []
    for body in (client.get(_url(tenant)).content.decode(), created.content.decode()):
        panel = re.search(r'aria-labelledby="qs-title">(.*?)</section>', body, re.S)
        assert panel, "no quick-start panel"
        panels.append(panel.group(1))
    return panels


def test_quick_start_names_a_model_the_tenant_can_call(
    tenant_a: Tenant, owner_a: Any, browser_for: Any, make_user: Callable[..., Any], rm: Any
) -> None:
    """The snippets call a family the tenant's plan grants and the gateway serves; a
    tenant granted none is told so instead of shown a request that would be refused."""
    from tenants import services
    from tenants.demo import MODELS

    MODELS[1].upsert(make_current=True)  # llama-8b: served, but not on tenant A's plan
    for panel in _quickstarts(browser_for(owner_a), tenant_a):
        assert 'model="llama-70b"' in panel and '"model": "llama-70b"' in panel
        assert "llama-8b" not in panel

    bare = services.plan_create(name="bare", admission_class="standard")
    owner = make_user("owner-bare")
    lonely = services.tenant_create(name="tenant-bare", plan=bare, owner=owner)
    for panel in _quickstarts(browser_for(owner), lonely):
        assert "does not include any model that can be called now" in panel
        assert "chat.completions.create" not in panel and "curl" not in panel
