"""Drain the Stripe outbox: claim due rows with ``SELECT … FOR UPDATE SKIP LOCKED`` (so
any number of workers can drain at once and never run one row twice concurrently), run
each row's steps, and on failure back off exponentially: the row's next try waits
base × 2^(attempts-1), capped, and after BILLING_OUTBOX_MAX_ATTEMPTS it is marked failed
(reconciliation lists it; ``outbox_retry`` puts it back).

A row's steps run while its lock is held; the Stripe ids each step gets back are written
as they arrive, so a failure part-way keeps the progress and the retry resumes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import stripe_sync
from billing.models import OutboxKind, OutboxStatus, StripeOutbox

log = logging.getLogger("fairway.billing.outbox")


@dataclass
class DrainResult:
    done: int = 0
    failed: int = 0  # attempts that failed (the row is retried later or gave up)
    skipped: int = 0
    next_due: datetime | None = None
    errors: list[str] = field(default_factory=list)


def backoff(attempts: int) -> timedelta:
    base_s = settings.BILLING_OUTBOX_BACKOFF_BASE_MS / 1000
    return timedelta(
        seconds=min(base_s * 2 ** max(attempts - 1, 0), settings.BILLING_OUTBOX_BACKOFF_MAX_S)
    )


def _blocked_by_push(row: StripeOutbox) -> bool:
    """A void or paid row waits until the invoice's push has settled."""
    if row.kind == OutboxKind.INVOICE_PUSH:
        return False
    return StripeOutbox.objects.filter(
        invoice_id=row.invoice_id,
        kind=OutboxKind.INVOICE_PUSH,
        status=OutboxStatus.PENDING,
        pk__lt=row.pk,
    ).exists()


def _finish(row: StripeOutbox, status: str, note: str) -> None:
    row.status = status
    row.done_at = timezone.now()
    row.last_error = "" if status == OutboxStatus.DONE else note
    row.save(update_fields=["status", "done_at", "last_error", "attempts", "updated_at"])


def drain_one(now: datetime | None = None) -> tuple[str, StripeOutbox] | None:
    """Claim and run one due row. Returns (outcome, row) or None when nothing is due."""
    now = now or timezone.now()
    with transaction.atomic():
        row = (
            StripeOutbox.objects.select_for_update(skip_locked=True)
            .filter(status=OutboxStatus.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at", "id")
            .first()
        )
        if row is None:
            return None
        if _blocked_by_push(row):
            row.next_attempt_at = now + backoff(1)
            row.save(update_fields=["next_attempt_at", "updated_at"])
            return "deferred", row
        if not stripe_sync.enabled():
            _finish(row, OutboxStatus.SKIPPED, "Stripe sync off (no STRIPE_API_KEY)")
            return "skipped", row
        row.attempts += 1
        try:
            note = stripe_sync.run(stripe_sync.client(), row)
        except Exception as exc:  # any failure: network, Stripe 5xx/4xx, a bug — retry later
            row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            if row.attempts >= settings.BILLING_OUTBOX_MAX_ATTEMPTS:
                row.status = OutboxStatus.FAILED
                log.error("outbox %s gave up after %s attempts: %s", row.pk, row.attempts, exc)
            else:
                row.next_attempt_at = timezone.now() + backoff(row.attempts)
                log.warning("outbox %s attempt %s failed: %s", row.pk, row.attempts, exc)
            row.save(
                update_fields=["attempts", "last_error", "status", "next_attempt_at", "updated_at"]
            )
            return "failed", row
        log.info("outbox %s %s: %s", row.pk, row.kind, note)
        _finish(row, OutboxStatus.DONE, note)
        return "done", row


def drain(*, limit: int = 100, now: datetime | None = None) -> DrainResult:
    """Run up to ``limit`` due rows; report when the earliest remaining one is due."""
    result = DrainResult()
    for _ in range(limit):
        claimed = drain_one(now)
        if claimed is None:
            break
        outcome, row = claimed
        if outcome == "done":
            result.done += 1
        elif outcome == "skipped":
            result.skipped += 1
        elif outcome == "failed":
            result.failed += 1
            result.errors.append(row.last_error)
    result.next_due = (
        StripeOutbox.objects.filter(status=OutboxStatus.PENDING)
        .order_by("next_attempt_at")
        .values_list("next_attempt_at", flat=True)
        .first()
    )
    return result


@transaction.atomic
def outbox_retry(*, row: StripeOutbox) -> StripeOutbox:
    """Put a failed row back in the queue (finance, after fixing the cause)."""
    row = StripeOutbox.objects.select_for_update().get(pk=row.pk)
    if row.status == OutboxStatus.FAILED:
        row.status = OutboxStatus.PENDING
        row.next_attempt_at = timezone.now()
        row.save(update_fields=["status", "next_attempt_at", "updated_at"])
    return row
