"""Effective-dated, append-only model prices (catalog.ModelPrice).

Backfills each existing version's history: by default one row in force from the epoch with
the version's price fields; where finalized or paid invoices billed a month at other
prices (the old rule billed a month at the catalog price of its finalization), rows that
reproduce them from those months on, so that no invoiced month is repriced by the
adjustment scan. Then a trigger makes the table append-only (UPDATE and DELETE refused,
raw SQL included), and the version's price fields go: prices live only in ModelPrice.
"""

from collections import Counter, defaultdict
from datetime import UTC, datetime
from decimal import Decimal

import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

import catalog.models

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TOKEN_TYPES = ("prompt", "cached_prompt", "completion")  # billing.TokenType

APPEND_ONLY = r"""
CREATE OR REPLACE FUNCTION catalog_price_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'model prices are append-only (% refused): record a new price instead',
        TG_OP USING ERRCODE = 'integrity_constraint_violation';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER catalog_price_append_only BEFORE UPDATE OR DELETE ON catalog_modelprice
    FOR EACH ROW EXECUTE FUNCTION catalog_price_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS catalog_price_append_only ON catalog_modelprice;
DROP FUNCTION IF EXISTS catalog_price_append_only();
"""


def _next_month(start):  # noqa: ANN001, ANN202
    return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)


def _history(version, billed):  # noqa: ANN001, ANN202
    """(effective_from, prices, reason) rows that reproduce what was invoiced: a month with
    finalized or paid usage lines was billed at the catalog price of its finalization, so
    the history holds that price for the month; the price the version has now applies from
    the month after the last such month (or from the epoch when none was invoiced)."""
    current = (
        version.price_prompt_per_mtok,
        version.price_cached_prompt_per_mtok,
        version.price_completion_per_mtok,
    )
    rows = []
    for month in sorted(billed):
        prices = billed[month]
        triple = tuple(prices.get(tt, now) for tt, now in zip(TOKEN_TYPES, current, strict=True))
        if not rows or rows[-1][1] != triple:
            rows.append(
                (
                    month if rows else EPOCH,
                    triple,
                    f"Backfilled: the price {month:%Y-%m} was invoiced at.",
                )
            )
    if not rows:
        return [(EPOCH, current, "Backfilled: the version's catalog price.")]
    if rows[-1][1] != current:
        after = _next_month(max(billed))
        rows.append((after, current, "Backfilled: the version's catalog price."))
    return rows


def backfill(apps, schema_editor):  # noqa: ANN001, ARG001 - migration signature
    version_model = apps.get_model("catalog", "ModelVersion")
    price_model = apps.get_model("catalog", "ModelPrice")
    line_model = apps.get_model("billing", "InvoiceLine")
    for version in version_model.objects.order_by("pk"):
        # Per invoiced month and token type, the price most of its usage lines carry.
        votes = defaultdict(Counter)
        for month, token_type, price in line_model.objects.filter(
            kind="usage", model_version=version, invoice__status__in=("finalized", "paid")
        ).values_list("invoice__period_start", "token_type", "unit_price_per_mtok"):
            votes[(month.astimezone(UTC), token_type)][price] += 1
        billed = defaultdict(dict)
        for (month, token_type), counter in votes.items():
            billed[month][token_type] = counter.most_common(1)[0][0]
        previous = None
        for effective_from, prices, reason in _history(version, billed):
            previous = price_model.objects.create(
                version=version,
                effective_from=effective_from,
                price_prompt_per_mtok=prices[0],
                price_cached_prompt_per_mtok=prices[1],
                price_completion_per_mtok=prices[2],
                currency=version.currency,
                replaces=previous,
                actor_label="system:migration catalog.0005",
                reason=reason,
            )


def unbackfill(apps, schema_editor):  # noqa: ANN001, ARG001
    # Back to one price per version: the latest row (the table is dropped next).
    version_model = apps.get_model("catalog", "ModelVersion")
    price_model = apps.get_model("catalog", "ModelPrice")
    for v in version_model.objects.all():
        row = price_model.objects.filter(version=v).order_by("-effective_from").first()
        if row is not None:
            v.price_prompt_per_mtok = row.price_prompt_per_mtok
            v.price_cached_prompt_per_mtok = row.price_cached_prompt_per_mtok
            v.price_completion_per_mtok = row.price_completion_per_mtok
            v.save(
                update_fields=[
                    "price_prompt_per_mtok",
                    "price_cached_prompt_per_mtok",
                    "price_completion_per_mtok",
                ]
            )


def guard(apps, schema_editor):  # noqa: ANN001, ARG001
    if schema_editor.connection.vendor != "postgresql":
        raise RuntimeError("catalog prices need PostgreSQL (append-only trigger)")
    schema_editor.execute(APPEND_ONLY, params=None)  # no placeholders: RAISE uses %


def unguard(apps, schema_editor):  # noqa: ANN001, ARG001
    schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0004_prefill_rate"),
        ("billing", "0002_immutability_triggers"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ModelPrice",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "effective_from",
                    models.DateTimeField(help_text="Start of the UTC hour it applies from."),
                ),
                (
                    "price_prompt_per_mtok",
                    models.DecimalField(
                        decimal_places=6,
                        max_digits=12,
                        validators=[django.core.validators.MinValueValidator(Decimal("0"))],
                    ),
                ),
                (
                    "price_cached_prompt_per_mtok",
                    models.DecimalField(
                        decimal_places=6,
                        max_digits=12,
                        validators=[django.core.validators.MinValueValidator(Decimal("0"))],
                    ),
                ),
                (
                    "price_completion_per_mtok",
                    models.DecimalField(
                        decimal_places=6,
                        max_digits=12,
                        validators=[django.core.validators.MinValueValidator(Decimal("0"))],
                    ),
                ),
                ("currency", models.CharField(max_length=3)),
                (
                    "actor_label",
                    models.CharField(
                        help_text="The user's name, or 'system:<what>' for seeds and migrations.",
                        max_length=100,
                    ),
                ),
                ("reason", models.TextField()),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
            options={
                "ordering": ["version_id", "effective_from"],
            },
        ),
        migrations.AddField(
            model_name="modelprice",
            name="actor",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.AddField(
            model_name="modelprice",
            name="replaces",
            field=models.ForeignKey(
                blank=True,
                help_text="The price in force at effective_from when this change was recorded.",
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="catalog.modelprice",
            ),
        ),
        migrations.AddField(
            model_name="modelprice",
            name="version",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT,
                related_name="prices",
                to="catalog.modelversion",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.UniqueConstraint(
                fields=("version", "effective_from"),
                name="catalog_price_one_per_version_and_hour",
                violation_error_message="The version already has a price from that hour.",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("price_prompt_per_mtok__gte", 0),
                    ("price_cached_prompt_per_mtok__gte", 0),
                    ("price_completion_per_mtok__gte", 0),
                ),
                name="catalog_price_non_negative",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("price_cached_prompt_per_mtok__lte", models.F("price_prompt_per_mtok"))
                ),
                name="catalog_price_cached_within_prompt",
                violation_error_message="Cached prompt tokens cannot cost more than prompt tokens.",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("effective_from", catalog.models.UtcHourStart("effective_from"))
                ),
                name="catalog_price_from_an_hour",
                violation_error_message="A price takes effect at the start of a UTC hour.",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("reason", ""), _negated=True),
                    models.Q(("actor_label", ""), _negated=True),
                    models.Q(("currency", ""), _negated=True),
                ),
                name="catalog_price_says_who_and_why",
            ),
        ),
        migrations.RunPython(backfill, unbackfill),
        migrations.RunPython(guard, unguard),
        migrations.RemoveConstraint(
            model_name="modelversion",
            name="catalog_version_prices_non_negative",
        ),
        migrations.RemoveConstraint(
            model_name="modelversion",
            name="catalog_version_cached_price_within_prompt_price",
        ),
        migrations.RemoveField(
            model_name="modelversion",
            name="price_cached_prompt_per_mtok",
        ),
        migrations.RemoveField(
            model_name="modelversion",
            name="price_completion_per_mtok",
        ),
        migrations.RemoveField(
            model_name="modelversion",
            name="price_prompt_per_mtok",
        ),
    ]
