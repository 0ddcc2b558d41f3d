"""Periodic jobs (Celery beat; schedule in settings.CELERY_BEAT_SCHEDULE)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import redis
from celery import shared_task

from contracts.schema import KEY_LAST_USED_HASH
from tenants import services
from tenants.readmodel import read_model, text

log = logging.getLogger("fairway.tasks")

# The gateways keep writing to KEY_LAST_USED_HASH while we flush: rename it away atomically
# first, so no stamp written meanwhile is lost, and a crash mid-flush leaves the batch to
# the next run.
# The hash tag puts it in the same Redis Cluster slot as KEY_LAST_USED_HASH (whose whole
# name is its hash input), as RENAME requires there (layout rule: gateway.admission.quota).
FLUSHING_KEY = "{" + KEY_LAST_USED_HASH + "}:flushing"


@shared_task(name="tenants.tasks.readmodel_rebuild", ignore_result=True)
def readmodel_rebuild() -> int:
    """Heal drift between the database and the gateway's read model."""
    result = read_model().rebuild()
    return len(result.changed)


@shared_task(name="tenants.tasks.readmodel_check", ignore_result=True)
def readmodel_check() -> int:
    """Rebuild at once when the read model is missing (two EXISTS every few seconds).

    A beat-checked flag rather than a subscriber: no extra long-lived process to supervise,
    and a request made while no worker runs is still there when one starts (a pub/sub
    message would be lost). The loaded marker is checked too, so a flushed store is rebuilt
    even if no gateway has seen an unknown key yet.
    """
    model = read_model()
    if not model.needs_rebuild():
        return 0
    log.warning("read model missing or a rebuild was requested; rebuilding now")
    return len(model.rebuild().changed)


@shared_task(name="tenants.tasks.api_tokens_expired_delete", ignore_result=True)
def api_tokens_expired_delete() -> int:
    """Expired management-API tokens are refused; their rows go here (hourly)."""
    return services.api_token_expired_delete()


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
