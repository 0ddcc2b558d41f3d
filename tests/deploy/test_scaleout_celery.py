"""Two Celery worker processes on one queue: the Stripe outbox drain, sent many times, is
shared between them and no outbox row runs twice (SELECT ... FOR UPDATE SKIP LOCKED, and
each row's Stripe calls carry idempotency keys). Real workers, real Redis broker, the
test's PostgreSQL database, the Stripe fake (Stripe itself cannot be reached here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from billing.models import OutboxKind, OutboxStatus, StripeOutbox
from billing.tasks import stripe_outbox_drain
from billing.testing.stripe_fake import StripeFake
from catalog.models import ModelVersion
from tests.billing.conftest import add_usage, stripe_fake  # noqa: F401 - fixtures
from tests.billing.test_stripe_sync import (  # noqa: F401 - celery_broker is a fixture
    _database_url,
    assert_mirrored_once_per_tenant,
    celery_broker,
    finalized_invoice,
)
from tests.controlplane.conftest import family_70b, plans, version_70b  # noqa: F401
from tests.support import ROOT, wait_until

WORKERS = 2
ROWS = 8


@pytest.fixture
def workers(
    stripe_fake: StripeFake,  # noqa: F811
    celery_broker: Any,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("STRIPE_", "BILLING_"))},
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "fairway.settings.local",
        "DATABASE_URL": _database_url(),
        "REDIS_URL": redis_url,
        "STRIPE_API_KEY": stripe_fake.api_key,
        "STRIPE_API_BASE": stripe_fake.url,
        "STRIPE_TIMEOUT_MS": "2000",
        "BILLING_OUTBOX_DRAIN_S": "3600",
    }
    started = []
    for n in range(WORKERS):
        log = tmp_path / f"worker-{n}.log"
        argv = [
            sys.executable, "-m", "celery", "-A", "fairway.celery", "worker",
            "--concurrency=1", "--prefetch-multiplier=1", "--loglevel=INFO",
            "--without-gossip", "--without-mingle", "--hostname", f"scaleout-{n}-{os.getpid()}@%h",
        ]  # fmt: skip
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        started.append((proc, log))
    try:
        for proc, log in started:

            def ready(proc: subprocess.Popen[bytes] = proc, log: Path = log) -> bool:
                assert proc.poll() is None, log.read_text()
                return " ready." in log.read_text()

            wait_until(ready, 60, interval=0.1, what="worker ready")
        yield started
    finally:
        for proc, _ in started:
            proc.terminate()
        for proc, _ in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_two_workers_share_the_outbox_drain_and_run_no_row_twice(
    plans: Any,  # noqa: F811
    version_70b: ModelVersion,  # noqa: F811
    add_usage: Callable[..., Any],  # noqa: F811
    stripe_fake: StripeFake,  # noqa: F811
    workers: list[tuple[subprocess.Popen[bytes], Path]],
    settings: Any,
) -> None:
    from tenants import services as tenant_services

    tenants = [
        tenant_services.tenant_create(name=f"scale-{i}", plan=plans["standard"])
        for i in range(ROWS)
    ]
    key, settings.STRIPE_API_KEY = settings.STRIPE_API_KEY, ""  # finalize with sync off ...
    invoices = [finalized_invoice(t, version_70b, add_usage) for t in tenants]
    settings.STRIPE_API_KEY = key
    rows = [
        StripeOutbox.objects.create(
            kind=OutboxKind.INVOICE_PUSH, invoice=i, next_attempt_at=timezone.now()
        )
        for i in invoices
    ]
    # Slow Stripe answers, so drains overlap on both workers.
    stripe_fake.delay_next(ROWS, 0.3)
    for _ in range(ROWS):  # as beat and finalize hooks do: many drains, any worker
        stripe_outbox_drain.delay()

    def drained() -> bool:
        for proc, log in workers:
            assert proc.poll() is None, log.read_text()
        return not StripeOutbox.objects.filter(status=OutboxStatus.PENDING).exists()

    wait_until(drained, 90, interval=0.1, what="the outbox to drain")
    for row in rows:
        row.refresh_from_db()
        assert (row.status, row.attempts) == (OutboxStatus.DONE, 1), row.last_error
    for invoice in invoices:
        assert_mirrored_once_per_tenant(stripe_fake, invoice)
    posts = [r for r in stripe_fake.state.requests if r.method == "POST"]
    assert posts and all(r.outcome == "applied" for r in posts)  # no request repeated
    assert len(stripe_fake.state.customers) == ROWS and len(stripe_fake.state.invoices) == ROWS

    # Both workers took drain tasks off the one queue, and together ran all that were sent.
    def succeeded(log: Path) -> int:
        return len(re.findall(r"stripe_outbox_drain\[[^\]]+\] succeeded", log.read_text()))

    wait_until(lambda: sum(succeeded(log) for _, log in workers) >= ROWS, 30, what="tasks")
    per_worker = [succeeded(log) for _, log in workers]
    assert all(n >= 1 for n in per_worker), [log.read_text()[-3000:] for _, log in workers]
    # The rows each worker pushed (the tasks' results) add up to the rows, once each.
    done = [
        sum(int(n) for n in re.findall(r"succeeded in [0-9.]+s: \{'done': (\d+)", log.read_text()))
        for _, log in workers
    ]
    assert sum(done) == ROWS and all(d >= 1 for d in done), done
