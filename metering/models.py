"""The hourly usage rollup: billing's only input, kept forever.

One row per (tenant, API key, model version, UTC hour). ``cached_tokens`` is a subset of
``prompt_tokens`` (served from the prefix cache, billed at the cached price). The database
enforces the key, non-negative counters and the subset rule; the pipeline only ever adds.
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q

from metering.events import REASONS


class Usage(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    # A plain id, not a foreign key: usage outlives its key (keys are revoked, rows stay).
    api_key_id = models.UUIDField()
    model_version = models.ForeignKey(
        "catalog.ModelVersion", on_delete=models.PROTECT, related_name="+"
    )
    hour = models.DateTimeField(help_text="Start of the UTC hour the requests started in.")
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    cancelled_requests = models.BigIntegerField(default=0)
    errored_requests = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "usage"
        ordering = ["hour", "tenant_id", "model_version_id"]
        indexes = [models.Index(fields=["tenant", "hour"], name="usage_tenant_hour")]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "api_key_id", "model_version", "hour"], name="usage_key"
            ),
            models.CheckConstraint(
                condition=Q(requests__gte=0)
                & Q(prompt_tokens__gte=0)
                & Q(cached_tokens__gte=0)
                & Q(completion_tokens__gte=0)
                & Q(cancelled_requests__gte=0)
                & Q(errored_requests__gte=0),
                name="usage_counts_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(cached_tokens__lte=F("prompt_tokens")),
                name="usage_cached_within_prompt",
            ),
            models.CheckConstraint(
                condition=Q(cancelled_requests__lte=F("requests"))
                & Q(errored_requests__lte=F("requests")),
                name="usage_outcomes_within_requests",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.model_version_id} {self.hour:%Y-%m-%dT%H}Z"


class RequestLog(models.Model):
    """One row per request the fleet served, for support and reconciliation (30 days).

    The table is partitioned by UTC day on ``started_at`` (created by the migration's SQL,
    not by Django); old days are dropped as whole partitions. The primary key includes the
    partition column, as PostgreSQL requires: a redelivered event carries the same
    ``request_id`` and ``started_at``, so it conflicts in its own partition. The token
    counts are the billed ones, after the pipeline's billing rule, i.e. exactly what was
    added to ``usage``.
    """

    pk = models.CompositePrimaryKey("request_id", "started_at")
    request_id = models.CharField(max_length=64)
    started_at = models.DateTimeField()
    tenant_id = models.UUIDField()
    api_key_id = models.UUIDField()
    model = models.CharField(max_length=100, help_text="The name the client asked for.")
    model_version_id = models.BigIntegerField()
    replica_id = models.CharField(max_length=100)
    prompt_tokens = models.BigIntegerField()
    cached_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    ttft_ms = models.FloatField(null=True)
    tpot_ms = models.FloatField(null=True)
    finish_reason = models.CharField(max_length=16)
    status = models.SmallIntegerField()
    is_retry = models.BooleanField()
    ingested_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "request_log"
        ordering = ["started_at"]

    def __str__(self) -> str:
        return self.request_id


class DeadLetter(models.Model):
    """A ``usage.v1`` message the pipeline refused, kept verbatim with why.

    Written in the same transaction as the batch it arrived in, before that batch's offsets
    are committed, so a refused message is never lost and never blocks the ones after it.
    (topic, partition, offset) is unique: a redelivered batch does not file it twice.
    """

    topic = models.CharField(max_length=255)
    partition = models.IntegerField()
    offset = models.BigIntegerField()
    key = models.BinaryField(null=True)
    payload = models.BinaryField(help_text="The message value exactly as received.")
    reason = models.CharField(max_length=32, choices=[(r, r) for r in REASONS])
    detail = models.TextField(blank=True)
    received_at = models.DateTimeField()

    class Meta:
        db_table = "usage_dead_letter"
        ordering = ["received_at", "partition", "offset"]
        indexes = [models.Index(fields=["reason", "received_at"], name="dead_letter_reason")]
        constraints = [
            models.UniqueConstraint(
                fields=["topic", "partition", "offset"], name="dead_letter_position"
            )
        ]

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}: {self.reason}"
