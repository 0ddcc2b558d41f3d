"""Reads for the model registry."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from catalog.models import ModelFamily, ModelVersion


def family_list() -> QuerySet[ModelFamily]:
    """Families with their active versions, newest name last."""
    active = ModelVersion.objects.filter(is_active=True).order_by("name")
    return ModelFamily.objects.prefetch_related(
        Prefetch("versions", queryset=active, to_attr="active_versions")
    )
