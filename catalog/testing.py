"""A priced model version for fixtures and benchmarks (tests, ``bench.ingest``): one
place that knows what a minimal billable 8B version needs."""

from __future__ import annotations

from catalog import services
from catalog.models import ModelFamily, ModelVersion


def priced_version(
    *, family: str, display_name: str, version: str, actor_label: str
) -> ModelVersion:
    """The version ``version`` of ``family`` (both made if missing), with the 8B profile's
    KV figures and a first price of 0.20 / 0.05 / 0.60 per million tokens (prompt, cached
    prompt, completion) when it is made."""
    fam, _ = ModelFamily.objects.get_or_create(name=family, defaults={"display_name": display_name})
    row, created = ModelVersion.objects.get_or_create(
        name=version,
        defaults={
            "family": fam,
            "context_length": 131072,
            "kv_bytes_per_token": 131072,
            "tpot_target_ms": 50,
            "kv_capacity_tokens": 440000,
        },
    )
    if created:
        services.version_first_price(
            version=row,
            prompt="0.20",
            cached_prompt="0.05",
            completion="0.60",
            actor_label=actor_label,
        )
    return row
