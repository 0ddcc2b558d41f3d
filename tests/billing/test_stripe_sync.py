"""Stripe sync through the outbox, against our stateful Stripe fake over loopback HTTP:
every invoice item is created exactly once despite forced 500s and client timeouts, also
when a real Celery worker process drains the outbox."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import stripe
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from billing import outbox, services, stripe_sync
from billing.models import Invoice, InvoiceStatus, OutboxKind, OutboxStatus, StripeOutbox
from billing.pricing import to_minor_units
from billing.testing.stripe_fake import StripeFake
from catalog.models import ModelVersion
from tenants.models import Tenant
from tests.billing.conftest import utc
from tests.support import ROOT, wait_until

NOV = utc(2026, 11, 1)
DEC = utc(2026, 12, 1)
FINANCE = services.Actor(label="finance-test")
ITEMS = "/v1/invoiceitems"


def finalized_invoice(
    tenant: Tenant, version: ModelVersion, add_usage: Callable[..., Any]
) -> Invoice:
    add_usage(
        tenant,
        version,
        utc(2026, 11, 10, 12),
        prompt=2_000_000,
        cached=1_000_000,
        completion=1_000_000,
    )
    draft = services.invoice_draft_build(tenant=tenant, period_start=NOV)
    assert draft is not None
    return services.invoice_finalize(invoice=draft, actor=FINANCE, now=DEC)


def assert_mirrored_once(fake: StripeFake, invoice: Invoice) -> None:
    invoice.refresh_from_db()
    assert invoice.stripe_invoice_id
    remote = fake.state.invoices[invoice.stripe_invoice_id]
    assert remote["status"] == "open"
    items = fake.items_for(invoice.stripe_invoice_id)
    lines = list(invoice.lines.order_by("position"))
    # One item per line, none twice, amounts in minor units, ids recorded on our lines.
    assert sorted(i["metadata"]["fairway_line_id"] for i in items) == sorted(
        str(ln.pk) for ln in lines
    )
    assert {i["id"]: i["amount"] for i in items} == {
        ln.stripe_item_id: to_minor_units(ln.amount, invoice.currency) for ln in lines
    }
    assert remote["total"] == to_minor_units(invoice.total, invoice.currency)
    assert len(fake.state.customers) == 1


def test_sdk_and_api_version_are_pinned_together() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"stripe=={stripe_sync.STRIPE_SDK_VERSION}"' in pyproject
    assert stripe.VERSION == stripe_sync.STRIPE_SDK_VERSION
    # The API version the installed SDK is generated against.
    from stripe._api_version import _ApiVersion

    assert _ApiVersion.CURRENT == stripe_sync.STRIPE_API_VERSION


def test_every_process_says_at_start_whether_stripe_sync_is_off(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from django.apps import apps

    ready = apps.get_app_config("billing").ready  # what each process runs at start
    settings.STRIPE_API_KEY = ""
    with caplog.at_level("WARNING", logger="fairway.billing.stripe"):
        ready()
    (record,) = [r for r in caplog.records if r.name == "fairway.billing.stripe"]
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith("Stripe sync is OFF (STRIPE_API_KEY is not set)")
    caplog.clear()
    settings.STRIPE_API_KEY = "sk_test_on"
    with caplog.at_level("DEBUG", logger="fairway.billing.stripe"):
        ready()
    assert not [r for r in caplog.records if r.name == "fairway.billing.stripe"]


@pytest.mark.django_db
def test_push_mirrors_the_invoice_with_idempotency_keys_and_pinned_version(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
) -> None:
    invoice = finalized_invoice(tenant_a, version_70b, add_usage)
    row = StripeOutbox.objects.get(invoice=invoice)
    assert (row.kind, row.status) == (OutboxKind.INVOICE_PUSH, OutboxStatus.PENDING)
    assert not stripe_fake.state.requests  # nothing is sent before the drain (after commit)
    result = outbox.drain()
    assert (result.done, result.failed) == (1, 0)
    assert_mirrored_once(stripe_fake, invoice)
    tenant_a.refresh_from_db()
    assert tenant_a.stripe_customer_id in stripe_fake.state.customers
    posts = [r for r in stripe_fake.state.requests if r.method == "POST"]
    assert [r.path for r in posts] == [
        "/v1/customers",
        "/v1/invoices",
        ITEMS,
        ITEMS,
        ITEMS,
        f"/v1/invoices/{invoice.stripe_invoice_id}/finalize",
    ]
    assert all(r.stripe_version == stripe_sync.STRIPE_API_VERSION for r in posts)
    assert all(
        re.fullmatch(rf"fairway-outbox-{row.pk}-[a-z0-9-]+", r.idempotency_key or "") for r in posts
    )
    assert len({r.idempotency_key for r in posts}) == len(posts)
    row.refresh_from_db()
    assert (row.status, row.attempts) == (OutboxStatus.DONE, 1)
    # A second drain has nothing to do.
    assert outbox.drain().done == 0


@pytest.mark.django_db
def test_each_item_created_once_despite_500s_and_client_timeouts(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
) -> None:
    invoice = finalized_invoice(tenant_a, version_70b, add_usage)
    # The first two item requests fail with 500 (not applied); the next two are applied
    # but answered after the client's 0.5 s timeout (the client sees a timeout).
    stripe_fake.fail_next(2, path=ITEMS)
    stripe_fake.delay_next(2, 1.0, path=ITEMS)
    result = outbox.drain()
    # At least 2 failures and 2 timeouts (a slow machine may add a timeout; harmless).
    assert result.done == 1 and result.failed >= 4, result.errors
    assert sum("APIError" in e for e in result.errors) == 2
    assert sum("APIConnectionError" in e for e in result.errors) >= 2
    assert_mirrored_once(stripe_fake, invoice)
    outcomes = [r.outcome for r in stripe_fake.requests_to("POST", ITEMS)]
    # 2 injected failures, then each item applied once; retries of the first were replays.
    assert outcomes.count("failed (injected)") == 2
    assert outcomes.count("applied") == 3
    assert outcomes.count("replayed") >= 1
    row = StripeOutbox.objects.get(invoice=invoice)
    assert (row.status, row.last_error) == (OutboxStatus.DONE, "")
    assert row.attempts == result.failed + 1


@pytest.mark.django_db
def test_failing_row_backs_off_exponentially_then_gives_up(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
    settings: Any,
) -> None:
    settings.BILLING_OUTBOX_BACKOFF_BASE_MS = 1000
    settings.BILLING_OUTBOX_BACKOFF_MAX_S = 5
    settings.BILLING_OUTBOX_MAX_ATTEMPTS = 3
    assert [outbox.backoff(n).total_seconds() for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 5, 5]
    invoice = finalized_invoice(tenant_a, version_70b, add_usage)
    stripe_fake.fail_next(100)
    row = StripeOutbox.objects.get(invoice=invoice)
    for attempt in (1, 2, 3):
        result = outbox.drain(now=row.next_attempt_at)
        assert result.failed == 1
        row.refresh_from_db()
        assert row.attempts == attempt
        if attempt < 3:  # waits 1 s, then 2 s; not due a moment before that
            wait = (row.next_attempt_at - row.updated_at).total_seconds()
            assert abs(wait - 2 ** (attempt - 1)) < 0.5
            early = row.next_attempt_at - timedelta(milliseconds=100)
            assert outbox.drain(now=early).failed == 0
    assert row.status == OutboxStatus.FAILED and "injected failure" in row.last_error
    assert not stripe_fake.state.customers
    stripe_fake.fail_next(0)
    outbox.outbox_retry(row=row)
    assert outbox.drain().done == 1
    assert_mirrored_once(stripe_fake, invoice)


@pytest.mark.django_db
def test_void_and_paid_out_of_band_reach_stripe(
    tenant_a: Tenant,
    tenant_b: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
) -> None:
    a = finalized_invoice(tenant_a, version_70b, add_usage)
    b = finalized_invoice(tenant_b, version_70b, add_usage)
    assert outbox.drain().done == 2
    services.invoice_void(invoice=a, actor=FINANCE, reason="duplicate account")
    services.invoice_mark_paid(invoice=b, actor=FINANCE, reason="wire")
    assert outbox.drain().done == 2
    a.refresh_from_db()
    b.refresh_from_db()
    assert stripe_fake.state.invoices[a.stripe_invoice_id]["status"] == "void"
    remote_b = stripe_fake.state.invoices[b.stripe_invoice_id]
    assert (remote_b["status"], remote_b["paid_out_of_band"]) == ("paid", True)
    assert len(stripe_fake.state.customers) == 2


@pytest.mark.django_db
def test_void_before_the_push_ran_sends_nothing(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
) -> None:
    a = finalized_invoice(tenant_a, version_70b, add_usage)
    services.invoice_void(invoice=a, actor=FINANCE, reason="wrong tenant")
    # The void row waits for the push row; the push sees the void and sends nothing.
    assert outbox.drain().done == 2
    assert not stripe_fake.state.requests
    notes = dict(StripeOutbox.objects.filter(invoice=a).values_list("kind", "status"))
    assert notes == {OutboxKind.INVOICE_PUSH: "done", OutboxKind.INVOICE_VOID: "done"}


@pytest.mark.django_db
def test_fake_speaks_stripe_idempotency_and_errors(stripe_fake: StripeFake) -> None:
    sc = stripe.StripeClient(
        api_key=stripe_fake.api_key,
        base_addresses={"api": stripe_fake.url},
        stripe_version=stripe_sync.STRIPE_API_VERSION,
        max_network_retries=0,
    )
    first = sc.v1.customers.create(params={"name": "x"}, options={"idempotency_key": "k1"})
    again = sc.v1.customers.create(params={"name": "x"}, options={"idempotency_key": "k1"})
    assert first.id == again.id and len(stripe_fake.state.customers) == 1
    with pytest.raises(stripe.IdempotencyError):
        sc.v1.customers.create(params={"name": "y"}, options={"idempotency_key": "k1"})
    with pytest.raises(stripe.InvalidRequestError) as missing:
        sc.v1.invoices.retrieve("in_nope")
    assert missing.value.http_status == 404 and missing.value.code == "resource_missing"
    bad = stripe.StripeClient(api_key="sk_wrong", base_addresses={"api": stripe_fake.url})
    with pytest.raises(stripe.AuthenticationError):
        bad.v1.customers.create(params={"name": "z"})


# -- a real Celery worker process --------------------------------------------------------


@pytest.fixture
def celery_broker(redis_url: str) -> Any:
    """The suite's Redis DB as broker, emptied around the test, and the Celery app told
    to send tasks there instead of running them eagerly in the test process."""
    from fairway.celery import app

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    eager = app.conf.task_always_eager
    app.conf.task_always_eager = False
    yield app
    app.conf.task_always_eager = eager
    client.flushdb()
    client.close()


def _database_url() -> str:
    db = connection.settings_dict
    host, port = db.get("HOST") or "127.0.0.1", db.get("PORT") or 5432
    auth = db.get("USER") or "postgres"
    if db.get("PASSWORD"):
        auth += f":{db['PASSWORD']}"
    return f"postgres://{auth}@{host}:{port}/{db['NAME']}"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_real_celery_worker_drains_outbox_exactly_once_through_faults(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
    celery_broker: Any,
    redis_url: str,
    tmp_path: Path,
) -> None:
    # Two worker processes race for the rows (SKIP LOCKED); the fake fails item requests
    # three times and answers one after the client's timeout.
    stripe_fake.fail_next(3, path=ITEMS)
    stripe_fake.delay_next(1, 1.5, path=ITEMS)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("STRIPE_", "BILLING_"))},
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "fairway.settings.local",  # not eager, unlike the tests
        "DATABASE_URL": _database_url(),  # the test database (transaction=True: committed)
        "REDIS_URL": redis_url,
        "STRIPE_API_KEY": stripe_fake.api_key,
        "STRIPE_API_BASE": stripe_fake.url,
        "STRIPE_TIMEOUT_MS": "500",
        "BILLING_OUTBOX_BACKOFF_BASE_MS": "100",
        "BILLING_OUTBOX_DRAIN_S": "3600",  # no beat here: retries come from the backoff
    }
    log_path = tmp_path / "worker.log"
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "fairway.celery",
        "worker",
        "--concurrency=2",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        "--hostname",
        f"billing-test-{os.getpid()}@%h",
    ]
    with open(log_path, "ab") as log:
        worker = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # Finalizing commits the outbox row; its on_commit hook sends the drain task to
        # the broker, where the worker picks it up.
        invoice = finalized_invoice(tenant_a, version_70b, add_usage)
        row = StripeOutbox.objects.get(invoice=invoice)

        def settled() -> bool:
            if worker.poll() is not None:
                raise AssertionError(f"worker exited:\n{log_path.read_text()}")
            row.refresh_from_db()
            return row.status != OutboxStatus.PENDING

        wait_until(settled, timeout=60, interval=0.1, what="the worker to drain the outbox")
        assert row.status == OutboxStatus.DONE, (row.last_error, log_path.read_text())
        assert row.attempts >= 5  # 3 failures and at least one timeout, then success
        assert_mirrored_once(stripe_fake, invoice)
        outcomes = [r.outcome for r in stripe_fake.requests_to("POST", ITEMS)]
        assert outcomes.count("applied") == 3 and outcomes.count("failed (injected)") == 3
        assert "billing.tasks.stripe_outbox_drain" in log_path.read_text()
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=10)
    assert Invoice.objects.get(pk=invoice.pk).status == InvoiceStatus.FINALIZED
    assert django_settings.CELERY_TASK_ALWAYS_EAGER  # the test process itself stays eager


@pytest.mark.django_db(transaction=True)
def test_concurrent_drains_never_run_a_row_twice(
    plans: Any,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    stripe_fake: StripeFake,
    settings: Any,
) -> None:
    """Three drains at once over four due rows (separate connections, committed data):
    SKIP LOCKED hands each row to exactly one of them."""
    import threading

    from django.db import connections

    from tenants import services as tenant_services

    tenants = [
        tenant_services.tenant_create(name=f"conc-{i}", plan=plans["standard"]) for i in range(4)
    ]
    key, settings.STRIPE_API_KEY = settings.STRIPE_API_KEY, ""  # finalize with sync off ...
    invoices = [finalized_invoice(t, version_70b, add_usage) for t in tenants]
    settings.STRIPE_API_KEY = key  # ... then queue the pushes by hand, nothing drained yet
    rows = [
        StripeOutbox.objects.create(
            kind=OutboxKind.INVOICE_PUSH, invoice=i, next_attempt_at=timezone.now()
        )
        for i in invoices
    ]
    stripe_fake.delay_next(3, 0.2)  # the drains' first requests overlap
    results: list[Any] = []

    def drain() -> None:
        try:
            results.append(outbox.drain())
        finally:
            connections.close_all()

    threads = [threading.Thread(target=drain) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(r.done for r in results) == 4 and sum(r.failed for r in results) == 0
    for row in rows:
        row.refresh_from_db()
        assert (row.status, row.attempts) == (OutboxStatus.DONE, 1)
    for invoice in invoices:
        assert_mirrored_once_per_tenant(stripe_fake, invoice)
    posts = [r for r in stripe_fake.state.requests if r.method == "POST"]
    assert posts and all(r.outcome == "applied" for r in posts)  # no row ran twice
    assert len(stripe_fake.state.customers) == 4


def assert_mirrored_once_per_tenant(fake: StripeFake, invoice: Invoice) -> None:
    invoice.refresh_from_db()
    items = fake.items_for(invoice.stripe_invoice_id)
    assert sorted(i["metadata"]["fairway_line_id"] for i in items) == sorted(
        str(pk) for pk in invoice.lines.values_list("pk", flat=True)
    )
