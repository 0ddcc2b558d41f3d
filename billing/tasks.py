"""Billing's periodic jobs (schedule in settings.CELERY_BEAT_SCHEDULE)."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from billing import outbox, services

log = logging.getLogger("fairway.billing.tasks")

# A drain that leaves rows waiting schedules itself for when the first is due, at most this
# far ahead (beat's periodic drain covers anything longer).
MAX_SELF_SCHEDULE_S = 300


@shared_task(name="billing.tasks.invoice_cycle", ignore_result=True)
def invoice_cycle() -> dict[str, int]:
    """Draft last month where missing, finalize past the grace period, refresh this month."""
    return services.invoice_cycle(grace_s=settings.BILLING_FINALIZE_GRACE_S)


@shared_task(name="billing.tasks.stripe_outbox_drain", bind=True, ignore_result=True)
def stripe_outbox_drain(self: Any) -> dict[str, int]:
    result = outbox.drain()
    if result.next_due is not None and not self.request.is_eager:
        wait = (result.next_due - timezone.now()).total_seconds()
        if wait < MAX_SELF_SCHEDULE_S:
            # The backoff's next try, without waiting for beat's next tick.
            self.apply_async(countdown=max(wait, 0.0))
    return {"done": result.done, "failed": result.failed, "skipped": result.skipped}
