"""Writes for the model registry. Read-model pushes follow via the tenants app's hooks."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import transaction

from catalog.models import ModelFamily, ModelVersion, Replica

VERSION_FIELDS = (
    "context_length",
    "kv_bytes_per_token",
    "tpot_target_ms",
    "kv_capacity_tokens",
    "price_prompt_per_mtok",
    "price_cached_prompt_per_mtok",
    "price_completion_per_mtok",
    "currency",
    "is_active",
)


@transaction.atomic
def family_upsert(*, name: str, display_name: str = "", description: str = "") -> ModelFamily:
    family = ModelFamily.objects.filter(name=name).first() or ModelFamily(name=name)
    family.display_name = display_name or family.display_name
    family.description = description or family.description
    family.full_clean()
    family.save()
    return family


@transaction.atomic
def version_upsert(*, family: ModelFamily, name: str, **values: Any) -> ModelVersion:
    """Create or update one weights version; ``values`` are ModelVersion fields."""
    unknown = sorted(set(values) - set(VERSION_FIELDS))
    if unknown:
        raise TypeError(f"unknown version fields: {unknown}")
    version = ModelVersion.objects.filter(name=name).first() or ModelVersion(
        family=family, name=name
    )
    for field, value in values.items():
        setattr(version, field, Decimal(str(value)) if field.startswith("price_") else value)
    version.full_clean()
    version.save()
    return version


@transaction.atomic
def version_make_current(*, version: ModelVersion) -> ModelVersion:
    """Point the family alias at this version (the previous current one stays pinnable)."""
    # Lock the family's versions in pk order, then clear before setting: the partial unique
    # constraint allows one current version per family at every moment.
    list(
        ModelVersion.objects.select_for_update()
        .filter(family=version.family_id)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    for other in ModelVersion.objects.filter(family=version.family_id, is_current=True).exclude(
        pk=version.pk
    ):
        other.is_current = False
        other.save(update_fields=["is_current"])
    version.is_current = True
    version.full_clean()
    version.save(update_fields=["is_current"])
    return version


@transaction.atomic
def replica_upsert(
    *,
    version: ModelVersion,
    name: str,
    base_url: str,
    pool: str = "shared",
    is_enabled: bool = True,
) -> Replica:
    replica = Replica.objects.filter(name=name).first() or Replica(name=name)
    replica.version = version
    replica.base_url = base_url
    replica.pool = pool
    replica.is_enabled = is_enabled
    replica.full_clean()
    replica.save()
    return replica
