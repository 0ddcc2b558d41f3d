"""A key's own limits in the console: shown on the keys page beside the tenant's, set,
changed and removed through ``tenants.services`` on the key's limits page, with the
service's refusals next to the field, owners and admins only, and tenant isolation."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from catalog import services as catalog_services
from catalog.models import ModelFamily
from contracts import schema
from tenants import services
from tenants.models import ApiKey, ApiKeyModelLimit, Role, Tenant

pytestmark = pytest.mark.django_db

FAMILY = "llama-70b"  # tenant_a (standard plan): 600 requests/min, 1,000,000 tokens/min


@pytest.fixture
def key_a(tenant_a: Tenant, family_70b: ModelFamily) -> ApiKey:
    key, _ = services.api_key_create(tenant=tenant_a, name="ci")
    return key


def _page(tenant: Tenant, key: ApiKey) -> str:
    return f"/t/{tenant.id}/keys/{key.id}/limits/"


def _save(tenant: Tenant, key: ApiKey, family: str = FAMILY) -> str:
    return f"/t/{tenant.id}/keys/{key.id}/limits/{family}/"


def _form(action: str = "save", family: str = FAMILY, **values: Any) -> dict[str, Any]:
    data = {f"{family}-{name}": "" for name in ("rpm", "tpm", "max_concurrency")}
    data.update({f"{family}-{name}": str(value) for name, value in values.items()})
    return {**data, "action": action}


def _row(body: str, key: ApiKey) -> str:
    match = re.search(rf'<tr data-key-prefix="{re.escape(key.prefix)}">(.*?)</tr>', body, re.S)
    assert match, key.prefix
    return match.group(1)


def _own(key: ApiKey) -> tuple[int | None, int | None, int | None] | None:
    row = ApiKeyModelLimit.objects.filter(api_key=key, family__name=FAMILY).first()
    return None if row is None else (row.rpm, row.tpm, row.max_concurrency)


def _error(body: str, field: str, family: str = FAMILY) -> str:
    """The error list Django renders next to one field of one family's form."""
    match = re.search(rf'id="id_{family}-{field}_error"[^>]*>(.*?)</ul>', body, re.S)
    assert match, f"no error next to {field}"
    return re.sub(r"<[^>]+>", "", match.group(1)).strip()


def test_keys_page_shows_each_keys_own_limits_beside_the_tenants(
    tenant_a: Tenant, owner_a: Any, key_a: ApiKey, family_70b: ModelFamily, browser_for: Any
) -> None:
    plain, _ = services.api_key_create(tenant=tenant_a, name="web")
    services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=100, max_concurrency=3)
    body = browser_for(owner_a).get(f"/t/{tenant_a.id}/keys/").content.decode()
    own = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", _row(body, key_a)))
    assert "llama-70b: 100 req/min (tenant 600), 3 in flight" in own
    assert "tenant's limits" not in own and "Edit limits" in own
    assert "tenant's limits" in _row(body, plain)
    reference = re.search(r'data-testid="tenant-limits">(.*?)</p>', body, re.S)
    assert reference, "the tenant's limits for reference"
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", reference.group(1)))
    assert "llama-70b 600 requests/min, 1,000,000 tokens/min" in text
    link = f'href="/t/{tenant_a.id}/keys/{key_a.id}/limits/" aria-label="Edit limits of ci ('
    assert link in body


def test_owner_sets_changes_and_removes_a_key_limit_and_the_gateway_is_pushed_each(
    tenant_a: Tenant,
    owner_a: Any,
    key_a: ApiKey,
    browser_for: Any,
    rm: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = browser_for(owner_a)
    redis_key = schema.key_redis_key(key_a.key_hash)

    def pushed() -> dict[str, schema.KeyLimitRecord]:
        return schema.load_key(rm.redis.get(redis_key)).limits

    page = client.get(_page(tenant_a, key_a)).content.decode()
    assert "Your tenant's limit: 600. Empty: the tenant's applies." in page
    assert "Remove this key" not in page  # nothing of its own to remove yet

    with django_capture_on_commit_callbacks(execute=True):
        saved = client.post(_save(tenant_a, key_a), _form(rpm=100, max_concurrency=2))
    assert saved.status_code == 302 and saved["Location"] == _page(tenant_a, key_a)
    assert _own(key_a) == (100, None, 2)
    assert pushed() == {FAMILY: schema.KeyLimitRecord(rpm=100, tpm=0, max_concurrency=2)}
    shown = client.get(saved["Location"]).content.decode()
    assert "limits of “ci” saved" in shown
    assert re.search(r'data-testid="key-rpm">100<', shown)
    assert 'value="100"' in shown and "Remove this key" in shown

    # Saving again replaces every value: an emptied field drops that kind of key limit.
    with django_capture_on_commit_callbacks(execute=True):
        client.post(_save(tenant_a, key_a), _form(tpm=250_000))
    assert _own(key_a) == (None, 250_000, None)
    assert pushed() == {FAMILY: schema.KeyLimitRecord(rpm=0, tpm=250_000, max_concurrency=0)}

    with django_capture_on_commit_callbacks(execute=True):
        removed = client.post(_save(tenant_a, key_a), _form("clear"), follow=True)
    assert _own(key_a) is None and pushed() == {}
    assert "now has only the tenant" in removed.content.decode()

    # Every field left empty and saved: the same as removing.
    services.api_key_limit_set(api_key=key_a, family=ModelFamily.objects.get(name=FAMILY), rpm=9)
    assert client.post(_save(tenant_a, key_a), _form()).status_code == 302
    assert _own(key_a) is None


def test_refusals_are_shown_next_to_the_field_and_nothing_is_written(
    tenant_a: Tenant, owner_a: Any, key_a: ApiKey, family_70b: ModelFamily, browser_for: Any
) -> None:
    client = browser_for(owner_a)
    services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=100)

    # Above the tenant's limit: the service's words, on the tokens field; rpm not half-saved.
    above = client.post(_save(tenant_a, key_a), _form(rpm=50, tpm=1_000_001))
    assert above.status_code == 400
    body = above.content.decode()
    assert _error(body, "tpm") == (
        "A key&#x27;s tokens/min cannot exceed its tenant&#x27;s limit for llama-70b (1000000)."
    )
    assert 'value="1000001"' in body  # what was typed is kept for correcting
    assert _own(key_a) == (100, None, None)

    negative = client.post(_save(tenant_a, key_a), _form(rpm=-5, tpm=10))
    assert negative.status_code == 400
    assert _error(negative.content.decode(), "rpm") == "Enter 1 or more, or leave it empty."
    words = client.post(_save(tenant_a, key_a), _form(max_concurrency="lots"))
    assert _error(words.content.decode(), "max_concurrency") == (
        "Enter a whole number, or leave it empty."
    )
    huge = client.post(_save(tenant_a, key_a), _form(rpm=2**31))
    assert "no larger than 2147483647" in _error(huge.content.decode(), "rpm")
    assert _own(key_a) == (100, None, None)

    # A family the catalog has but the tenant's plan does not grant: a form-level message.
    catalog_services.family_upsert(name="llama-8b")
    not_granted = client.post(_save(tenant_a, key_a, "llama-8b"), _form(family="llama-8b", rpm=1))
    assert not_granted.status_code == 400
    assert "The tenant cannot use llama-8b, so its keys cannot either." in (
        not_granted.content.decode()
    )
    # A family nobody has heard of is not a page.
    assert (
        client.post(_save(tenant_a, key_a, "gpt-9"), _form(family="gpt-9", rpm=1)).status_code
        == 404
    )
    assert ApiKeyModelLimit.objects.filter(api_key=key_a).count() == 1

    # A revoked key's limits are frozen: no form, and a post is refused in words.
    services.api_key_revoke(api_key=key_a)
    page = client.get(_page(tenant_a, key_a)).content.decode()
    assert "can no longer change" in page and "Save limits" not in page
    revoked = client.post(_save(tenant_a, key_a), _form(rpm=10))
    assert revoked.status_code == 400 and "The key is revoked" in revoked.content.decode()
    assert _own(key_a) == (100, None, None)


def test_members_see_key_limits_read_only_and_only_owners_and_admins_change_them(
    tenant_a: Tenant,
    key_a: ApiKey,
    family_70b: ModelFamily,
    member_of: Callable[..., Any],
    browser_for: Any,
) -> None:
    services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=100)
    member = browser_for(member_of(tenant_a, Role.MEMBER))
    keys = member.get(f"/t/{tenant_a.id}/keys/").content.decode()
    assert "100 req/min" in keys and "Edit limits" not in keys
    assert 'aria-label="Limits of ci (' in keys
    page = member.get(_page(tenant_a, key_a))
    body = page.content.decode()
    assert page.status_code == 200 and re.search(r'data-testid="key-rpm">100<', body)
    assert '<form method="post" action="/t/' not in body and "Save limits" not in body
    assert "owners and admins change them" in body
    refused = member.post(_save(tenant_a, key_a), _form(rpm=5))
    assert refused.status_code == 403 and b"may not change key limits" in refused.content
    assert member.post(_save(tenant_a, key_a), _form("clear")).status_code == 403
    assert _own(key_a) == (100, None, None)

    billing = browser_for(member_of(tenant_a, Role.BILLING))
    assert billing.get(_page(tenant_a, key_a)).status_code == 403
    assert billing.post(_save(tenant_a, key_a), _form(rpm=5)).status_code == 403

    admin = browser_for(member_of(tenant_a, Role.ADMIN))
    assert "Save limits" in admin.get(_page(tenant_a, key_a)).content.decode()
    assert admin.post(_save(tenant_a, key_a), _form(rpm=5)).status_code == 302
    assert _own(key_a) == (5, None, None)


def test_a_key_of_another_tenant_is_404_on_the_key_limit_pages(
    tenant_a: Tenant,
    tenant_b: Tenant,
    owner_a: Any,
    key_a: ApiKey,
    family_70b: ModelFamily,
    browser_for: Any,
) -> None:
    key_b, _ = services.api_key_create(tenant=tenant_b, name="b's key")
    services.api_key_limit_set(api_key=key_b, family=family_70b, rpm=77)
    client = browser_for(owner_a)
    # B's key under A's tenant, and B's tenant itself: both unknown to a member of A only.
    for tenant in (tenant_a, tenant_b):
        assert client.get(_page(tenant, key_b)).status_code == 404
        assert client.post(_save(tenant, key_b), _form(rpm=5)).status_code == 404
        assert client.post(_save(tenant, key_b), _form("clear")).status_code == 404
    assert _own(key_b) == (77, None, None)
    # A's own key under B's tenant id: 404 as well.
    assert client.get(_page(tenant_b, key_a)).status_code == 404
    keys = client.get(f"/t/{tenant_a.id}/keys/").content.decode()
    assert "b&#x27;s key" not in keys and "77 req/min" not in keys


def test_key_limit_form_needs_the_csrf_token(tenant_a: Tenant, owner_a: Any, key_a: ApiKey) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner_a)
    assert client.post(_save(tenant_a, key_a), _form(rpm=5)).status_code == 403
    assert _own(key_a) is None


def test_a_key_limit_for_a_model_the_tenant_lost_is_shown_as_no_access(
    tenant_a: Tenant, owner_a: Any, key_a: ApiKey, family_70b: ModelFamily, browser_for: Any
) -> None:
    services.api_key_limit_set(api_key=key_a, family=family_70b, rpm=100)
    services.tenant_change_plan(
        tenant=tenant_a, plan=services.plan_create(name="bare", admission_class="best_effort")
    )
    client = browser_for(owner_a)
    keys = client.get(f"/t/{tenant_a.id}/keys/").content.decode()
    assert "model no longer available" in _row(keys, key_a)
    body = client.get(_page(tenant_a, key_a)).content.decode()
    table = re.search(r'data-testid="limits-llama-70b">(.*?)</table>', body, re.S)
    assert table and "not available to your tenant" in body
    cells = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", table.group(1)))
    assert "Requests per minute 100 none no access" in cells
    assert "Your tenant's limit: none: your tenant cannot use this model." in body
