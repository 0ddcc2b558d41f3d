"""Withdrawing a scheduled price change (catalog.services.price_change_withdraw).

A withdrawn row stays (who withdrew it, when, why) and is never in force. The append-only
trigger now lets exactly that through: the ``withdrawn_*`` columns set once, on a row
whose hour has not begun (the database's clock decides), every other column unchanged.
Inserting a row already withdrawn, any other UPDATE, and every DELETE stay refused. One
price per version and hour now counts live rows only, so a withdrawn hour can be
scheduled again.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

WITHDRAWAL_COLUMNS = "ARRAY['withdrawn_at', 'withdrawn_by_id', 'withdrawn_by_label', 'withdrawal_reason']"

GUARD = rf"""
CREATE OR REPLACE FUNCTION catalog_price_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.withdrawn_at IS NOT NULL THEN
            RAISE EXCEPTION 'model prices are append-only: a price is recorded live and '
                'withdrawn afterwards' USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF TG_OP = 'UPDATE'
        AND OLD.withdrawn_at IS NULL
        AND NEW.withdrawn_at IS NOT NULL
        AND NEW.withdrawn_at <= clock_timestamp()
        AND OLD.effective_from > clock_timestamp()
        AND (to_jsonb(NEW) - {WITHDRAWAL_COLUMNS}) = (to_jsonb(OLD) - {WITHDRAWAL_COLUMNS})
    THEN
        RETURN NEW;  -- the withdrawal of a change not yet in force, stamped once
    END IF;
    RAISE EXCEPTION 'model prices are append-only (% refused): record a new price, or '
        'withdraw a change not yet in force', TG_OP
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS catalog_price_append_only ON catalog_modelprice;
CREATE TRIGGER catalog_price_append_only BEFORE INSERT OR UPDATE OR DELETE ON catalog_modelprice
    FOR EACH ROW EXECUTE FUNCTION catalog_price_append_only();
"""

# 0005's trigger, as it was.
UNGUARD = r"""
CREATE OR REPLACE FUNCTION catalog_price_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'model prices are append-only (% refused): record a new price instead',
        TG_OP USING ERRCODE = 'integrity_constraint_violation';
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS catalog_price_append_only ON catalog_modelprice;
CREATE TRIGGER catalog_price_append_only BEFORE UPDATE OR DELETE ON catalog_modelprice
    FOR EACH ROW EXECUTE FUNCTION catalog_price_append_only();
"""


def guard(apps, schema_editor):  # noqa: ANN001, ARG001 - migration signature
    schema_editor.execute(GUARD, params=None)  # no placeholders: RAISE uses %


def unguard(apps, schema_editor):  # noqa: ANN001, ARG001
    schema_editor.execute(UNGUARD, params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0005_model_prices"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="modelprice",
            name="withdrawn_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When the change was withdrawn before taking effect.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="modelprice",
            name="withdrawn_by",
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
            name="withdrawn_by_label",
            field=models.CharField(blank=True, default="", max_length=100),
        ),
        migrations.AddField(
            model_name="modelprice",
            name="withdrawal_reason",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.RemoveConstraint(
            model_name="modelprice",
            name="catalog_price_one_per_version_and_hour",
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.UniqueConstraint(
                condition=models.Q(("withdrawn_at__isnull", True)),
                fields=("version", "effective_from"),
                name="catalog_price_one_live_per_version_and_hour",
                violation_error_message="The version already has a price from that hour.",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelprice",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("withdrawal_reason", ""),
                        ("withdrawn_at__isnull", True),
                        ("withdrawn_by__isnull", True),
                        ("withdrawn_by_label", ""),
                    ),
                    models.Q(
                        ("withdrawn_at__isnull", False),
                        ("withdrawn_at__lt", models.F("effective_from")),
                        models.Q(("withdrawn_by_label", ""), _negated=True),
                        models.Q(("withdrawal_reason", ""), _negated=True),
                    ),
                    _connector="OR",
                ),
                name="catalog_price_withdrawal_says_who_and_why",
            ),
        ),
        migrations.RunPython(guard, unguard),
    ]
