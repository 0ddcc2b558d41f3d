"""End to end in a real headless chromium: the console on a live server, one emulated
replica, a real gateway process fed by the control plane's read-model pushes, Redis and
PostgreSQL.

A customer signs in, creates a key (its secret shown once), calls the gateway with it through
the ``openai`` client, revokes it in the console and sees the next call refused (401); an
operator sees the fleet with live KV occupancy; axe-core finds no serious or critical
violation on any main page. With ``FAIRWAY_SCREENSHOTS_DIR`` set the same run saves each
main page at desktop and phone width (``python -m console.screenshots``).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.core.management import call_command
from django.db import connection
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from billing import services as billing_services
from catalog import services as catalog_services
from console import browser
from emulator.testing import spawn_emulator
from metering.models import Usage
from tenants import services
from tenants.demo import MODELS, PLANS, demo_usage_rows, plan_limits
from tenants.models import ApiKey, Role
from tests.support import free_port, launch_gateway, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PASSWORD = "a-Long-demo-pass-19"
SCREENSHOTS = os.environ.get("FAIRWAY_SCREENSHOTS_DIR", "")
OCTOBER = datetime(2026, 10, 1, tzinfo=UTC)
# The innermost elements reaching past the viewport's right edge (for the failure message).
WIDE = """() => Array.from(document.querySelectorAll('body *'))
  .filter(e => e.getBoundingClientRect().right > innerWidth + 1)
  .filter(e => !Array.from(e.children).some(c => c.getBoundingClientRect().right > innerWidth + 1))
  .slice(0, 8).map(e => e.tagName + '.' + e.className)"""
T = TypeVar("T")


@pytest.fixture
def pipeline(kafka_bootstrap: str, settings: Any) -> Iterator[dict[str, str]]:
    """The usage pipeline: a fresh topic on the embedded Kafka-protocol broker and the real
    consumer on its own thread, its metrics served as the Celery worker serves them."""
    from prometheus_client import REGISTRY, start_http_server

    from metering.consumer import ConsumerConfig, UsageConsumer
    from tests.metering.conftest import create_topic

    topic = f"usage-console-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    consumer = UsageConsumer(
        ConsumerConfig(
            bootstrap=kafka_bootstrap, topic=topic, group_id=f"console-{uuid.uuid4().hex[:6]}"
        )
    )
    consumer.start()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    settings.FAIRWAY_INGEST_METRICS_URLS = [f"http://127.0.0.1:{port}/metrics"]
    try:
        yield {"bootstrap": kafka_bootstrap, "topic": topic}
    finally:
        server.shutdown()
        thread.join(timeout=5)
        consumer.stop()


@pytest.fixture
def stack(
    transactional_db: None,
    live_server: Any,
    redis_url: str,
    settings: Any,
    tmp_path: Path,
    rm: Any,
    pipeline: dict[str, str],
) -> Iterator[dict[str, Any]]:
    """Catalog, plans, a standard tenant with an owner, an operator; one replica; a gateway
    whose usage events go through Kafka to the consumer."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    demo = MODELS[1]  # llama-8b
    with spawn_emulator("llama-8b-tp1-h100", demo.version, speed=5.0) as replica:
        version = demo.upsert(make_current=True)
        catalog_services.replica_upsert(
            version=version, name="replica-8b-a", base_url=replica.base_url
        )
        plan_demo = PLANS[1]  # standard
        plan = services.plan_create(
            name=plan_demo.name,
            admission_class=plan_demo.admission_class,
            display_name=plan_demo.display_name,
        )
        services.plan_limit_set(plan=plan, family=version.family, **plan_limits(plan_demo, demo))
        users = get_user_model().objects
        owner = users.create_user("acme-owner", "owner@acme.example", PASSWORD)
        tenant = services.tenant_create(name="acme", plan=plan, owner=owner)
        colleague = users.create_user("acme-dev", "dev@acme.example", PASSWORD)
        services.membership_add(tenant=tenant, user=colleague, role=Role.MEMBER)
        operator = users.create_user("ops", "ops@fairway.example", PASSWORD, is_staff=True)
        operator.user_permissions.add(
            Permission.objects.get(content_type__app_label="tenants", codename="operate")
        )
        finance = users.create_user("fin", "fin@fairway.example", PASSWORD, is_staff=True)
        for codename in ("view_reconciliation", "manage_invoices"):
            finance.user_permissions.add(
                Permission.objects.get(content_type__app_label="billing", codename=codename)
            )
        demo_key, _ = services.api_key_create(tenant=tenant, name="history", created_by=owner)
        Usage.objects.bulk_create(
            Usage(tenant=tenant, api_key_id=demo_key.id, model_version=version, **row.counts)
            for row in demo_usage_rows(plan="standard", days=14, seed="e2e")
            if row.version == demo.version
        )
        # A closed month with a finalized invoice, for the invoice and finance pages.
        Usage.objects.create(
            tenant=tenant, api_key_id=demo_key.id, model_version=version, hour=OCTOBER,
            requests=40, prompt_tokens=3_000_000, cached_tokens=1_000_000,
            completion_tokens=600_000,
        )  # fmt: skip
        invoice = billing_services.invoice_draft_build(tenant=tenant, period_start=OCTOBER)
        assert invoice is not None
        invoice = billing_services.invoice_finalize(
            invoice=invoice, actor=billing_services.Actor.system("e2e"), reason="month over"
        )
        call_command("push_config", stdout=io.StringIO())
        gateway = launch_gateway(
            tmp_path,
            redis_url,
            env={
                "KAFKA_BOOTSTRAP": pipeline["bootstrap"],
                "GATEWAY_USAGE_TOPIC": pipeline["topic"],
            },
        )
        settings.FAIRWAY_GATEWAY_METRICS_URLS = [f"http://127.0.0.1:{gateway.port}/metrics"]
        settings.FAIRWAY_API_BASE_URL = f"http://127.0.0.1:{gateway.port}/v1"
        try:
            yield {
                "url": live_server.url,
                "gateway": f"http://127.0.0.1:{gateway.port}/v1",
                "tenant": tenant,
                "replica": replica,
                "invoice": invoice,
            }
        finally:
            gateway.process.terminate()
            gateway.process.wait(timeout=15)


class Pages:
    """Page visits with the accessibility check and optional screenshots."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.checked: dict[str, list[dict[str, Any]]] = {}

    def open(self, path: str) -> Any:
        response = self.page.goto(self.base + path)
        assert response is not None and response.status == 200, (path, response and response.status)
        self.page.wait_for_load_state("networkidle")
        return response

    def check(self, name: str) -> None:
        self.checked[name] = browser.axe_violations(self.page)
        # Responsive: at a phone's width nothing makes the page scroll sideways.
        self.page.set_viewport_size(browser.PHONE)
        fits = "() => document.documentElement.scrollWidth <= window.innerWidth"
        with contextlib.suppress(PlaywrightTimeout):  # charts resize a frame or two later
            self.page.wait_for_function(fits, timeout=2000)
        overflow = self.page.evaluate(
            "() => document.documentElement.scrollWidth - window.innerWidth"
        )
        wide = self.page.evaluate(WIDE) if overflow > 0 else []
        self.page.set_viewport_size(browser.DESKTOP)
        if overflow > 0:
            self.checked[name] = [
                *self.checked[name],
                {"id": "phone-overflow", "px": overflow, "elements": wide},
            ]
        if SCREENSHOTS:
            out = Path(SCREENSHOTS)
            out.mkdir(parents=True, exist_ok=True)
            for label, size in (("desktop", browser.DESKTOP), ("phone", browser.PHONE)):
                self.page.set_viewport_size(size)
                self.page.wait_for_timeout(150)  # let the chart resize (a frame, not a sync)
                self.page.screenshot(path=str(out / f"{name}-{label}.png"), full_page=True)
            self.page.set_viewport_size(browser.DESKTOP)


def _sign_in(pages: Pages, username: str) -> None:
    pages.open("/login/")
    pages.page.get_by_label("Username").fill(username)
    pages.page.get_by_label("Password").fill(PASSWORD)
    pages.page.get_by_role("button", name="Sign in").click()
    pages.page.wait_for_load_state("networkidle")


def _sign_out(pages: Pages) -> None:
    pages.page.get_by_role("button", name="Sign out").click()
    pages.page.wait_for_url("**/login/")


def test_customer_and_operator_journeys_in_a_real_browser(stack: dict[str, Any]) -> None:
    from openai import AuthenticationError, OpenAI
    from playwright.sync_api import sync_playwright

    tenant = stack["tenant"]
    t = f"/t/{tenant.id}"
    with sync_playwright() as pw:
        chromium = browser.launch(pw)
        context = chromium.new_context(viewport=browser.DESKTOP, timezone_id="Europe/Berlin")
        page = context.new_page()
        page.set_default_timeout(15_000)
        pages = Pages(page, stack["url"])

        # Sign-in page, then the overview.
        pages.open("/login/")
        pages.check("login")
        _sign_in(pages, "acme-owner")
        assert page.url.endswith(f"{t}/")
        assert page.get_by_role("heading", name="acme").is_visible()
        # Local time with UTC on hover, thousands separators.
        title = page.locator("time[data-local]").first.get_attribute("title")
        assert title is not None and title.endswith("UTC")
        assert "," in page.get_by_test_id("month-prompt").inner_text()
        pages.check("overview")

        # Create a key: the secret is shown once, with a copy button.
        pages.open(f"{t}/keys/")
        pages.check("keys")
        # Keyboard: the first Tab reaches the skip link, which moves focus to the content.
        page.keyboard.press("Tab")
        assert page.evaluate("() => document.activeElement.textContent") == "Skip to content"
        page.keyboard.press("Enter")
        assert page.evaluate("() => document.activeElement.id") == "main"
        page.get_by_label("Name").focus()
        page.keyboard.type("e2e key")
        sent = {
            name: page.locator(f"input[name={name}]").first.input_value()
            for name in ("form_id", "csrfmiddlewaretoken")
        }
        page.keyboard.press("Enter")  # submits the form from its text field
        page.wait_for_load_state("networkidle")
        secret = page.get_by_test_id("secret-value").inner_text().strip()
        assert secret.startswith("fw-") and len(secret) > 40
        assert page.get_by_role("button", name="Copy key").is_visible()
        pages.check("key-created")
        # The same form sent again (what a reload does): no second key, no secret.
        again = context.request.post(
            f"{stack['url']}{t}/keys/", form={**sent, "name": "e2e key", "scopes": "chat"}
        )
        assert again.ok and "already sent" in again.text() and secret not in again.text()
        assert _db(lambda: ApiKey.objects.filter(name="e2e key").count()) == 1
        pages.open(f"{t}/keys/")
        assert secret not in page.content()
        assert all(secret not in c["value"] for c in context.cookies())

        # Call the gateway with it through the openai client.
        client = OpenAI(base_url=stack["gateway"], api_key=secret, max_retries=0, timeout=30)

        def call() -> Any:
            return client.chat.completions.create(
                model="llama-8b",
                messages=[{"role": "user", "content": "Say hello"}],
                max_tokens=8,
            )

        reply = wait_until(
            lambda: _ok_or_none(call), timeout=15, interval=0.2, what="the new key works"
        )
        assert reply.usage.completion_tokens > 0

        # The call's usage event goes gateway -> Kafka -> consumer -> usage and request_log,
        # and shows up on the usage page under the new key, with the tokens the client saw.
        key_id = _db(lambda: ApiKey.objects.get(name="e2e key").pk)
        wait_until(
            lambda: _db(lambda: Usage.objects.filter(api_key_id=key_id).exists()),
            timeout=30,
            interval=0.2,
            what="the call's usage row",
        )
        pages.open(f"{t}/usage/?key={key_id}")
        assert page.get_by_test_id("range-requests").inner_text() == "1"
        assert page.get_by_test_id("range-prompt").inner_text() == f"{reply.usage.prompt_tokens:,}"
        assert page.get_by_test_id("range-completion").inner_text() == (
            f"{reply.usage.completion_tokens:,}"
        )
        # And the overview's latency panel now has the request log's numbers.
        pages.open(f"{t}/")
        assert page.get_by_test_id("ttft-p95").inner_text().endswith(" ms")

        # Usage page: chart and tables from the seeded history.
        pages.open(f"{t}/usage/")
        assert page.locator("canvas#usage-chart").is_visible()
        assert page.get_by_test_id("by-model").is_visible()
        pages.check("usage")
        # htmx swaps the chart in place and pushes the query into the address bar.
        with page.expect_response(lambda r: "granularity=hour" in r.url):
            page.get_by_label("Granularity").select_option("hour")
        page.wait_for_url("**granularity=hour**")
        assert page.get_by_role("heading", name="Tokens per hour").is_visible()
        assert page.locator("canvas#usage-chart").is_visible()

        pages.open(f"{t}/limits/")
        assert page.get_by_text("Requests per minute").first.is_visible()
        pages.check("limits")
        pages.open(f"{t}/members/")
        assert page.get_by_role("cell", name="acme-dev", exact=True).is_visible()
        pages.check("members")
        pages.open("/password/")
        pages.check("password")
        invoice = stack["invoice"]
        pages.open(f"{t}/invoices/")
        pages.check("invoices")
        page.get_by_role("link", name=invoice.number, exact=True).click()
        page.wait_for_load_state("networkidle")
        assert page.get_by_test_id("invoice-lines").is_visible()
        assert page.get_by_test_id("invoice-total").inner_text().startswith("$")
        pages.check("invoice")

        # Revoke in the console: the next call is refused with 401 within about a second.
        pages.open(f"{t}/keys/")
        page.get_by_role("link", name="Revoke e2e key").click()
        pages.check("key-revoke")
        page.get_by_role("button", name="Revoke key").click()
        page.wait_for_load_state("networkidle")
        assert page.get_by_text("is revoked").is_visible()
        assert _db(lambda: ApiKey.objects.get(name="e2e key").revoked_at) is not None

        def refused() -> bool:
            try:
                call()
            except AuthenticationError as exc:
                return exc.status_code == 401
            return False

        wait_until(refused, timeout=3, interval=0.1, what="the revoked key is refused")
        _sign_out(pages)

        # An operator: the fleet with live occupancy, while a long generation runs.
        _sign_in(pages, "ops")
        assert page.url.endswith("/ops/fleet/")
        assert page.locator("tr[data-replica='replica-8b-a']").get_by_text("healthy").is_visible()
        busy_client = OpenAI(
            base_url=stack["gateway"],
            api_key=_db(lambda: services.api_key_create(tenant=tenant, name="load")[1]),
            max_retries=0,
            timeout=60,
        )
        stop = threading.Event()
        worker = threading.Thread(target=_keep_busy, args=(busy_client, stop), daemon=True)
        worker.start()
        try:

            def occupied() -> bool:
                pages.open("/ops/fleet/")
                text = page.locator("tr[data-replica='replica-8b-a'] [data-testid=kv]").inner_text()
                return float(text.rstrip(" %")) > 0

            wait_until(occupied, timeout=20, interval=0.3, what="KV occupancy above 0 %")
        finally:
            stop.set()
            worker.join(timeout=30)
        assert page.get_by_test_id("admission").is_visible()
        assert page.get_by_test_id("consumer-lag").is_visible()
        assert "none" in page.get_by_test_id("dead-letters-db").inner_text()
        pages.check("fleet")
        pages.open("/ops/tenants/")
        pages.check("ops-tenants")
        pages.open(f"/ops/tenants/{tenant.id}/")
        pages.check("ops-tenant")
        _sign_out(pages)

        # Finance: the invoice across tenants, marked paid with a reason (an audit row),
        # and the reconciliation report for the month.
        _sign_in(pages, "fin")
        assert page.url.endswith("/finance/invoices/")
        pages.open("/finance/invoices/?period=2026-10")
        pages.check("finance-invoices")
        page.get_by_role("link", name=f"{invoice.number} acme 2026-10").click()
        page.wait_for_load_state("networkidle")
        page.get_by_label("Reason").fill("paid by bank transfer")
        page.get_by_role("button", name="Mark paid").click()
        page.wait_for_load_state("networkidle")
        audit = page.get_by_test_id("audit")
        assert audit.get_by_text("paid by bank transfer").is_visible()
        assert audit.get_by_role("cell", name="fin", exact=True).is_visible()
        pages.check("finance-invoice")
        pages.open("/finance/reconciliation/?period=2026-10")
        # The request log holds no October partition: one highlighted, explained difference.
        assert page.get_by_role("heading", name="1 difference in 2026-10").is_visible()
        row = page.locator("tr.diff")
        assert row.count() == 1 and "request_log retention expired" in row.inner_text()
        pages.check("reconciliation")
        context.close()
        chromium.close()

    serious = {name: found for name, found in pages.checked.items() if found}
    assert not serious, serious
    assert len(pages.checked) >= 17


def _ok_or_none(call: Any) -> Any:
    from openai import AuthenticationError

    try:
        return call()
    except AuthenticationError:
        return None  # the read-model push has not reached the gateway yet


def _db(read: Callable[[], T]) -> T:
    """Run ORM code off the main thread: Playwright's sync API keeps an event loop running
    there, and Django refuses database calls from a thread with a running loop."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_closing(read)).result()


def _closing(read: Callable[[], T]) -> Callable[[], T]:
    def run() -> T:
        try:
            return read()
        finally:
            connection.close()

    return run


def _keep_busy(client: Any, stop: threading.Event) -> None:
    """Long streamed generations, one after another, so the replica holds KV."""
    for _ in range(20):
        if stop.is_set():
            return
        with contextlib.suppress(Exception):
            stream = client.chat.completions.create(
                model="llama-8b",
                messages=[{"role": "user", "content": "tell a long story " * 400}],
                max_tokens=2000,
                stream=True,
                # long for certain: a natural end drawn early would leave the replica idle
                # between requests while the page polls
                extra_body={"ignore_eos": True},
            )
            for _chunk in stream:
                if stop.is_set():
                    stream.close()
                    return


def test_the_accessibility_check_finds_real_violations() -> None:
    """The axe-core check is not vacuous: a page with an unlabelled input and an image
    without alt text fails it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = browser.launch(pw)
        page = chromium.new_page()
        page.set_content(
            '<!doctype html><html lang="en"><head><title>t</title></head><body><main>'
            '<img src="data:image/gif;base64,R0lGODlhAQABAAAAACw="><input type="text">'
            "</main></body></html>"
        )
        found = {v["id"] for v in browser.axe_violations(page)}
        chromium.close()
    assert {"image-alt", "label"} <= found
