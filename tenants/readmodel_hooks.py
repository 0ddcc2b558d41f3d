"""Push the read model after every committed write to a pushed entity.

Signals (not service calls) so that every write path is covered: services, the admin,
shell sessions and cascades. ``QuerySet.update()`` sends no signals; code that uses it on
these models must push itself (only ``api_key_last_used_flush`` does, and last_used_at is
not in the read model). A failed push is logged and healed by the periodic rebuild; it
never fails the request whose transaction already committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from catalog.models import ModelFamily, ModelVersion, Replica
from tenants.models import ApiKey, ApiKeyModelLimit, Plan, PlanModelLimit, Tenant, TenantModelLimit
from tenants.readmodel import ReadModelPublisher, read_model

log = logging.getLogger("fairway.readmodel")


def push_on_commit(action: Callable[[ReadModelPublisher], object], what: str) -> None:
    def run() -> None:
        try:
            action(read_model())
        except Exception:
            log.exception("read-model push of %s failed; the periodic rebuild will heal it", what)

    transaction.on_commit(run)


@receiver([post_save, post_delete], sender=ApiKey)
def _api_key_changed(sender: type, instance: ApiKey, **kwargs: Any) -> None:
    key_hash = instance.key_hash
    push_on_commit(lambda rm: rm.push_keys([key_hash]), f"key {instance.prefix}")


@receiver([post_save, post_delete], sender=ApiKeyModelLimit)
def _api_key_limit_changed(sender: type, instance: ApiKeyModelLimit, **kwargs: Any) -> None:
    # The key's limits ride in its record. Read the hash now: on a cascade the key row goes
    # right after its limits, and the key's own delete signal pushes its absence.
    key_hash = (
        ApiKey.objects.filter(pk=instance.api_key_id).values_list("key_hash", flat=True).first()
    )
    if key_hash is not None:
        push_on_commit(lambda rm: rm.push_keys([key_hash]), f"key {instance.api_key_id} limits")


@receiver([post_save, post_delete], sender=Tenant)
def _tenant_changed(sender: type, instance: Tenant, **kwargs: Any) -> None:
    tenant_id = instance.id
    push_on_commit(lambda rm: rm.push_tenant(tenant_id), f"tenant {tenant_id}")


@receiver([post_save, post_delete], sender=TenantModelLimit)
def _tenant_limit_changed(sender: type, instance: TenantModelLimit, **kwargs: Any) -> None:
    tenant_id = instance.tenant_id
    push_on_commit(lambda rm: rm.push_tenant(tenant_id), f"tenant {tenant_id}")


@receiver([post_save, post_delete], sender=Plan)
def _plan_changed(sender: type, instance: Plan, **kwargs: Any) -> None:
    plan_id = instance.pk
    push_on_commit(lambda rm: rm.push_plan(plan_id), f"plan {instance.name}")


@receiver([post_save, post_delete], sender=PlanModelLimit)
def _plan_limit_changed(sender: type, instance: PlanModelLimit, **kwargs: Any) -> None:
    plan_id = instance.plan_id
    push_on_commit(lambda rm: rm.push_plan(plan_id), f"plan {plan_id}")


@receiver([post_save, post_delete], sender=ModelFamily)
@receiver([post_save, post_delete], sender=ModelVersion)
@receiver([post_save, post_delete], sender=Replica)
def _catalog_changed(sender: type, **kwargs: Any) -> None:
    push_on_commit(lambda rm: rm.push_catalog(), "catalog")
