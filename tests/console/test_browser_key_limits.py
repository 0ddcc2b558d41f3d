"""A key's own limits, end to end in a real headless chromium: an owner sets them on the
key's limits page, sees a refusal next to the field, sees the saved values on the keys page,
and the key's record in the Redis read model (pushed after commit) carries them; axe-core
checks the new page with and without errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from console import browser
from contracts import schema
from tenants import services
from tenants.demo import MODELS, PLANS, plan_limits
from tenants.models import ApiKey
from tests.console.test_browser import PASSWORD, Pages, _db, _sign_in
from tests.support import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def keyed(transactional_db: None, live_server: Any, rm: Any) -> Iterator[dict[str, Any]]:
    """One standard-plan tenant on llama-70b (600 requests/min, 1,000,000 tokens/min), its
    owner and one key, all pushed to the read model. No gateway: the test reads what one
    would be given."""
    from django.contrib.auth import get_user_model

    version = MODELS[0].upsert(make_current=True)
    plan = services.plan_create(name=PLANS[1].name, admission_class=PLANS[1].admission_class)
    services.plan_limit_set(plan=plan, family=version.family, **plan_limits(PLANS[1], MODELS[0]))
    owner = get_user_model().objects.create_user("acme-owner", "owner@acme.example", PASSWORD)
    tenant = services.tenant_create(name="acme", plan=plan, owner=owner)
    key, _ = services.api_key_create(tenant=tenant, name="batch jobs", created_by=owner)
    rm.rebuild()
    yield {"url": live_server.url, "tenant": tenant, "key": key, "rm": rm}


def test_an_owner_sets_a_key_limit_in_the_browser_and_it_reaches_the_read_model(
    keyed: dict[str, Any],
) -> None:
    from playwright.sync_api import sync_playwright

    key: ApiKey = keyed["key"]
    redis_key = schema.key_redis_key(key.key_hash)

    def pushed() -> dict[str, schema.KeyLimitRecord]:
        return schema.load_key(keyed["rm"].redis.get(redis_key)).limits

    assert pushed() == {}
    t = f"/t/{keyed['tenant'].id}"
    with sync_playwright() as pw:
        chromium = browser.launch(pw)
        page = chromium.new_page(viewport=browser.DESKTOP)
        page.set_default_timeout(15_000)
        pages = Pages(page, keyed["url"])
        _sign_in(pages, "acme-owner")

        pages.open(f"{t}/keys/")
        row = page.locator(f"tr[data-key-prefix='{key.prefix}']")
        assert row.get_by_test_id("key-limits").get_by_text("tenant's limits").is_visible()
        assert "600 requests/min" in page.get_by_test_id("tenant-limits").inner_text()
        page.get_by_role("link", name=f"Edit limits of batch jobs ({key.prefix}…)").click()
        page.wait_for_load_state("networkidle")
        pages.check("key-limits")

        # Above the tenant's limit: refused next to the field, nothing saved or pushed.
        page.get_by_label("Requests per minute").fill("120")
        page.get_by_label("Tokens per minute").fill("2000000")
        page.get_by_role("button", name="Save limits for llama-70b").click()
        page.wait_for_load_state("networkidle")
        error = page.locator("#id_llama-70b-tpm_error")
        assert "cannot exceed its tenant's limit for llama-70b (1000000)" in error.inner_text()
        assert page.get_by_label("Requests per minute").input_value() == "120"
        pages.check("key-limits-error")
        assert _db(lambda: key.model_limits.count()) == 0 and pushed() == {}

        # Corrected: saved, shown, and pushed to Redis once the transaction committed.
        page.get_by_label("Tokens per minute").fill("")
        page.get_by_label("Requests in flight").fill("2")
        page.get_by_role("button", name="Save limits for llama-70b").click()
        page.wait_for_load_state("networkidle")
        assert page.get_by_text("limits of “batch jobs” saved").is_visible()
        table = page.get_by_test_id("limits-llama-70b")
        assert table.get_by_test_id("key-rpm").inner_text() == "120"
        assert table.get_by_test_id("key-max_concurrency").inner_text() == "2"
        want = {"llama-70b": schema.KeyLimitRecord(rpm=120, tpm=0, max_concurrency=2)}
        wait_until(lambda: pushed() == want, timeout=5, interval=0.1, what="the pushed limits")

        page.get_by_role("link", name="All API keys").click()
        page.wait_for_load_state("networkidle")
        own = row.get_by_test_id("key-limits").inner_text()
        assert "llama-70b: 120 req/min (tenant 600), 2 in flight" in own

        # Removed again: only the tenant's limits, in the page and in Redis.
        pages.open(f"{t}/keys/{key.id}/limits/")
        page.get_by_role("button", name="Remove this key's limits for llama-70b").click()
        page.wait_for_load_state("networkidle")
        assert page.get_by_text("now has only the tenant's limits").is_visible()
        wait_until(lambda: pushed() == {}, timeout=5, interval=0.1, what="the limits removed")
        chromium.close()

    serious = {name: found for name, found in pages.checked.items() if found}
    assert not serious, serious
    assert set(pages.checked) == {"key-limits", "key-limits-error"}
