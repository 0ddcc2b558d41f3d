"""Celery tasks of the metering app (run by beat; see CELERY_BEAT_SCHEDULE)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from celery import shared_task

from metering.store import partitions_maintain

log = logging.getLogger("metering.tasks")


@shared_task(name="metering.tasks.request_log_partitions_maintain", ignore_result=True)
def request_log_partitions_maintain() -> dict[str, list[str]]:
    """Today's and tomorrow's request_log partitions exist; those past retention are gone."""
    done = partitions_maintain(now=datetime.now(UTC))
    if done.created or done.dropped:
        log.info("request_log partitions: created %s, dropped %s", done.created, done.dropped)
    return {
        "created": [d.isoformat() for d in done.created],
        "dropped": [d.isoformat() for d in done.dropped],
    }
