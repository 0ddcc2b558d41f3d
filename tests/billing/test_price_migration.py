"""Migration catalog.0005: the backfilled price history reproduces what was invoiced, so
the first draft after it adjusts no invoiced month."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from catalog.models import PRICE_EPOCH, ModelPrice
from tests.billing.conftest import utc

BEFORE = [("catalog", "0004_prefill_rate")]


@pytest.fixture
def at_0004(transactional_db: None) -> Iterator[MigrationExecutor]:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    executor.loader.build_graph()
    try:
        yield executor
    finally:
        call_command("migrate", verbosity=0)


def test_backfill_keeps_each_invoiced_month_at_the_price_it_was_invoiced_at(
    at_0004: MigrationExecutor,
) -> None:
    # Every app as migrated now: catalog at 0004, the others at their latest.
    at_0004.loader.build_graph()
    apps = at_0004._create_project_state(with_applied_migrations=True).apps
    family = apps.get_model("catalog", "ModelFamily").objects.create(name="m")
    version_model = apps.get_model("catalog", "ModelVersion")
    sizes = {"context_length": 1, "kv_bytes_per_token": 1, "tpot_target_ms": 1}
    changed = version_model.objects.create(
        family=family,
        name="m-1",
        kv_capacity_tokens=1,
        price_prompt_per_mtok=Decimal("0.60"),
        price_cached_prompt_per_mtok=Decimal("0.15"),
        price_completion_per_mtok=Decimal("0.90"),  # was 0.80 when Sept/Oct were invoiced
        **sizes,
    )
    steady = version_model.objects.create(
        family=family,
        name="m-2",
        kv_capacity_tokens=1,
        price_prompt_per_mtok=Decimal("1"),
        price_cached_prompt_per_mtok=Decimal("0.5"),
        price_completion_per_mtok=Decimal("2"),
        **sizes,
    )
    plan = apps.get_model("tenants", "Plan").objects.create(name="p", admission_class="standard")
    tenant = apps.get_model("tenants", "Tenant").objects.create(name="t", plan=plan)
    invoice_model = apps.get_model("billing", "Invoice")
    for month, completion_price in ((utc(2026, 9, 1), "0.80"), (utc(2026, 10, 1), "0.80")):
        end = utc(2026, month.month + 1, 1)
        invoice = invoice_model.objects.create(
            tenant=tenant, period_start=month, period_end=end, currency="usd"
        )
        invoice.lines.create(
            position=1,
            kind="usage",
            model_version=changed,
            token_type="completion",
            tokens=1_000_000,
            unit_price_per_mtok=Decimal(completion_price),
            amount_exact=Decimal(completion_price),
            amount=Decimal(completion_price),
            description="m-1: completion tokens",
        )
        invoice_model.objects.filter(pk=invoice.pk).update(
            status="finalized",
            total=Decimal(completion_price),
            number=f"N{month:%m}",
            finalized_at=end,
        )

    call_command("migrate", "catalog", verbosity=0)

    history = [
        (p.effective_from, p.price_completion_per_mtok, p.replaces_id is not None)
        for p in ModelPrice.objects.filter(version_id=changed.pk).order_by("effective_from")
    ]
    # Sept and Oct at the 0.80 they were invoiced at; today's 0.90 from November on.
    assert history == [
        (PRICE_EPOCH, Decimal("0.8"), False),
        (utc(2026, 11, 1), Decimal("0.9"), True),
    ]
    assert [
        (p.effective_from, p.price_prompt_per_mtok)
        for p in ModelPrice.objects.filter(version_id=steady.pk)
    ] == [(PRICE_EPOCH, Decimal("1"))]
    assert all(p.actor_label == "system:migration catalog.0005" for p in ModelPrice.objects.all())
