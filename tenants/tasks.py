"""Periodic jobs (Celery beat; schedule in settings.CELERY_BEAT_SCHEDULE)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import redis
from celery import shared_task

from gateway.schema import KEY_LAST_USED_HASH
from tenants import services
from tenants.readmodel import read_model, text

log = logging.getLogger("fairway.tasks")

# The gateways keep writing to KEY_LAST_USED_HASH while we flush: rename it away atomically
# first, so no stamp written meanwhile is lost, and a crash mid-flush leaves the batch to
# the next run.
FLUSHING_KEY = KEY_LAST_USED_HASH + ":flushing"


@shared_task(name="tenants.tasks.readmodel_rebuild", ignore_result=True)
def readmodel_rebuild() -> int:
    """Heal drift between the database and the gateway's read model."""
    result = read_model().rebuild()
    return len(result.changed)


@shared_task(name="tenants.tasks.api_key_last_used_flush", ignore_result=True)
def api_key_last_used_flush() -> int:
    """Move the gateways' last-used stamps (key_id -> unix seconds) into the database."""
    client = read_model().redis
    if not client.exists(FLUSHING_KEY):
        if not client.exists(KEY_LAST_USED_HASH):
            return 0
        try:
            client.rename(KEY_LAST_USED_HASH, FLUSHING_KEY)
        except redis.ResponseError:  # emptied meanwhile: nothing to flush
            return 0
    raw = client.hgetall(FLUSHING_KEY)
    seen: dict[str, datetime] = {}
    for key_id, stamp in raw.items():
        try:
            seen[text(key_id)] = datetime.fromtimestamp(float(stamp), tz=UTC)
        except (ValueError, OverflowError, OSError):
            log.warning("ignoring malformed last-used stamp %r=%r", key_id, stamp)
    updated = services.api_key_last_used_record(seen=seen)
    client.delete(FLUSHING_KEY)
    return updated
